"""OpenAI response objects built from engine outputs: completions, chat, chunks, logprobs."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from loraplex.engine.outputs import SequenceDelta, TokenLogprob
from loraplex.gateway.tools import ToolCallReader, ToolUse

# JSON has no -Infinity; a token the sampler could never pick is reported this low instead.
MIN_LOGPROB: Final = -9999.0

TokenText = Callable[[int], str]


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(delta: SequenceDelta) -> str | None:
    """OpenAI's finish_reason; the engine's "abort" (server shutting down) is not one and
    is handled by the caller as an error."""
    return delta.finish_reason if delta.finish_reason in ("stop", "length") else None


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, sent back before its text (``echo``)."""

    text: str
    token_ids: list[int]


@dataclass
class CompletionLogprobs:
    """The legacy completions ``logprobs`` object, accumulated token by token."""

    top_k: int
    text_offset_start: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def extend(self, entries: Sequence[TokenLogprob | None], token_ids: list[int],
               token_text: TokenText) -> None:
        """Appends tokens; an entry of None (an echoed prompt's first token, which nothing
        predicts) has null logprobs, as OpenAI's."""
        offset = self.text_offset_start + sum(len(t) for t in self.tokens)
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = token_text(token_id)
            self.tokens.append(text)
            self.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            logprob, alternatives = entry
            self.token_logprobs.append(_lp(logprob))
            top: dict[str, float] = {}
            for alt_id, alt_lp in alternatives[: self.top_k]:
                top.setdefault(token_text(alt_id), _lp(alt_lp))
            self.top_logprobs.append(top)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs if self.top_k > 0 else None,
                "text_offset": self.text_offset}


def chat_logprobs(entries: list[TokenLogprob], token_ids: list[int], top_k: int,
                  token_text: TokenText) -> list[dict[str, Any]]:
    """Entries of the chat ``logprobs.content`` array."""
    out = []
    for token_id, (logprob, alternatives) in zip(token_ids, entries, strict=False):
        text = token_text(token_id)
        out.append({
            "token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (alt := token_text(alt_id)), "logprob": _lp(alt_lp),
                 "bytes": list(alt.encode("utf-8"))}
                for alt_id, alt_lp in alternatives[:top_k]],
        })
    return out


@dataclass
class Choice:
    """One of the ``n`` outputs, accumulated for a non-streaming response."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    completion_logprobs: CompletionLogprobs | None = None
    chat_logprobs: list[dict[str, Any]] | None = None


class Accumulator:
    """Collects deltas into the choices of a whole (non-streaming) response."""

    def __init__(self, n: int, logprobs: int | None, token_text: TokenText,
                 echo: Echo | None = None, tools: ToolUse | None = None,
                 chat_echo: str = "") -> None:
        self.choices = [Choice(i, echo.text if echo else "") for i in range(n)]
        self._tools = tools
        self._chat_echo = chat_echo
        self._top_k = logprobs
        self._token_text = token_text
        self._echo = echo
        self.aborted = False

    def add(self, delta: SequenceDelta) -> None:
        choice = self.choices[delta.index]
        choice.text += delta.text_delta
        if delta.finish_reason == "abort":
            self.aborted = True
        choice.finish_reason = finish_reason(delta) or choice.finish_reason
        if self._top_k is not None and self._echo and delta.prompt_logprobs is not None:
            choice.completion_logprobs = CompletionLogprobs(self._top_k)
            choice.completion_logprobs.extend(delta.prompt_logprobs, self._echo.token_ids,
                                              self._token_text)
        if self._top_k is not None and delta.new_logprobs:
            if choice.completion_logprobs is None:
                choice.completion_logprobs = CompletionLogprobs(self._top_k)
            choice.completion_logprobs.extend(delta.new_logprobs, delta.new_token_ids,
                                              self._token_text)
            if choice.chat_logprobs is None:
                choice.chat_logprobs = []
            choice.chat_logprobs += chat_logprobs(delta.new_logprobs, delta.new_token_ids,
                                                  self._top_k, self._token_text)

    def completion(self, rid: str, created: int, model: str,
                   usage_: dict[str, int]) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [
                    {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": (c.completion_logprobs.to_json() if c.completion_logprobs
                                  else None if self._top_k is None
                                  else CompletionLogprobs(self._top_k).to_json())}
                    for c in self.choices],
                "usage": usage_}

    def chat(self, rid: str, created: int, model: str,
             usage_: dict[str, int]) -> dict[str, Any]:
        choices = []
        echo = self._chat_echo
        for c in self.choices:
            # The echoed last message opens the content; calls are read from the answer only.
            message: dict[str, Any] = {"role": "assistant", "content": echo + c.text}
            reason = c.finish_reason
            if self._tools is not None:
                reader = ToolCallReader(self._tools)
                content = reader.feed(c.text)[0] + reader.close()[0]
                if reader.calls:
                    message = {"role": "assistant", "content": echo + content or None,
                               "tool_calls": [call.to_json() for call in reader.calls]}
                    reason = _tool_finish_reason(reason)
            choices.append({"index": c.index, "message": message, "finish_reason": reason,
                            "logprobs": (None if self._top_k is None
                                         else {"content": c.chat_logprobs or []})})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": None, "choices": choices, "usage": usage_}


def _tool_finish_reason(reason: str | None) -> str | None:
    """A choice that called tools and stopped by itself ends with "tool_calls", as
    OpenAI's; one cut by max_tokens still says "length"."""
    return "tool_calls" if reason == "stop" else reason


class ChunkWriter:
    """Turns deltas into streaming chunks (completions or chat)."""

    def __init__(self, *, chat: bool, rid: str, created: int, model: str, n: int,
                 logprobs: int | None, include_usage: bool, token_text: TokenText,
                 echo: Echo | None = None, tools: ToolUse | None = None,
                 chat_echo: str = "") -> None:
        self.chat = chat
        self._chat_echo = chat_echo
        self._readers = [ToolCallReader(tools) for _ in range(n)] if tools else None
        self._echo = echo
        self._echo_pending = [echo is not None] * n
        self._head = {"id": rid, "object": "chat.completion.chunk" if chat
                      else "text_completion", "created": created, "model": model}
        self._top_k = logprobs
        self._include_usage = include_usage
        self._token_text = token_text
        self._sent_role = [False] * n
        self._offsets = [0] * n

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        obj: dict[str, Any] = dict(self._head, choices=choices)
        if self._include_usage:
            obj["usage"] = None
        return dumps(obj)

    def role_chunks(self) -> list[str]:
        """Chat only: the opening chunk of every choice, announcing the assistant, then (as
        vLLM sends it) the echoed last message, if any."""
        if not self.chat:
            return []
        self._sent_role = [True] * len(self._sent_role)
        # With tools the content may stay null (calls only), as in the whole answer.
        opening = None if self._readers else ""
        chunks = []
        for i in range(len(self._sent_role)):
            chunks.append(self._chunk([{"index": i,
                                        "delta": {"role": "assistant", "content": opening},
                                        "logprobs": None, "finish_reason": None}]))
            if self._chat_echo:
                chunks.append(self._chunk([{"index": i, "delta": {"content": self._chat_echo},
                                            "logprobs": None, "finish_reason": None}]))
        return chunks

    def delta_chunk(self, delta: SequenceDelta) -> str | None:
        reason = finish_reason(delta)
        has_logprobs = self._top_k is not None and bool(delta.new_logprobs)
        # Completions only: a choice's first chunk opens with the echoed prompt.
        echo = self._echo if self._echo_pending[delta.index] else None
        self._echo_pending[delta.index] = False
        text = (echo.text if echo else "") + delta.text_delta
        body = self._chat_delta(delta, reason is not None) if self.chat else {}
        if reason is not None and self._readers and self._readers[delta.index].calls:
            reason = _tool_finish_reason(reason)
        if not (body if self.chat else text) and reason is None and not has_logprobs:
            return None  # held back (stop string, partial character, tool call): nothing new
        logprobs: Any = None
        if echo is not None and self._top_k is not None:
            lp = CompletionLogprobs(self._top_k)
            lp.extend(delta.prompt_logprobs or [], echo.token_ids, self._token_text)
            lp.extend(delta.new_logprobs or [], delta.new_token_ids, self._token_text)
            self._offsets[delta.index] += sum(len(t) for t in lp.tokens)
            logprobs = lp.to_json()
        elif has_logprobs and delta.new_logprobs is not None and self._top_k is not None:
            if self.chat:
                logprobs = {"content": chat_logprobs(delta.new_logprobs, delta.new_token_ids,
                                                     self._top_k, self._token_text)}
            else:
                lp = CompletionLogprobs(self._top_k, self._offsets[delta.index])
                lp.extend(delta.new_logprobs, delta.new_token_ids, self._token_text)
                self._offsets[delta.index] += sum(len(t) for t in lp.tokens)
                logprobs = lp.to_json()
        if self.chat:
            choice = {"index": delta.index, "delta": body, "logprobs": logprobs,
                      "finish_reason": reason}
        else:
            choice = {"index": delta.index, "text": text, "logprobs": logprobs,
                      "finish_reason": reason}
        return self._chunk([choice])

    def _chat_delta(self, delta: SequenceDelta, last: bool) -> dict[str, Any]:
        # Content as it comes; with tools, a call's text is held until its block closes,
        # then sent as one tool_calls entry (OpenAI's index, id, type, name, arguments).
        if self._readers is None:
            return {"content": delta.text_delta} if delta.text_delta else {}
        reader = self._readers[delta.index]
        first = len(reader.calls)
        content, calls = reader.feed(delta.text_delta)
        if last:
            more, late = reader.close()
            content, calls = content + more, calls + late
        body: dict[str, Any] = {"content": content} if content else {}
        if calls:
            body["tool_calls"] = [dict(call.to_json(), index=first + k)
                                  for k, call in enumerate(calls)]
        return body

    def usage_chunk(self, usage_: dict[str, int]) -> str | None:
        if not self._include_usage:
            return None
        return dumps(dict(self._head, choices=[], usage=usage_))
