"""API keys: random, shown once, stored as sha256, compared in constant time, revocable."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import InvalidRequestError, NotFoundError, TenantSuspendedError
from loraplex.registry import api_keys, service
from loraplex.registry.models import ApiKey, utcnow


def _all_values(session: Session) -> list[str]:
    out: list[str] = []
    for table in ("tenants", "api_keys", "adapters", "usage"):
        for row in session.execute(sa.text(f"SELECT * FROM {table}")):
            out.extend(str(v) for v in row)
    return out


def test_key_format_and_storage(session: Session) -> None:
    tenant = service.create_tenant(session, "acme")
    row, plaintext = service.create_key(session, tenant.id, name="ci")
    assert plaintext.startswith("lpx-")
    assert len(plaintext) >= len("lpx-") + 43  # 32 random bytes, base64url
    assert row.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert plaintext.startswith(row.prefix) and len(row.prefix) < 16
    assert row.role == "tenant" and row.name == "ci" and row.last_used_at is None
    _, other = service.create_key(session, tenant.id)
    assert other != plaintext


def test_plaintext_never_stored(session: Session, db_url: str) -> None:
    tenant = service.create_tenant(session, "acme")
    keys = [service.create_key(session, tenant.id, role=role)[1]
            for role in ("tenant", "admin")]
    session.commit()
    assert service.authenticate(session, keys[0]) is not None
    session.commit()
    values = _all_values(session)
    for key in keys:
        secret = key[api_keys.DISPLAY_PREFIX_LEN:]
        assert not any(secret in value for value in values)
    if db_url.startswith("sqlite"):  # and not in the file's bytes either (WAL included)
        path = Path(db_url.removeprefix("sqlite:///"))
        raw = b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))
        for key in keys:
            assert key[api_keys.DISPLAY_PREFIX_LEN:].encode() not in raw


def test_authenticate(session: Session) -> None:
    tenant = service.create_tenant(session, "acme", max_requests_per_minute=5,
                                   max_tokens_per_minute=50, max_concurrent_requests=2)
    row, plaintext = service.create_key(session, tenant.id)
    principal = service.authenticate(session, plaintext)
    assert principal is not None
    assert (principal.tenant_id, principal.tenant_name, principal.role, principal.key_id) == (
        tenant.id, "acme", "tenant", row.id)
    assert (principal.max_requests_per_minute, principal.max_tokens_per_minute,
            principal.max_concurrent_requests) == (5, 50, 2)
    assert not principal.is_admin
    _, admin = service.create_key(session, tenant.id, role="admin")
    admin_principal = service.authenticate(session, admin)
    assert admin_principal is not None and admin_principal.is_admin


@pytest.mark.parametrize("bad", ["", "lpx-", "lpx-nope", "Bearer lpx-x", "x" * 300,
                                 "lpx-" + "a" * 300])
def test_unknown_keys_fail(session: Session, bad: str) -> None:
    tenant = service.create_tenant(session, "acme")
    service.create_key(session, tenant.id)
    assert service.authenticate(session, bad) is None


def test_near_miss_key_fails(session: Session) -> None:
    tenant = service.create_tenant(session, "acme")
    _, plaintext = service.create_key(session, tenant.id)
    flipped = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    assert service.authenticate(session, flipped) is None
    assert service.authenticate(session, plaintext + "x") is None


def test_hash_compared_in_constant_time(session: Session,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tenant = service.create_tenant(session, "acme")
    _, plaintext = service.create_key(session, tenant.id)
    calls: list[tuple[bytes, bytes]] = []
    real = api_keys.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", spy)
    assert service.authenticate(session, plaintext) is not None
    assert calls == [(service.hash_key(plaintext).encode(),) * 2]


def test_revoked_key_fails_at_once(session: Session,
                                   session_factory: sessionmaker[Session]) -> None:
    tenant = service.create_tenant(session, "acme")
    row, plaintext = service.create_key(session, tenant.id)
    session.commit()
    assert service.authenticate(session, plaintext) is not None
    session.commit()
    with session_factory() as admin:
        service.revoke_key(admin, row.id)
        admin.commit()
    assert service.authenticate(session, plaintext) is None  # the very next request
    session.rollback()
    revoked_at = session.get(ApiKey, row.id).revoked_at  # type: ignore[union-attr]
    assert revoked_at is not None
    assert service.revoke_key(session, row.id).revoked_at == revoked_at  # idempotent


def test_revoke_scoped_to_tenant(session: Session) -> None:
    a = service.create_tenant(session, "a")
    b = service.create_tenant(session, "b")
    row, _ = service.create_key(session, a.id)
    with pytest.raises(NotFoundError):
        service.revoke_key(session, row.id, tenant_id=b.id)
    assert service.revoke_key(session, row.id, tenant_id=a.id).revoked_at is not None
    with pytest.raises(NotFoundError):
        service.revoke_key(session, 987654)


def test_suspended_tenant_keys_fail(session: Session) -> None:
    tenant = service.create_tenant(session, "acme")
    _, plaintext = service.create_key(session, tenant.id, role="admin")
    service.set_tenant_status(session, tenant.id, "suspended")
    with pytest.raises(TenantSuspendedError, match="'acme' of this API key is suspended"):
        service.authenticate(session, plaintext)
    service.set_tenant_status(session, tenant.id, "active")
    assert service.authenticate(session, plaintext) is not None


def test_last_used_written_at_most_once_a_minute(session: Session) -> None:
    tenant = service.create_tenant(session, "acme")
    row, plaintext = service.create_key(session, tenant.id)
    t0 = utcnow()
    service.authenticate(session, plaintext, now=t0)
    session.commit()
    assert row.last_used_at == t0
    service.authenticate(session, plaintext, now=t0 + timedelta(seconds=30))
    assert not session.dirty  # nothing to write
    service.authenticate(session, plaintext, now=t0 + timedelta(seconds=61))
    session.commit()
    session.expire_all()
    stored = session.get(ApiKey, row.id)
    assert stored is not None and stored.last_used_at == t0 + timedelta(seconds=61)


def test_list_keys_and_bad_input(session: Session) -> None:
    a = service.create_tenant(session, "a")
    b = service.create_tenant(session, "b")
    ka, _ = service.create_key(session, a.id)
    kb, _ = service.create_key(session, b.id, role="admin")
    assert [k.id for k in service.list_keys(session)] == [ka.id, kb.id]
    assert [k.id for k in service.list_keys(session, b.id)] == [kb.id]
    with pytest.raises(InvalidRequestError):
        service.create_key(session, a.id, role="root")
    with pytest.raises(NotFoundError):
        service.create_key(session, 999999)


def test_key_hash_is_unique(session: Session) -> None:
    tenant = service.create_tenant(session, "acme")
    row, _ = service.create_key(session, tenant.id)
    session.add(ApiKey(tenant_id=tenant.id, role="tenant", prefix="lpx-dup",
                       key_hash=row.key_hash))
    with pytest.raises(sa.exc.IntegrityError):
        session.flush()
