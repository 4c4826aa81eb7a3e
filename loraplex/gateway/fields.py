"""Readers of JSON request fields shared by the request parsers: each checks one field's
JSON type (and, for the table's fields, their range) and raises an
``InvalidRequestError`` that names the field."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from loraplex.engine.request_fields import RequestField
from loraplex.errors import InvalidRequestError

MAX_STOP_SEQUENCES: Final = 4
MAX_STOP_LENGTH: Final = 256


def bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


def type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            int: "integer", float: "number", type(None): "null"}.get(type(value), "value")


def check_text(param: str, value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(param, "contains a lone surrogate, which is not valid Unicode") from None
    return value


def read_str(body: dict[str, Any], key: str, default: str | None = None) -> str | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(key, f"expected a string, got {type_name(value)}")
    return check_text(key, value)


def read_token_ids(value: Any) -> tuple[int, ...] | None:
    # JSON integers, 16.0 included (JSON Schema's "integer" allows it); None if not all are.
    if not isinstance(value, list) or not all(
            (isinstance(t, int) and not isinstance(t, bool))
            or (isinstance(t, float) and t.is_integer()) for t in value):
        return None
    return tuple(int(t) for t in value)


def read_field(body: dict[str, Any], field: RequestField,
               limits: Mapping[str, int]) -> Any:
    """The value of a field of ``request_fields``' table: its default when absent or null,
    otherwise of its JSON type and in its range (under the server's ``limits``)."""
    value = body.get(field.name)
    if value is None:
        return field.default
    key = field.name
    if field.json_type == "boolean":
        if not isinstance(value, bool):
            raise bad(key, f"expected a boolean, got {type_name(value)}")
        return value
    if field.json_type == "integer":
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 16.0 is an integer in JSON's eyes
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad(key, f"expected an integer, got {type_name(value)}")
    else:
        value = as_float(key, value)
    problem = field.refusal(value, limits)
    if problem is not None:
        raise bad(key, problem)
    return value


# A logit_bias key: a token id in ASCII digits (the sign is left to the range check).
_TOKEN_KEY: Final = re.compile(r"-?[0-9]+")


def as_float(key: str, value: Any, what: str = "a number") -> float:
    """A JSON number as a float; 400 naming ``key`` for any other value or for an integer
    past float's range (JSON's integers have no bound: 1 followed by 400 zeros is one)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad(key, f"expected {what}, got {type_name(value)}")
    try:
        return float(value)
    except OverflowError:
        raise bad(key, f"expected {what}, got an integer too large for one") from None


def read_logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad("logit_bias", f"expected an object, got {type_name(value)}")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        # OpenAI's keys are token ids written as JSON strings, in ASCII digits (a sign is
        # let through for the range check to name). Two spellings of one id ("7", "07")
        # would add their biases past the limit: the second is refused.
        if not _TOKEN_KEY.fullmatch(key):
            raise bad("logit_bias", f"keys must be token ids, got {key[:40]!r}")
        if len(key) > 18:
            raise bad("logit_bias", f"token id {key[:20]}... is out of range")
        token = int(key)
        if token in pairs:
            raise bad("logit_bias", f"token id {token} appears twice")
        pairs[token] = as_float("logit_bias", bias, f"numbers as values, for {key!r}")
    return tuple(pairs.items())


def read_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, f"expected a boolean, got {type_name(value)}")
    return value


def read_stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", "expected a string or an array of strings")
    if len(items) > MAX_STOP_SEQUENCES:
        raise bad("stop", f"at most {MAX_STOP_SEQUENCES} sequences, got {len(items)}")
    for s in items:
        check_text("stop", s)
        if not s or len(s) > MAX_STOP_LENGTH:
            raise bad("stop", f"each sequence must have 1 to {MAX_STOP_LENGTH} characters")
    return tuple(items)
