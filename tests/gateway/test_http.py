"""The shared HTTP plumbing of ``loraplex/gateway/http.py``, without a server."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from starlette.requests import Request

from loraplex.errors import InvalidRequestError
from loraplex.gateway.http import (
    MAX_INT32,
    declared_length,
    parse_json_body,
    parse_time_param,
    query_flag,
    query_version,
    sse,
)


def _request(query: str = "", headers: dict[str, str] | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "GET", "path": "/", "query_string":
                    query.encode(), "headers": raw})


def test_json_bodies_must_be_objects_of_real_json() -> None:
    assert parse_json_body(b'{"a": [1, 2.5]}') == {"a": [1, 2.5]}
    for raw in (b"[1]", b'{"a": NaN}', b"{", b"\xff"):
        with pytest.raises(InvalidRequestError):
            parse_json_body(raw)


def test_times_are_iso_8601_and_utc_when_naive() -> None:
    assert parse_time_param({"since": "2024-05-01T10:00"}, "since") == datetime(
        2024, 5, 1, 10, tzinfo=UTC)
    assert parse_time_param({}, "since") is None
    with pytest.raises(InvalidRequestError) as caught:
        parse_time_param({"until": "yesterday"}, "until")
    assert caught.value.param == "until"
    assert parse_time_param({"since": "2024-05-01T12:00+02:00"}, "since") == datetime(
        2024, 5, 1, 10, tzinfo=UTC)
    # past the calendar's ends in UTC: read as those ends (astimezone had raised)
    assert parse_time_param({"since": "9999-12-31T23:59:59-14:00"}, "since") == \
        datetime.max.replace(tzinfo=UTC)
    assert parse_time_param({"since": "0001-01-01T00:00:00+14:00"}, "since") == \
        datetime.min.replace(tzinfo=UTC)


def test_query_flags_and_versions() -> None:
    assert query_flag(_request("x=true"), "x") and not query_flag(_request(), "x")
    with pytest.raises(InvalidRequestError):
        query_flag(_request("x=yes"), "x")
    assert query_version(_request("version=3")) == 3 and query_version(_request()) is None
    for bad in ("0", "-1", "v2", str(MAX_INT32 + 1)):
        with pytest.raises(InvalidRequestError):
            query_version(_request(f"version={bad}"))


def test_content_length_must_be_an_integer() -> None:
    assert declared_length(_request(headers={"Content-Length": "12"})) == 12
    assert declared_length(_request()) is None
    with pytest.raises(InvalidRequestError):
        declared_length(_request(headers={"Content-Length": "twelve"}))


def test_one_server_sent_event() -> None:
    assert sse("[DONE]") == b"data: [DONE]\n\n"
