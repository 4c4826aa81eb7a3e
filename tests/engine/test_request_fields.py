"""The field table (``loraplex.engine.request_fields``) is the one source of the sampling
fields' ranges: the HTTP parser and ``SamplingParams`` accept and refuse the same values of
every ranged field, at each end of its range, and the table's entries are consistent with
``SamplingParams`` and with the parser's list of known fields."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from loraplex.engine.request_fields import (
    ENGINE_FIELDS,
    FIELDS,
    Range,
    RequestField,
    route_fields,
)
from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import InvalidRequestError
from loraplex.gateway.schemas import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    parse_chat_completion,
    parse_completion,
)

# Far above any table range that a server limit caps, so only the table's range applies.
LIMIT = 1 << 40


def _edges(field: RequestField) -> list[int | float]:
    """Each end of the field's range and the nearest values past it."""
    rng = field.range
    assert rng is not None
    values: list[int | float] = []
    for end, outward in ((rng.lo, -math.inf), (rng.hi, math.inf)):
        if end is None:
            continue
        if field.json_type == "integer":
            values += [end, end + (1 if outward > 0 else -1)]
        else:
            values += [end, math.nextafter(end, outward), math.nextafter(end, -outward)]
    if rng.hi is None:  # far up an open-ended range
        values.append(LIMIT if field.json_type == "integer" else 1e300)
    return values


def _http_accepts(field: RequestField, value: Any) -> bool:
    body: dict[str, Any] = {"model": "m", field.name: value}
    if field.routes[0] == "completions":
        body["prompt"] = "hi"
        parse = parse_completion
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
        if field.name == "top_logprobs":
            body["logprobs"] = True
        parse = parse_chat_completion
    try:
        parse(body, max_tokens_limit=LIMIT, max_n=LIMIT)
    except InvalidRequestError as exc:
        assert exc.param == field.name, (exc.param, field.name, value)
        return False
    return True


def _engine_accepts(field: RequestField, value: Any) -> bool:
    assert field.keyword is not None
    # min_tokens' own rule (at most max_tokens) kept out of the way of its range.
    extra = {"max_tokens": LIMIT} if field.keyword == "min_tokens" else {}
    try:
        SamplingParams(**{field.keyword: value, **extra})
    except InvalidRequestError as exc:
        assert exc.param == field.keyword, (exc.param, field.keyword, value)
        return False
    return True


_RANGED_HTTP = [f for f in FIELDS if f.range is not None and f.routes and f.keyword]


@pytest.mark.parametrize("field", _RANGED_HTTP, ids=lambda f: f"{f.routes[0]}-{f.name}")
def test_http_and_the_engine_agree_on_every_range(field: RequestField) -> None:
    assert field.range is not None
    for value in _edges(field):
        expected = value in field.range
        assert _http_accepts(field, value) is expected, (field.name, value)
        assert _engine_accepts(field, value) is expected, (field.name, value)


@pytest.mark.parametrize(("name", "value", "accepted"), [
    # the values the two sides used to disagree on, settled on OpenAI's ranges
    ("temperature", 2.0, True), ("temperature", 2.5, False), ("temperature", -0.1, False),
    ("seed", -1, True), ("seed", -(1 << 63), True), ("seed", (1 << 63) - 1, True),
    ("seed", 1 << 63, False), ("seed", (1 << 64) - 1, False),
    ("presence_penalty", 2.5, False), ("repetition_penalty", 0.0, False),
    ("top_k", -2, False), ("top_k", 1 << 31, True), ("top_k", (1 << 31) + 1, False),
])
def test_the_settled_ranges(name: str, value: Any, accepted: bool) -> None:
    field = next(f for f in FIELDS if f.name == name)
    assert _http_accepts(field, value) is accepted
    assert _engine_accepts(field, value) is accepted


def test_entries_setting_one_keyword_agree_and_name_a_sampling_param() -> None:
    params = {f.name: f for f in dataclasses.fields(SamplingParams)}
    for field in FIELDS:
        if field.keyword is None:
            continue
        assert field.keyword in params, field
        first = ENGINE_FIELDS[field.keyword]
        assert (field.json_type, field.range) == (first.json_type, first.range), field
        if field.passed:  # absent over HTTP means what SamplingParams' default means
            assert field.default == params[field.keyword].default, field


def test_each_route_takes_each_name_once_and_knows_it() -> None:
    for route, known in (("completions", COMPLETION_FIELDS), ("chat", CHAT_FIELDS)):
        names = [f.name for f in route_fields(route)]  # type: ignore[arg-type]
        assert len(names) == len(set(names)), names
        assert set(names) <= known


def test_a_documented_range_is_inside_the_accepted_one() -> None:
    # /openapi.json may state less than the server takes, never more.
    for field in FIELDS:
        if field.documented is None:
            continue
        assert field.range is not None
        for end in (field.documented.lo, field.documented.hi):
            assert end is not None and end in field.range, field


def test_range_messages() -> None:
    assert Range(0, 2).requirement("number") == "must be in [0, 2]"
    assert Range(0, 1, lo_open=True).requirement("number") == "must be in (0, 1]"
    assert Range(0, lo_open=True).requirement("number") == "must be > 0"
    assert Range(1, 4).requirement("integer") == "must be between 1 and 4"
    assert float("nan") not in Range() and math.inf not in Range(0)
    assert 10**400 in Range(0) and 10**400 not in Range(0, 1)
