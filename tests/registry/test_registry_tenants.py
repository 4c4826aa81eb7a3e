"""Tenant use cases on both backends."""

from __future__ import annotations

import math
from datetime import UTC

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.registry import service


def test_create_and_read_back(session: Session,
                              session_factory: sessionmaker[Session]) -> None:
    created = service.create_tenant(session, "acme", max_requests_per_minute=60,
                                    max_tokens_per_minute=10_000, max_concurrent_requests=4)
    session.commit()
    assert created.id is not None and created.status == "active"
    with session_factory() as other:  # a second connection sees the committed row
        tenant = service.get_tenant_by_name(other, "acme")
        assert (tenant.max_requests_per_minute, tenant.max_tokens_per_minute,
                tenant.max_concurrent_requests) == (60, 10_000, 4)
        assert tenant.created_at.tzinfo is UTC
        assert service.get_tenant(other, created.id).name == "acme"


def test_limits_default_to_unlimited(session: Session) -> None:
    tenant = service.create_tenant(session, "free")
    assert tenant.max_requests_per_minute is None
    assert tenant.max_tokens_per_minute is None
    assert tenant.max_concurrent_requests is None


def test_list_is_sorted_by_name(session: Session) -> None:
    for name in ("zeta", "alpha", "mid"):
        service.create_tenant(session, name)
    assert [t.name for t in service.list_tenants(session)] == ["alpha", "mid", "zeta"]


def test_duplicate_name_conflicts(session: Session) -> None:
    service.create_tenant(session, "acme")
    with pytest.raises(ConflictError, match="acme"):
        service.create_tenant(session, "acme")


@pytest.mark.parametrize("name", ["", "Acme", "a/b", "a@b", "-x", "x" * 65, "a b", "é"])
def test_invalid_names_refused(session: Session, name: str) -> None:
    with pytest.raises(InvalidRequestError):
        service.create_tenant(session, name)


@pytest.mark.parametrize("limit", [0, -1, True])
def test_invalid_limits_refused(session: Session, limit: int) -> None:
    with pytest.raises(InvalidRequestError, match="max_requests_per_minute"):
        service.create_tenant(session, "acme", max_requests_per_minute=limit)


def test_missing_tenant_not_found(session: Session) -> None:
    with pytest.raises(NotFoundError):
        service.get_tenant(session, 424242)
    with pytest.raises(NotFoundError):
        service.get_tenant_by_name(session, "ghost")


def test_update_limits_changes_only_what_is_given(session: Session) -> None:
    tenant = service.create_tenant(session, "acme", max_requests_per_minute=60,
                                   max_tokens_per_minute=1000)
    service.update_tenant_limits(session, tenant.id, max_requests_per_minute=120)
    assert (tenant.max_requests_per_minute, tenant.max_tokens_per_minute) == (120, 1000)
    service.update_tenant_limits(session, tenant.id, max_tokens_per_minute=None,
                                 max_concurrent_requests=2)
    assert (tenant.max_requests_per_minute, tenant.max_tokens_per_minute,
            tenant.max_concurrent_requests) == (120, None, 2)
    with pytest.raises(InvalidRequestError):
        service.update_tenant_limits(session, tenant.id, max_concurrent_requests=0)


def test_status_suspend_and_reactivate(session: Session) -> None:
    tenant = service.create_tenant(session, "acme")
    service.set_tenant_status(session, tenant.id, "suspended")
    assert tenant.status == "suspended"
    service.set_tenant_status(session, tenant.id, "active")
    assert tenant.status == "active"
    with pytest.raises(InvalidRequestError):
        service.set_tenant_status(session, tenant.id, "deleted")


# --- scheduling settings -----------------------------------------------------------------

SETTINGS = ("weight", "priority_class", "max_kv_fraction", "slo_ttft_ms", "slo_tpot_ms")
GOOD_SETTINGS = {"weight": 9, "priority_class": "batch", "max_kv_fraction": 0.9,
                 "slo_ttft_ms": 9, "slo_tpot_ms": 9}
BIG = 10**400  # past any float: compared, never converted
BAD_SETTINGS = [
    *[("weight", v) for v in (0, 0.0, 0.0099, 5e-324, -1, -1e-9, math.nan, math.inf, -math.inf, 1000.0001,
                              1001, BIG, "abc", "1", True, None, [1])],
    *[("priority_class", v) for v in ("urgent", "", "Interactive", "batch ", None, 1)],
    *[("max_kv_fraction", v) for v in (0, 0.0, -0.5, 1.0001, 2, math.nan, math.inf, BIG,
                                       "0.5", True)],
    *[(field, v) for field in ("slo_ttft_ms", "slo_tpot_ms")
      for v in (0, -1, 3_600_001, BIG, 1.5, 100.0, "100", True, math.nan)],
]


def _settings(tenant: object) -> tuple[object, ...]:
    return tuple(getattr(tenant, field) for field in SETTINGS)


def test_settings_default_to_an_equal_interactive_share(session: Session) -> None:
    tenant = service.create_tenant(session, "acme")
    assert _settings(tenant) == (1.0, "interactive", None, None, None)


def test_settings_are_stored_and_read_back(session: Session,
                                           session_factory: sessionmaker[Session]) -> None:
    service.create_tenant(session, "acme", weight=2.5, priority_class="batch",
                          max_kv_fraction=0.25, slo_ttft_ms=500, slo_tpot_ms=50)
    service.create_tenant(session, "edge", weight=0.01, max_kv_fraction=1,
                          slo_ttft_ms=3_600_000, slo_tpot_ms=1)
    service.create_tenant(session, "top", weight=1000, max_kv_fraction=5e-324)
    session.commit()
    with session_factory() as other:
        assert _settings(service.get_tenant_by_name(other, "acme")) == (
            2.5, "batch", 0.25, 500, 50)
        edge = service.get_tenant_by_name(other, "edge")
        assert _settings(edge) == (0.01, "interactive", 1.0, 3_600_000, 1)
        assert isinstance(edge.max_kv_fraction, float)
        top = service.get_tenant_by_name(other, "top")
        assert (top.weight, top.max_kv_fraction) == (1000.0, 5e-324)
        assert isinstance(top.weight, float)


@pytest.mark.parametrize(("field", "value"), BAD_SETTINGS)
def test_bad_settings_are_refused_naming_the_field(session: Session, field: str,
                                                   value: object) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{field} must be") as refused:
        service.create_tenant(session, "acme", **{field: value})
    assert refused.value.param == field
    assert service.list_tenants(session) == []
    assert len(str(refused.value)) < 200  # a huge number is cut in the message

    tenant = service.create_tenant(session, "bob", weight=3, max_kv_fraction=0.5,
                                   slo_ttft_ms=100)
    before = _settings(tenant)
    with pytest.raises(InvalidRequestError) as refused:
        # Good values around the bad one: none of them is applied either.
        service.update_tenant_limits(session, tenant.id, max_requests_per_minute=7,
                                     **GOOD_SETTINGS | {field: value})
    assert refused.value.param == field
    session.expire_all()  # what the database holds, not only the object
    assert _settings(tenant) == before and tenant.max_requests_per_minute is None


def test_update_settings_changes_only_what_is_given(
        session: Session, session_factory: sessionmaker[Session]) -> None:
    tenant = service.create_tenant(session, "acme", max_requests_per_minute=60)
    service.update_tenant_limits(session, tenant.id, weight=4, priority_class="batch")
    assert _settings(tenant) == (4.0, "batch", None, None, None)
    service.update_tenant_limits(session, tenant.id, max_kv_fraction=0.5, slo_ttft_ms=800,
                                 slo_tpot_ms=40)
    assert _settings(tenant) == (4.0, "batch", 0.5, 800, 40)
    # None returns a nullable setting to the server's default; the rest stay.
    service.update_tenant_limits(session, tenant.id, slo_ttft_ms=None, max_kv_fraction=None)
    session.commit()
    with session_factory() as other:
        read = service.get_tenant(other, tenant.id)
        assert _settings(read) == (4.0, "batch", None, None, 40)
        assert read.max_requests_per_minute == 60


def test_principal_carries_the_settings(session: Session,
                                        session_factory: sessionmaker[Session]) -> None:
    tenant = service.create_tenant(session, "acme", weight=2, priority_class="batch",
                                   max_kv_fraction=0.3, slo_ttft_ms=250, slo_tpot_ms=25)
    _, key = service.create_key(session, tenant.id)
    session.commit()
    principal = service.authenticate(session, key)
    assert principal is not None
    assert (principal.weight, principal.priority_class, principal.max_kv_fraction,
            principal.slo_ttft_ms, principal.slo_tpot_ms) == (2.0, "batch", 0.3, 250, 25)
    session.commit()
    with session_factory() as other:  # changed elsewhere: the next request sees it
        service.update_tenant_limits(other, tenant.id, weight=0.5, slo_tpot_ms=None)
        other.commit()
    principal = service.authenticate(session, key)
    assert principal is not None and (principal.weight, principal.slo_tpot_ms) == (0.5, None)


@pytest.mark.parametrize(("column", "value"), [
    ("weight", 0.0), ("weight", -2.0), ("weight", 1000.5), ("weight", math.nan),
    ("weight", None), ("priority_class", "urgent"), ("priority_class", None),
    ("max_kv_fraction", 0.0), ("max_kv_fraction", 1.5), ("slo_ttft_ms", 0),
    ("slo_ttft_ms", 3_600_001), ("slo_tpot_ms", -5)])
def test_the_database_refuses_what_the_service_does(engine: sa.Engine, column: str,
                                                    value: object) -> None:
    # A raw write (another tool, a hand-made fix) cannot store what the scheduler cannot use.
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenants (name, status, created_at, updated_at) "
                             "VALUES ('raw', 'active', CURRENT_TIMESTAMP, "
                             "CURRENT_TIMESTAMP)"))
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE tenants SET {column} = :v"), {"v": value})
    with engine.connect() as conn:
        row = conn.execute(sa.text(f"SELECT {', '.join(SETTINGS)} FROM tenants")).one()
    assert tuple(row) == (1.0, "interactive", None, None, None)
