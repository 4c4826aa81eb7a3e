"""Schemathesis fuzzes every operation of /openapi.json on a live server, on SQLite and on
PostgreSQL: no 5xx, ever; and a request valid by the document is never refused for its shape.

The server is the small ``fuzz_live`` one (max_tokens <= 4, n <= 2), so the run stays
bounded; examples per operation are capped too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

LiveServer = Any  # tests/gateway/conftest.py's LiveServer


@pytest.fixture
def api_schema(fuzz_live: LiveServer) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_live.url}/openapi.json")


@pytest.fixture(scope="module")
def http_session() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


# What a valid request may still get: 401/403 (the tenant key on admin routes), 404 (a name
# that does not exist), 409, 429, 413 (the body's byte cap, which no JSON Schema states) and
# 422 (an upload's files are checked as an adapter, which no schema can describe). A 400
# means the document allowed what the server refuses.
POSITIVE = SchemathesisConfig.from_dict({
    "generation": {"mode": "positive"},
    "checks": {"positive_data_acceptance": {
        "expected-statuses": ["2xx", "401", "403", "404", "409", "413", "422", "429"]}}})


@pytest.fixture
def positive_schema(fuzz_live: LiveServer) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_live.url}/openapi.json", config=POSITIVE)


schema = schemathesis.pytest.from_fixture("api_schema")
positive = schemathesis.pytest.from_fixture("positive_schema")


def _bounded(examples: int) -> Any:
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def _call(case: Any, live: LiveServer, session: requests.Session, *checks: Any) -> None:
    case.call_and_validate(base_url=live.url, session=session,
                           headers={"Authorization": f"Bearer {live.keys['fuzzer']}"},
                           checks=[not_a_server_error, *checks], timeout=30)


@schema.parametrize()
@_bounded(20)
def test_no_server_errors(case: Any, fuzz_live: LiveServer,
                          http_session: requests.Session) -> None:
    _call(case, fuzz_live, http_session)


@positive.parametrize()
@_bounded(15)
def test_valid_requests_are_accepted(case: Any, fuzz_live: LiveServer,
                                     http_session: requests.Session) -> None:
    _call(case, fuzz_live, http_session, positive_data_acceptance)
