"""Schemathesis fuzzes every operation of /openapi.json on a live server: no 5xx, ever.

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

LiveServer = Any  # tests/gateway/conftest.py's LiveServer


@pytest.fixture
def api_schema(fuzz_live: LiveServer) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_live.url}/openapi.json")


@pytest.fixture(scope="module")
def http_session() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: Any, fuzz_live: LiveServer,
                          http_session: requests.Session) -> None:
    case.call_and_validate(base_url=fuzz_live.url, session=http_session,
                           headers={"Authorization": f"Bearer {fuzz_live.keys['fuzzer']}"},
                           checks=[not_a_server_error], timeout=30)
