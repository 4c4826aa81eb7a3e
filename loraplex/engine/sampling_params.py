"""What a caller asks of generation. Pure Python: validated here, used by the engine.

Each scalar option's type and range come from its entry in ``request_fields.FIELDS``, the
table the HTTP API's parser and document derive from too, so both APIs take the same
values; the rules here are the engine's own (``min_tokens`` up to ``max_tokens``,
``logit_bias``, ``stop``). What needs the served model (a ``logit_bias`` token id below the
vocabulary size) is checked at admission (``loraplex.engine.validation``).
"""

from __future__ import annotations

import hashlib
import json
import numbers
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal

from loraplex.engine.request_fields import ENGINE_FIELDS
from loraplex.errors import InvalidRequestError

MAX_LOGIT_BIAS: Final = 100.0  # OpenAI's [-100, 100]


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: Final = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SOURCE_BYTES: Final = 64 * 1024  # schemas, regexes, grammars, choice lists
MAX_CHOICES: Final = 1024
# Arrays and objects in a JSON schema, nested: real schemas stay far below, and deeper
# ones only cost the grammar engine (and Python's recursion) more.
MAX_SCHEMA_DEPTH: Final = 64
# Temperatures below this sample greedily, as vLLM's do: the distribution is all but the
# argmax's long before, and under about 1e-45 the temperature is 0 in float32 (the
# sampler's dtype), a division by zero.
GREEDY_TEMPERATURE: Final = 1e-5


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint. ``source``: the JSON schema (canonical JSON text), the
    regex, the choices (a JSON list of strings) or the Lark/GBNF grammar; empty for
    ``json_object``. ``param``: the request field it came from, named in errors."""

    kind: GrammarKind
    source: str = ""
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> GrammarSpec:
        if not isinstance(schema, dict) and not isinstance(schema, bool):
            raise InvalidRequestError("the JSON schema must be an object", param=param)
        if json_depth(schema) > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"the JSON schema is nested more than "
                                      f"{MAX_SCHEMA_DEPTH} levels deep", param=param)
        return cls("json_schema", _canonical(schema, param), param)

    @classmethod
    def choice(cls, choices: Any, param: str = "guided_choice") -> GrammarSpec:
        if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequestError(f"must be a list of 1 to {MAX_CHOICES} non-empty "
                                      "strings", param=param)
        return cls("choice", _canonical(choices, param), param)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown constraint {self.kind!r}", param=self.param)
        if len(self.source.encode("utf-8", "surrogatepass")) > MAX_SOURCE_BYTES:
            raise InvalidRequestError(f"is longer than {MAX_SOURCE_BYTES} bytes",
                                      param=self.param)
        if self.kind in ("regex", "grammar") and not self.source:
            raise InvalidRequestError("must not be empty", param=self.param)
        if self.kind in ("regex", "grammar") and "\x00" in self.source:
            raise InvalidRequestError("must not contain a NUL character", param=self.param)

    @property
    def digest(self) -> str:
        """Names the compiled grammar: equal specs compile once."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode(
            "utf-8", "surrogatepass")).hexdigest()


def json_depth(value: Any) -> int:
    """How deeply arrays and objects nest in ``value`` (0 for a scalar), without
    recursion: a body can nest deeper than Python's recursion limit."""
    depth, level = 0, [(value, 1)]
    while level:
        item, d = level.pop()
        children = (item.values() if isinstance(item, dict)
                    else item if isinstance(item, list) else None)
        if children is None:
            continue
        depth = max(depth, d)
        if depth > MAX_SCHEMA_DEPTH:
            return depth  # deep enough to refuse; no need to walk the rest
        level.extend((child, d + 1) for child in children)
    return depth


def _canonical(value: Any, param: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"is not plain JSON: {exc}", param=param) from None


def _as_int(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(f"{param} must be an integer, got {value!r}", param=param)
    return int(value)


def _as_tuple(value: Any, param: str) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"{param} must be a list, got {value!r}", param=param)
    return tuple(value)


def _bias_pair(pair: Any) -> tuple[int, float]:
    """A (token id, bias) pair of logit_bias: the id an integer or its decimal digits."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise InvalidRequestError(f"logit_bias must map token ids to biases, got {pair!r}",
                                  param="logit_bias")
    token, bias = pair
    if isinstance(token, str) and re.fullmatch(r"-?[0-9]+", token):
        token = int(token)
    return _as_int(token, "logit_bias"), _as_float(bias, "logit_bias")


def _as_float(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(f"{param} must be a number, got {value!r}", param=param)
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        raise InvalidRequestError(f"{param} must be a finite number, got {value!r}",
                                  param=param) from None


@dataclass(frozen=True)
class SamplingParams:
    """Generation parameters, named as in vLLM and OpenAI's API."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives per generated token
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: over prompt and output tokens; 1: off
    # (token id, bias) pairs, sorted by id; a mapping is accepted and stored so.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings are ignored before this
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # structured output: what every token must keep to
    # Internal (no HTTP field): the first token's delta carries the log-softmax of the raw
    # logits over the whole vocabulary (``SequenceDelta.distribution``), what the gateway's
    # adapter effect probe compares (gateway/adapter_effect.py).
    first_token_distribution: bool = False
    extra: dict[str, object] = field(default_factory=dict, compare=False)
    # stop_token_ids as a set, made once: the engine asks it of every token (150,000 ids
    # in a tuple cost a scan per token per row).
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Every field is given its type here, or refused naming it: the offline API takes
        # these from Python code, and a wrong type had reached the sampler (top_k=2.5,
        # logprobs=True) and failed the step. A single stop string or a list, stored as a
        # tuple; None for any of the sequences is empty, as in vLLM.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        stop = self.stop if self.stop is not None else ()
        put("stop", (stop,) if isinstance(stop, str) else _as_tuple(stop, "stop"))
        put("stop_token_ids", tuple(_as_int(t, "stop_token_ids") for t in _as_tuple(
            self.stop_token_ids if self.stop_token_ids is not None else (), "stop_token_ids")))
        put("stop_token_set", frozenset(self.stop_token_ids))
        bias = self.logit_bias if self.logit_bias is not None else ()
        pairs = bias.items() if isinstance(bias, Mapping) else _as_tuple(bias, "logit_bias")
        put("logit_bias", tuple(sorted(_bias_pair(pair) for pair in pairs)))
        if not isinstance(self.first_token_distribution, bool):
            raise InvalidRequestError("first_token_distribution must be true or false, got "
                                      f"{self.first_token_distribution!r}",
                                      param="first_token_distribution")
        # Each scalar stored as its type whatever it is given as (`presence_penalty=1` is
        # an int; the sampler's tensors of a batch whose penalties were all ints came out
        # int64); None only where None is the default.
        for name, spec in ENGINE_FIELDS.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if spec.json_type == "number":
                put(name, _as_float(value, name))
            elif spec.json_type == "integer":
                put(name, _as_int(value, name))
            elif not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be true or false, got {value!r}",
                                          param=name)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {message}", param=param)

        for name, spec in ENGINE_FIELDS.items():
            value = getattr(self, name)
            problem = None if value is None else spec.refusal(value)
            if problem is not None:
                raise bad(name, problem)
        # The engine's own rules, beyond each field's range.
        for token_id, value in self.logit_bias:
            if token_id < 0:
                raise bad("logit_bias", f"token ids must be >= 0, got {token_id}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, "
                                        f"{MAX_LOGIT_BIAS:g}], got {value} for {token_id}")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]"
                                    f", got {self.min_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "entries must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


# The keywords that may be None: those whose default is.
_OPTIONAL: Final = frozenset(f.name for f in fields(SamplingParams) if f.default is None)
