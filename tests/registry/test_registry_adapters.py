"""Adapters: versions, visibility, isolation between tenants, resolution of model names."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import (
    AdapterNotFoundError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
)
from loraplex.registry import service
from loraplex.registry.models import Adapter, Tenant


def _register(session: Session, tenant: Tenant, name: str, content: str = "w",
              **kwargs: Any) -> Adapter:
    digest = hashlib.sha256(content.encode()).hexdigest()
    fields: dict[str, Any] = dict(
        tenant_id=tenant.id, name=name, digest=digest, size_bytes=123,
        storage_path=f"{digest[:2]}/{digest}", base_model="/models/tiny", rank=8, alpha=16,
        use_rslora=False, target_modules=["v_proj", "q_proj"])
    fields.update(kwargs)
    return service.register_adapter(session, **fields)


@pytest.fixture
def two(session: Session) -> tuple[Tenant, Tenant]:
    return service.create_tenant(session, "alice"), service.create_tenant(session, "bob")


def test_register_records_everything(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, _ = two
    row = _register(session, alice, "sql-helper", use_rslora=True, alpha=32)
    session.commit()
    session.expire_all()
    row = service.get_adapter(session, row.id)
    assert (row.name, row.version, row.rank, row.alpha, row.use_rslora) == (
        "sql-helper", 1, 8, 32.0, True)
    assert row.target_modules == ["q_proj", "v_proj"]
    assert (row.visibility, row.status, row.size_bytes) == ("private", "active", 123)
    assert row.identity == f"{row.id}@{row.digest}"
    assert row.created_at.tzinfo is not None


def test_new_upload_is_a_new_version(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, bob = two
    v1 = _register(session, alice, "x", "one")
    v2 = _register(session, alice, "x", "two")
    other = _register(session, bob, "x", "one")  # versions count per tenant and name
    assert (v1.version, v2.version, other.version) == (1, 2, 1)
    assert v1.identity != v2.identity
    resolved = service.resolve_adapter(session, alice.id, "x")
    assert resolved.id == v2.id and resolved.digest == v2.digest


def test_version_numbers_never_reused(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, _ = two
    _register(session, alice, "x", "one")
    service.delete_adapter(session, alice.id, "x")
    assert _register(session, alice, "x", "two").version == 2


def test_same_version_twice_conflicts(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, _ = two
    row = _register(session, alice, "x")
    session.add(Adapter(tenant_id=alice.id, name="x", version=row.version, base_model="m",
                        rank=1, alpha=1.0, use_rslora=False, target_modules=[],
                        digest=row.digest, size_bytes=1, storage_path="p"))
    with pytest.raises(Exception, match="(?i)unique|duplicate"):
        session.flush()


def test_concurrent_upload_becomes_conflict(session: Session,
                                            session_factory: sessionmaker[Session],
                                            two: tuple[Tenant, Tenant],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    alice, _ = two
    session.commit()
    with session_factory() as first, session_factory() as second:
        # Both read "max version = 0" before either commits; the second insert must fail.
        _register(first, service.get_tenant(first, alice.id), "x", "one")
        first.commit()
        real_scalar = second.scalar
        monkeypatch.setattr(second, "scalar", lambda stmt, *a, **k: (
            None if "max" in str(stmt) else real_scalar(stmt, *a, **k)))
        with pytest.raises(ConflictError, match="retry"):
            _register(second, service.get_tenant(second, alice.id), "x", "two")


def test_isolation_private_and_public(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, bob = two
    secret = _register(session, bob, "secret", "s")
    shared = _register(session, bob, "shared", "p", visibility="public")

    # Bob's private adapter is invisible to Alice under every spelling.
    for name in ("secret", "bob/secret"):
        with pytest.raises(AdapterNotFoundError):
            service.resolve_adapter(session, alice.id, name)
    # Bob's public adapter needs its owner's name; the bare name means Alice's own.
    assert service.resolve_adapter(session, alice.id, "bob/shared").id == shared.id
    with pytest.raises(AdapterNotFoundError):
        service.resolve_adapter(session, alice.id, "shared")
    # The owner resolves both, bare or in full.
    assert service.resolve_adapter(session, bob.id, "secret").id == secret.id
    assert service.resolve_adapter(session, bob.id, "bob/secret").id == secret.id


def test_not_found_message_does_not_reveal_existence(session: Session,
                                                     two: tuple[Tenant, Tenant]) -> None:
    alice, bob = two
    _register(session, bob, "secret")
    messages = []
    for name in ("bob/secret", "bob/nothing", "nobody/secret"):
        with pytest.raises(AdapterNotFoundError) as info:
            service.resolve_adapter(session, alice.id, name)
        messages.append(str(info.value).replace(name, "NAME"))
    assert len(set(messages)) == 1


@pytest.mark.parametrize("name", ["", "/x", "bob/", "a/b/c", "/"])
def test_malformed_model_names(session: Session, two: tuple[Tenant, Tenant], name: str) -> None:
    alice, bob = two
    _register(session, bob, "x", visibility="public")
    with pytest.raises(AdapterNotFoundError):
        service.resolve_adapter(session, alice.id, name)


def test_public_resolves_latest_version_only_if_public(
        session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, bob = two
    _register(session, bob, "x", "one", visibility="public")
    v2 = _register(session, bob, "x", "two")  # private: a newer, unpublished version
    with pytest.raises(AdapterNotFoundError):
        service.resolve_adapter(session, alice.id, "bob/x")
    service.set_visibility(session, bob.id, "x", "public")
    assert service.resolve_adapter(session, alice.id, "bob/x").id == v2.id
    service.set_visibility(session, bob.id, "x", "private")
    with pytest.raises(AdapterNotFoundError):
        service.resolve_adapter(session, alice.id, "bob/x")


def test_suspended_owner_hides_public_adapters(session: Session,
                                               two: tuple[Tenant, Tenant]) -> None:
    alice, bob = two
    _register(session, bob, "x", visibility="public")
    service.set_tenant_status(session, bob.id, "suspended")
    with pytest.raises(AdapterNotFoundError):
        service.resolve_adapter(session, alice.id, "bob/x")
    assert service.list_visible_adapters(session, alice.id) == []


def test_delete_all_or_one_version(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, _ = two
    v1 = _register(session, alice, "x", "one")
    v2 = _register(session, alice, "x", "two")
    service.delete_adapter(session, alice.id, "x", version=2)
    assert v2.status == "deleted"
    assert service.resolve_adapter(session, alice.id, "x").id == v1.id  # falls back
    deleted = service.delete_adapter(session, alice.id, "x")
    assert [r.id for r in deleted] == [v1.id]
    with pytest.raises(AdapterNotFoundError):
        service.resolve_adapter(session, alice.id, "x")
    with pytest.raises(AdapterNotFoundError):
        service.delete_adapter(session, alice.id, "x")
    assert service.get_adapter(session, v1.id).status == "deleted"  # the row stays


def test_delete_only_own(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, bob = two
    _register(session, bob, "x", visibility="public")
    with pytest.raises(AdapterNotFoundError):
        service.delete_adapter(session, alice.id, "x")
    with pytest.raises(AdapterNotFoundError):
        service.set_visibility(session, alice.id, "x", "private")


def test_list_visible(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, bob = two
    carol = service.create_tenant(session, "carol")
    _register(session, alice, "mine", "a1")
    mine2 = _register(session, alice, "mine", "a2")
    pub = _register(session, bob, "pub", "b1", visibility="public")
    _register(session, bob, "priv", "b2")
    _register(session, carol, "gone", "c1", visibility="public")
    service.delete_adapter(session, carol.id, "gone")

    visible = service.list_visible_adapters(session, alice.id)
    assert [(a.tenant.name, a.name, a.version) for a in visible] == [
        ("alice", "mine", 2), ("bob", "pub", 1)]
    assert [a.id for a in visible] == [mine2.id, pub.id]
    every = service.list_visible_adapters(session, alice.id, current_only=False)
    assert [(a.name, a.version) for a in every] == [("mine", 1), ("mine", 2), ("pub", 1)]
    assert [a.name for a in service.list_visible_adapters(session, bob.id)] == ["priv", "pub"]


def test_list_adapters_operator_view(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, bob = two
    _register(session, alice, "a")
    _register(session, bob, "b")
    service.delete_adapter(session, bob.id, "b")
    assert [a.name for a in service.list_adapters(session)] == ["a"]
    assert [a.name for a in service.list_adapters(session, include_deleted=True)] == ["a", "b"]
    assert [a.name for a in service.list_adapters(session, bob.id, include_deleted=True)] == [
        "b"]


def test_digest_referenced(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, bob = two
    a = _register(session, alice, "a", "same")
    _register(session, bob, "b", "same")  # identical content, two owners
    assert service.is_digest_referenced(session, a.digest)
    service.delete_adapter(session, alice.id, "a")
    assert service.is_digest_referenced(session, a.digest)
    service.delete_adapter(session, bob.id, "b")
    assert not service.is_digest_referenced(session, a.digest)


def test_invalid_input(session: Session, two: tuple[Tenant, Tenant]) -> None:
    alice, _ = two
    for bad_name in ("a/b", "a@b", "", "x:1", "-x"):
        with pytest.raises(InvalidRequestError):
            _register(session, alice, bad_name)
    with pytest.raises(InvalidRequestError):
        _register(session, alice, "x", visibility="internal")
    with pytest.raises(InvalidRequestError):
        _register(session, alice, "x", rank=0)
    with pytest.raises(NotFoundError):
        _register(session, alice, "x", tenant_id=987654)
    with pytest.raises(InvalidRequestError):
        service.set_visibility(session, alice.id, "x", "everyone")
    with pytest.raises(AdapterNotFoundError):
        service.get_adapter(session, 987654)
