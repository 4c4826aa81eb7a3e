"""The grammar compiler's own process (``python -m loraplex.engine.grammar_worker``).

A schema, regex or grammar is a program for the grammar engine, and some cost it without
bound: ``multipleOf: 1073741824`` allocates until the process aborts, a regex of ``.*``
repeated 20,000 times or an ``allOf`` of backtracking patterns runs for minutes, and a
string ``maxLength`` ending in an emoji panics. Compiled here, such a request costs this
process (which its parent, ``grammar_sandbox``, kills past its CPU time and restarts), not
the server's step loop. The address space is capped at start (``RLIMIT_AS``), so an
allocation past it aborts this process alone; a panic is answered as an error.

Imports only llguidance (no torch): it starts in about a second. Protocol, on stdin and
stdout: each message a 4-byte big-endian length then that many bytes of JSON. The first
request gives the tokenizer (``{"tokenizer": <tokenizer.json text> | null, "vocab_size":
int, "eos_token_ids": [...]}``) and is answered ``{"ok": true}``; then each request is a
spec, ``{"seq", "kind", "source"}``, answered ``{"seq", "grammar": text}`` or ``{"seq",
"error": message}``.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
from typing import IO, TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_HEADER = struct.Struct(">I")
# JSON is written as json.dumps writes it: free whitespace would let a model pad forever
# instead of closing the document.
JSON_LAYOUT: Final[JsonCompileOptions] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def read_message(stream: IO[bytes]) -> Any:
    """The next message on ``stream``, or None at its end."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_message(stream: IO[bytes], message: Any) -> None:
    body = json.dumps(message).encode("utf-8", "surrogatepass")
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def grammar_text(kind: str, source: str) -> str:
    """llguidance's grammar of a spec (``GrammarSpec.kind`` and ``source``), unchecked."""
    import llguidance

    matcher = llguidance.LLMatcher
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}',
                                                defaults=JSON_LAYOUT)
    if kind == "json_schema":
        return matcher.grammar_from_json_schema(source,
                                                defaults=JSON_LAYOUT)
    if kind == "regex":
        return matcher.grammar_from_regex(source)
    if kind == "choice":
        choices = json.loads(source)
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c)
                                                                for c in choices))
    from llguidance.gbnf_to_lark import any_to_lark  # Lark, or GBNF converted to Lark

    return matcher.grammar_from_lark(str(any_to_lark(source)))


def first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid"


def compile_spec(kind: str, source: str, tokenizer: Any) -> dict[str, str]:
    """``{"grammar": text}`` for a spec that compiles (checked against ``tokenizer``, or
    for any tokenizer when it is None), else ``{"error": the first line of why}``."""
    import llguidance

    try:
        grammar = grammar_text(kind, source)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if not error and tokenizer is not None:
            # What the engine does next, and where the costly specs spend (the lexer of
            # multipleOf: 2**30 or of 20,000 ``.*`` is built here): a matcher and its first
            # mask.
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            matcher.compute_bitmask()
            if matcher.is_error():
                error = f"no output satisfies it ({first_line(matcher.get_error())})"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: B036 - a Rust panic is a BaseException
        return {"error": first_line(str(exc))}
    return {"error": first_line(error)} if error else {"grammar": grammar}


def main() -> None:
    memory_bytes = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # Its CPU goes to whatever the engine leaves idle: a spec burning its budget slows
    # nobody's tokens.
    os.nice(10)
    os.environ["RUST_BACKTRACE"] = "0"
    import llguidance

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = read_message(stdin)
    if setup is None:
        return
    tokenizer = None
    if setup["tokenizer"] is not None:
        tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab_size"],
                                           eos_token=setup["eos_token_ids"])
    write_message(stdout, {"ok": True})
    while (request := read_message(stdin)) is not None:
        # The request's number comes back with its answer: the parent serves no reply to
        # a spec it did not send.
        answer = compile_spec(request["kind"], request["source"], tokenizer)
        write_message(stdout, {"seq": request["seq"], **answer})


if __name__ == "__main__":
    main()
