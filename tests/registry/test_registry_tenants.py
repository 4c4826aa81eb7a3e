"""Tenant use cases on both backends."""

from __future__ import annotations

from datetime import UTC

import pytest
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
