"""Incremental detokenization and stop strings."""

from __future__ import annotations

from typing import Any

from loraplex.engine.request import Request

_REPLACEMENT = "\ufffd"  # a token that ends mid-character decodes to this


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def update(self, request: Request, final: bool = False) -> str | None:
        """Extends the text by the latest token; returns the stop string that ended it, if
        one did. ``final``: the sequence ends with this token (its text is then the whole
        output decoded at once).

        Text is truncated at a stop string (kept with ``include_stop_str_in_output``).
        """
        params = request.params
        previous = len(request.output_text)
        text = self._decode_all(request) if final else self._extend(request)
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

    def _decode_all(self, request: Request) -> str:
        return self.tokenizer.decode(request.output_token_ids,
                                     skip_special_tokens=request.params.skip_special_tokens)

    def _extend(self, request: Request) -> str:
        """The text with the output's latest tokens, decoding only a window of them: the
        tokens since the text last grew (from read_offset), with the ones before those
        (from prefix_offset) as context; the new text is what the window adds to its
        context's. Re-decoding the whole output for every token cost O(n) a token, O(n^2)
        a sequence. A window that ends mid-character (U+FFFD) waits for the next token. If
        a window's text does not extend its context's (a decoder that rewrites across the
        cut), the sequence decodes its whole output from then on (prefix_offset -1)."""
        start, read = request.detok_prefix_offset, request.detok_read_offset
        if start < 0:
            return self._decode_all(request)
        ids = request.output_token_ids
        skip = request.params.skip_special_tokens
        context = self.tokenizer.decode(ids[start:read], skip_special_tokens=skip)
        window = self.tokenizer.decode(ids[start:], skip_special_tokens=skip)
        if not window.startswith(context):
            request.detok_prefix_offset = -1
            return self._decode_all(request)
        if len(window) == len(context) or window.endswith(_REPLACEMENT):
            return request.output_text
        request.detok_prefix_offset, request.detok_read_offset = read, len(ids)
        return request.output_text + window[len(context):]

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
