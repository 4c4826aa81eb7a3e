"""The request's scalar sampling fields, declared once: each entry's JSON name and type, its
default, its range, its OpenAPI text, the ``SamplingParams`` keyword it sets and which
routes take it.

Both sides read this table. The gateway derives from it the parser of these fields
(``gateway/schemas.py``), their part of /openapi.json (``gateway/openapi_requests.py``) and
the keywords it hands ``SamplingParams`` (``gateway/routes/openai.py``); ``SamplingParams``
gives each keyword its type and checks its range from the same entry, so the HTTP API and
the offline API accept the same values. Adding a sampling option is one entry here plus
the engine's use of it. Pure data: no torch, and nothing of the gateway's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

Route = Literal["completions", "chat"]
JsonType = Literal["integer", "number", "boolean"]
BOTH: Final[tuple[Route, ...]] = ("completions", "chat")
# What a server caps over HTTP beyond a field's own range (ServerConfig's attribute names).
ServerLimit = Literal["max_n", "max_tokens_limit"]

MAX_LOGPROBS: Final = 20
MAX_PENALTY: Final = 2.0  # presence and frequency penalties: OpenAI's [-2, 2]


def _show(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


@dataclass(frozen=True)
class Range:
    """Values from ``lo`` to ``hi``, each end included unless ``*_open``; None: unbounded
    on that side. NaN and the infinities are in no range."""

    lo: int | float | None = None
    hi: int | float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: int | float) -> bool:
        if value != value or value in (float("inf"), float("-inf")):
            return False
        above = self.lo is None or value > self.lo or (not self.lo_open and value == self.lo)
        below = self.hi is None or value < self.hi or (not self.hi_open and value == self.hi)
        return above and below

    def capped(self, hi: int | None) -> Range:
        """This range with its top at ``hi`` too (a server's own limit)."""
        if hi is None or (self.hi is not None and self.hi <= hi):
            return self
        return Range(self.lo, hi, self.lo_open, False)

    def requirement(self, json_type: JsonType) -> str:
        """What a value must be, as error messages say it."""
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            if json_type == "integer" and not (self.lo_open or self.hi_open):
                return f"must be between {_show(lo)} and {_show(hi)}"
            return (f"must be in {'(' if self.lo_open else '['}{_show(lo)}, {_show(hi)}"
                    f"{')' if self.hi_open else ']'}")
        if lo is not None:
            return f"must be {'>' if self.lo_open else '>='} {_show(lo)}"
        if hi is not None:
            return f"must be {'<' if self.hi_open else '<='} {_show(hi)}"
        return "must be finite"


@dataclass(frozen=True)
class RequestField:
    """One scalar field of a generation request.

    ``default``: its value when absent or null over HTTP. ``keyword``: the ``SamplingParams``
    keyword whose type and range this entry states (None: none; ``""``: the JSON name).
    ``passed``: False where the route derives that keyword's value rather than handing the
    field's over (``max_tokens`` from the room the prompt leaves, chat's ``top_logprobs``
    only with ``logprobs: true``). ``routes``: the routes whose body takes it; none for the
    engine's own options. ``limit``: the server setting that also caps it over HTTP.
    ``documented``: the narrower range /openapi.json states where the server takes values
    a schema cannot bound (its ``description`` says the rest)."""

    name: str
    json_type: JsonType
    default: int | float | bool | None
    range: Range | None = None
    description: str = ""
    keyword: str | None = ""
    passed: bool = True
    routes: tuple[Route, ...] = BOTH
    limit: ServerLimit | None = None
    documented: Range | None = None

    def __post_init__(self) -> None:
        if self.keyword == "":
            object.__setattr__(self, "keyword", self.name)

    def accepted(self, limits: Mapping[str, int] | None = None) -> Range | None:
        """The range a value must be in: the field's own, under the server's ``limits``."""
        if self.range is None or self.limit is None or limits is None:
            return self.range
        return self.range.capped(limits[self.limit])

    def refusal(self, value: int | float,
                limits: Mapping[str, int] | None = None) -> str | None:
        """Why ``value`` (of the field's type) is refused, or None when it is in range."""
        accepted = self.accepted(limits)
        if accepted is None or isinstance(value, bool) or value in accepted:
            return None
        return f"{accepted.requirement(self.json_type)}, got {_show(value)}"


LOGPROBS: Final = Range(0, MAX_LOGPROBS)
PENALTY: Final = Range(-MAX_PENALTY, MAX_PENALTY)
_MAX_TOKENS_TEXT: Final = "The most tokens to generate (at most the server's limit)"

FIELDS: Final[tuple[RequestField, ...]] = (
    RequestField("n", "integer", 1, Range(1), "How many completions of the prompt",
                 limit="max_n"),
    RequestField("max_tokens", "integer", None, Range(1), _MAX_TOKENS_TEXT, passed=False,
                 limit="max_tokens_limit"),
    RequestField("max_completion_tokens", "integer", None, Range(1), _MAX_TOKENS_TEXT,
                 keyword="max_tokens", passed=False, routes=("chat",),
                 limit="max_tokens_limit"),
    # OpenAI's range; above 2 a float32 distribution is all but uniform noise.
    RequestField("temperature", "number", 1.0, Range(0, 2),
                 "0 (or under 1e-5): greedy"),
    RequestField("top_p", "number", 1.0, Range(0, 1, lo_open=True),
                 "Sample from the smallest set of tokens whose probability reaches top_p"),
    RequestField("top_k", "integer", 0, Range(-1, 1 << 31),
                 "Keep the k most likely tokens; 0 or -1: off"),
    RequestField("min_p", "number", 0.0, Range(0, 1),
                 "Drop tokens below min_p times the top token's probability"),
    # OpenAI's and vLLM's range (a signed 64-bit integer); the generator takes all of it.
    RequestField("seed", "integer", None, Range(-(1 << 63), (1 << 63) - 1),
                 "Sample reproducibly: the same seed draws the same tokens"),
    RequestField("presence_penalty", "number", 0.0, PENALTY),
    RequestField("frequency_penalty", "number", 0.0, PENALTY),
    RequestField("repetition_penalty", "number", 1.0, Range(0, lo_open=True),
                 "vLLM's, over prompt and output tokens; 1: off. Any value > 0 is "
                 "accepted; this document lists a useful range",
                 documented=Range(0.01, 100.0)),
    RequestField("min_tokens", "integer", 0, Range(0),
                 "EOS, stop_token_ids and stop strings are ignored until this many tokens. "
                 "Up to max_tokens is accepted (a 400 names min_tokens above it); this "
                 "document states the bound that holds whatever max_tokens",
                 limit="max_tokens_limit", documented=Range(0, 1)),
    RequestField("ignore_eos", "boolean", False, description="Generate past EOS"),
    RequestField("include_stop_str_in_output", "boolean", False,
                 description="Keep the stop string that ended the output in it"),
    RequestField("logprobs", "integer", None, LOGPROBS,
                 "The log probabilities of this many alternatives per token (0: only the "
                 "sampled token's)", routes=("completions",)),
    RequestField("logprobs", "boolean", False, description="The sampled tokens' log "
                 "probabilities (top_logprobs: how many alternatives)", keyword=None,
                 routes=("chat",)),
    RequestField("top_logprobs", "integer", None, LOGPROBS,
                 "Alternatives per token, with logprobs: true", keyword="logprobs",
                 passed=False, routes=("chat",)),
    # The engine's own: no route takes them (completions' echo asks prompt_logprobs).
    RequestField("prompt_logprobs", "integer", None, LOGPROBS, routes=()),
    RequestField("skip_special_tokens", "boolean", True, routes=()),
)


def route_fields(route: Route) -> tuple[RequestField, ...]:
    """The entries a route's body takes."""
    return tuple(f for f in FIELDS if route in f.routes)


def _by_keyword() -> dict[str, RequestField]:
    # Entries setting one keyword state its type and range alike (a test holds them so):
    # the first stands for them.
    found: dict[str, RequestField] = {}
    for f in FIELDS:
        if f.keyword is not None:
            found.setdefault(f.keyword, f)
    return found


ENGINE_FIELDS: Final[Mapping[str, RequestField]] = _by_keyword()
