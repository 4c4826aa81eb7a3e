"""Incremental detokenization and stop strings."""

from __future__ import annotations

from typing import Any

from loraplex.engine.request import Request

_REPLACEMENT = "\ufffd"  # a token that ends mid-character decodes to this


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def update(self, request: Request) -> str | None:
        """Re-decodes the output; returns the stop string that ended it, if one did.

        Text is truncated at a stop string (kept with ``include_stop_str_in_output``).
        """
        params = request.params
        text = self.tokenizer.decode(request.output_token_ids,
                                     skip_special_tokens=params.skip_special_tokens)
        previous = len(request.output_text)
        request.output_text = text
        if not params.stop or request.num_output_tokens < params.min_tokens:
            return None
        longest = max(len(s) for s in params.stop)
        search_from = max(0, previous - longest + 1)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            idx = text.find(stop, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        request.output_text = text[: idx + len(stop)] if params.include_stop_str_in_output \
            else text[:idx]
        return stop

    @staticmethod
    def take_text_delta(request: Request, final: bool) -> str:
        """Text not yet sent, holding back what may still become a stop string or a
        partial character, unless the sequence is finished."""
        text = request.output_text
        end = len(text)
        if not final:
            if request.params.stop:
                end -= max(len(s) for s in request.params.stop) - 1
            while end > request.num_text_sent and text[end - 1:end] == _REPLACEMENT:
                end -= 1
        if end <= request.num_text_sent:
            return ""
        delta = text[request.num_text_sent:end]
        request.num_text_sent = end
        return delta
