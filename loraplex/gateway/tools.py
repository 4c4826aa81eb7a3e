"""Tool calls on chat completions: the declared tools, the grammar that enforces a call, the
prompt that shows the tools to the model, and the parser that reads calls back out.

Two text formats of a call are enforced and read, the model's own:

- Hermes/Qwen's ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``, one block per
  call: what a template that names ``<tool_call>`` asks for, and what the fallback system
  message (for a template that renders no tools, the demo model's) asks for.
- Llama 3's bare JSON, the whole answer being ``{"name": "...", "parameters": {...}}`` (calls
  separated by ``"; "`` when several): what a template that renders ``tools`` without naming
  ``<tool_call>`` asks for (Llama 3.1's).

With ``tool_choice`` ``required`` (or a named function) a grammar admits only calls in the
model's format, over the declared tools' (or that one tool's) parameters schemas: exactly one,
or one or more when ``parallel_tool_calls``. With ``auto`` the text is free and the calls the
model wrote are parsed out of it: text before and between blocks stays content, a call that
does not parse stays text. With ``none`` the tools are neither shown nor parsed.

The model sees the tools through its chat template's own ``tools`` when the template uses
them (Llama 3's, Qwen's); otherwise through :func:`fallback_system_text`, added to the system
message, which describes the block format.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from loraplex.engine.grammar import JSON_LAYOUT
from loraplex.engine.sampling_params import GrammarSpec
from loraplex.errors import InvalidRequestError

CALL_OPEN: Final = "<tool_call>"
CALL_CLOSE: Final = "</tool_call>"
MAX_TOOLS: Final = 128
BARE_SEPARATOR: Final = "; "  # between Llama 3's bare JSON calls
_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names

ToolMode = Literal["auto", "required"]


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


@dataclass(frozen=True)
class Tool:
    """A declared function; ``parameters`` is its JSON schema (an empty object schema when
    the request left it out, as OpenAI reads it)."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    # The parameters as an output constraint: what the route compiles to check them.
    spec: GrammarSpec = field(compare=False)

    def to_json(self) -> dict[str, Any]:
        """The OpenAI shape, as chat templates' ``tools`` expect it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """What a request allows: the tools shown to the model, whether a call is forced
    (``required``; ``function`` names the one tool it must call) and how many calls."""

    tools: tuple[Tool, ...]
    mode: ToolMode
    function: str | None
    parallel: bool
    # The model's calls are Llama 3's bare JSON objects, {"name": ..., "parameters": ...}
    # (its chat template renders the tools and names no <tool_call> block): the grammar
    # forces that format, and ``auto`` reads it besides the blocks.
    bare: bool = False

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def parameter_specs(self) -> tuple[GrammarSpec, ...]:
        """Each tool's parameters schema, to compile (checked) before the request runs."""
        return tuple(t.spec for t in self.tools)

    def grammar(self) -> GrammarSpec | None:
        """The Lark grammar of the calls a forced choice admits; None for ``auto``."""
        if self.mode == "auto":
            return None
        allowed = [t for t in self.tools if self.function in (None, t.name)]
        key = "parameters" if self.bare else "arguments"
        rules = [f"call_{i}: %json {json.dumps(_call_schema(t, key))}" for i, t in
                 enumerate(allowed)]
        alternatives = " | ".join(f"call_{i}" for i in range(len(allowed)))
        if self.bare:
            head = ["start: call" + (f" ({json.dumps(BARE_SEPARATOR)} call)*"
                                     if self.parallel else ""), f"call: {alternatives}"]
        else:
            head = [f"start: call{'+' if self.parallel else ''}",
                    f"call: {json.dumps(CALL_OPEN)} ({alternatives}) {json.dumps(CALL_CLOSE)}"]
        return GrammarSpec("grammar", "\n".join([*head, *rules]), "tool_choice")


def _call_schema(tool: Tool, key: str) -> dict[str, Any]:
    # JSON written as json.dumps writes it (no free whitespace), name before arguments. The
    # parameters' definitions move to the root, where their "#/$defs/..." refs now point
    # (pydantic's schemas use them).
    arguments = dict(tool.parameters)
    defs: dict[str, Any] = {k: arguments.pop(k) for k in ("$defs", "definitions")
                            if k in arguments}
    return {"type": "object", "properties": {"name": {"const": tool.name}, key: arguments},
            "required": ["name", key], "additionalProperties": False,
            "x-guidance": dict(JSON_LAYOUT), **defs}


def _tool(i: int, raw: Any) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type") != "function" \
            or not isinstance(raw.get("function"), dict):
        raise _bad(param, "expected {\"type\": \"function\", \"function\": {...}}")
    extra = sorted(set(raw) - {"type", "function"})
    if extra:
        raise _bad(param, f"unknown field {extra[0]!r}")
    fn = raw["function"]
    extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if extra:
        raise _bad(f"{param}.function", f"unknown field {extra[0]!r}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{param}.function.name", "must be 1 to 64 of a-z, A-Z, 0-9, _ and -")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{param}.function.description", "expected a string")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise _bad(f"{param}.function.strict", "expected a boolean")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, dict):
        raise _bad(f"{param}.function.parameters", "expected a JSON schema object")
    # Built first: it refuses a schema nested too deeply for the text checks below.
    spec = GrammarSpec.json_schema(parameters, f"{param}.function.parameters")
    # The tools are rendered into the prompt as text: it must be valid Unicode.
    for where, value in ((f"{param}.function.description", description),
                         (f"{param}.function.parameters", parameters)):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, ValueError, TypeError):
            raise _bad(where, "is not plain JSON of valid Unicode") from None
    # Compiled by the route, off the event loop, whatever tool_choice is: with "auto" no
    # grammar ever compiles it, and a grammar of several tools could not say which one is
    # wrong.
    return Tool(name, description, parameters, spec)


def parse_tools(body: dict[str, Any]) -> ToolUse | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when no
    tool may be called (none declared, or ``tool_choice: "none"``)."""
    raw_tools = body.get("tools")
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise _bad("tools", "expected an array of tools")
    if raw_tools is not None and len(raw_tools) > MAX_TOOLS:
        # OpenAI's limit; each tool's schema is compiled before the request runs.
        raise _bad("tools", f"at most {MAX_TOOLS} tools, got {len(raw_tools)}")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw_tools or []))
    # A name declared twice is not refused (no JSON Schema can say names differ, so the
    # OpenAPI document could not either): a call of it may match either declaration.
    names = {t.name for t in tools}
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "expected a boolean")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise _bad("tool_choice", "requires tools")
    if choice in ("auto", "required"):
        return ToolUse(tools, "auto" if choice == "auto" else "required", None,
                       parallel is not False)
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise _bad("tool_choice", "expected none, auto, required or {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}")
    name = choice["function"]["name"]
    if name not in names:
        raise _bad("tool_choice", f"names the function {name!r}, which tools does not declare")
    return ToolUse(tools, "required", name, parallel is not False)


# --- the prompt --------------------------------------------------------------------------


def fallback_system_text(tools: tuple[Tool, ...]) -> str:
    """How the tools reach a model whose chat template does not render ``tools``: short,
    since it takes room from the context."""
    lines = [json.dumps(t.to_json()["function"], ensure_ascii=False, separators=(",", ":"))
             for t in tools]
    return ("Functions you may call (name, description, JSON schema of the arguments):\n"
            + "\n".join(lines) + "\nTo call one, answer " + CALL_OPEN
            + '{"name": "...", "arguments": {...}}' + CALL_CLOSE + ".")


def tool_arguments(text: str, param: str = "messages") -> Any:
    """A tool call's ``arguments`` as templates (and the model) see them: OpenAI sends JSON
    text, so the object it holds, or the text itself where it is not JSON (or nested past
    the parser's depth). InvalidRequestError naming ``param`` where the object holds a
    string that is not valid Unicode: an escaped lone surrogate (``"\\ud800"``) is valid
    JSON text but no tokenizer takes what it decodes to."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        return text
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{param}: the arguments hold a lone surrogate, which is "
                                  "not valid Unicode", param=param) from None
    return value


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat request, as the parser reads it (here, beside the tool calls it
    may carry, so this module needs nothing of the parser's)."""

    role: str
    content: str | None  # None only for an assistant message that just calls tools
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


def template_input(messages: Sequence[ChatMessage], tools: ToolUse | None,
                   native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The chat template's ``messages`` and ``tools``. ``native``: the template renders tools,
    assistant ``tool_calls`` and the ``tool`` role itself. Otherwise the tools go into the
    system message (:func:`fallback_system_text`), earlier calls into the assistant's text
    as the blocks the model is asked to write, and a tool's result into a user message
    ``<tool_response>...</tool_response>`` (templates that know no ``tool`` role still
    render it)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if native:
            entry: dict[str, Any] = {"role": m.role, "content": m.content or ""}
            if m.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": tool_arguments(c.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            out.append(entry)
        elif m.role == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>{m.content}</tool_response>"})
        else:
            calls = "".join(
                CALL_OPEN + json.dumps({"name": c.name, "arguments": tool_arguments(c.arguments)},
                                       ensure_ascii=False) + CALL_CLOSE
                for c in m.tool_calls)
            out.append({"role": m.role, "content": (m.content or "") + calls})
    if tools is None:
        return out, None
    if native:
        return out, [t.to_json() for t in tools.tools]
    text = fallback_system_text(tools.tools)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


# --- reading calls -----------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """A call the model made; ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _parse_call(block: str, names: frozenset[str]) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} \
            or obj["name"] not in names or not isinstance(obj["arguments"], dict):
        return None
    return ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


def _parse_bare_calls(text: str, names: frozenset[str],
                      max_calls: int | None) -> list[ToolCall] | None:
    """A whole answer that is calls as Llama 3's template asks for them: each
    ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) naming a declared tool,
    separated by ``;``; None when it is anything else (or more calls than allowed)."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos, text = 0, text.strip()
    while True:
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        if not isinstance(obj, dict) or len(obj) != 2 or obj.get("name") not in names:
            return None
        arguments = obj.get("parameters", obj.get("arguments"))
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False)))
        rest = text[pos:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return None
        pos = len(text) - len(rest[1:].lstrip())
    if max_calls is not None and len(calls) > max_calls:
        return None
    return calls


def _held_prefix(text: str) -> int:
    # How many trailing characters could be the start of CALL_OPEN.
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallReader:
    """Splits one choice's text, as it streams, into content and calls.

    Content is released as soon as it cannot be the start of a call; a block is held until
    it closes. Once a call was read, whitespace between and after blocks is dropped (the
    grammar's calls follow each other; a model may put newlines between them). Streamed and
    whole answers go through this same reader, so they agree.
    """

    def __init__(self, tools: ToolUse) -> None:
        self._names = tools.names
        self._max_calls = None if tools.parallel else 1
        self._buffer = ""
        self._gap = ""
        self._in_call = False
        self.calls: list[ToolCall] = []
        # Llama 3's bare JSON calls: an answer that opens with "{" is held whole until the
        # end (None once the answer is known not to be one).
        self._bare: str | None = "" if tools.bare else None

    def _content(self, text: str) -> str:
        if not self.calls:
            return text
        self._gap += text
        if not self._gap.strip():
            return ""
        out, self._gap = self._gap, ""
        return out

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content that can be sent now, and the calls completed by ``text``."""
        if self._bare is not None:
            self._bare += text
            opening = self._bare.lstrip()[:1]
            if opening in ("", "{"):
                return "", []
            text, self._bare = self._bare, None
        self._buffer += text
        content: list[str] = []
        new: list[ToolCall] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(CALL_OPEN)
                full = self._max_calls is not None and len(self.calls) >= self._max_calls
                if start < 0 or full:
                    keep = 0 if full else _held_prefix(self._buffer)
                    content.append(self._content(self._buffer[:len(self._buffer) - keep]))
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._content(self._buffer[:start]))
                self._buffer = self._buffer[start + len(CALL_OPEN):]
                self._in_call = True
                continue
            end = self._buffer.find(CALL_CLOSE)
            if end < 0:
                break
            block, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE):]
            self._in_call = False
            call = _parse_call(block, self._names)
            if call is None:
                content.append(self._content(CALL_OPEN + block + CALL_CLOSE))
            else:
                self._gap = ""
                self.calls.append(call)
                new.append(call)
        return "".join(content), new

    def close(self) -> tuple[str, list[ToolCall]]:
        """At the end: what was held back (a partial tag, an unclosed block) is content; a
        held bare JSON answer is a call, or content."""
        if self._bare is not None:
            held, self._bare = self._bare, None
            calls = _parse_bare_calls(held, self._names, self._max_calls)
            if calls:
                self.calls += calls
                return "", calls
            content, calls = self.feed(held)
            more, late = self.close()
            return content + more, calls + late
        rest = (CALL_OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return self._content(rest), []
