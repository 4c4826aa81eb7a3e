"""Addressable versions in the registry, on SQLite and PostgreSQL: ``name@N``, the current
version (latest by default, set by promote), rollback, deleting the current version, canary
splits and their refusals (each refusal changes nothing)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from sqlalchemy.orm import Session

from loraplex.errors import AdapterNotFoundError, ConflictError, InvalidRequestError
from loraplex.registry import service
from loraplex.registry.models import Adapter, Tenant
from loraplex.registry.names import MAX_VERSION, parse_model_name


def _register(session: Session, tenant: Tenant, name: str, content: str,
              **kwargs: Any) -> Adapter:
    digest = hashlib.sha256(content.encode()).hexdigest()
    return service.register_adapter(
        session, tenant_id=tenant.id, name=name, digest=digest, size_bytes=10,
        storage_path=f"{digest[:2]}/{digest}", base_model="/m", rank=4, alpha=8,
        use_rslora=False, target_modules=["q_proj"], **kwargs)


@pytest.fixture
def acme(session: Session) -> tuple[Tenant, list[Adapter]]:
    """Tenant acme with adapter ``bot`` at versions 1, 2, 3 (public)."""
    tenant = service.create_tenant(session, "acme")
    rows = [_register(session, tenant, "bot", f"v{n}", visibility="public") for n in (1, 2, 3)]
    session.commit()
    return tenant, rows


def _state(session: Session, tenant: Tenant) -> tuple[int | None, int | None, float | None]:
    state = service.name_versions(session, tenant.id, "bot")
    return (state.version(state.traffic.current_id), state.version(state.traffic.canary_id),
            state.traffic.canary_percent)


def test_parse_model_name() -> None:
    assert parse_model_name("bot") == parse_model_name("bot")
    assert (parse_model_name("acme/bot@3").owner, parse_model_name("acme/bot@3").name,
            parse_model_name("acme/bot@3").version) == ("acme", "bot", 3)
    assert parse_model_name("bot@v2").version == 2  # as /v1/usage spells a version
    assert parse_model_name("bot@007").version == 7
    assert parse_model_name(f"bot@{MAX_VERSION}").version == MAX_VERSION
    for bad in ("bot@", "bot@0", "bot@-1", "bot@+1", "bot@1.0", "bot@x", "bot@1@2", "bot@ 1",
                "bot@1 ", "bot@٣", "bot@¹", f"bot@{MAX_VERSION + 1}", "bot@" + "9" * 5000,
                "bot@\x00", "bot@vv1"):
        with pytest.raises(AdapterNotFoundError, match="after '@' comes a version number"):
            parse_model_name(bad)
    with pytest.raises(AdapterNotFoundError) as info:
        parse_model_name("bot@" + "9" * 5000)
    assert len(str(info.value)) < 200  # a huge form is not echoed whole


def test_a_version_is_addressable_and_a_name_reaches_the_latest(
        session: Session, acme: tuple[Tenant, list[Adapter]]) -> None:
    tenant, rows = acme
    assert service.resolve_adapter(session, tenant.id, "bot").id == rows[2].id
    for n in (1, 2, 3):
        assert service.resolve_adapter(session, tenant.id, f"bot@{n}").id == rows[n - 1].id
        assert service.resolve_adapter(session, tenant.id, f"acme/bot@{n}").id == rows[n - 1].id
    bob = service.create_tenant(session, "bob")
    assert service.resolve_adapter(session, bob.id, "acme/bot@1").id == rows[0].id
    for missing in ("bot@4", "bot@99", "acme/bot@4", "nobody/bot@1"):
        with pytest.raises(AdapterNotFoundError):
            service.resolve_adapter(session, tenant.id, missing)
    with pytest.raises(AdapterNotFoundError):  # another tenant's name needs owner/
        service.resolve_adapter(session, bob.id, "bot@1")
    service.delete_adapter(session, tenant.id, "bot", version=1)
    with pytest.raises(AdapterNotFoundError):  # a deleted version is gone for requests
        service.resolve_adapter(session, tenant.id, "bot@1")


def test_private_versions_stay_hidden_from_other_tenants(session: Session) -> None:
    acme = service.create_tenant(session, "acme")
    bob = service.create_tenant(session, "bob")
    _register(session, acme, "bot", "v1", visibility="public")
    _register(session, acme, "bot", "v2")  # private
    with pytest.raises(AdapterNotFoundError) as private:
        service.resolve_adapter(session, bob.id, "acme/bot@2")
    with pytest.raises(AdapterNotFoundError) as missing:
        service.resolve_adapter(session, bob.id, "acme/bot@9")
    # Same words for a private version and a missing one (the name echoed aside).
    assert str(private.value).replace("@2", "@N") == str(missing.value).replace("@9", "@N")
    assert service.resolve_adapter(session, bob.id, "acme/bot@1").version == 1
    # A split onto the private version: bob's callers are never sent there.
    service.promote(session, acme.id, "bot", 1)
    service.start_split(session, acme.id, "bot", 2, 100)
    resolution = service.resolve_versions(session, bob.id, "acme/bot")
    assert (resolution.current.version, resolution.canary) == (1, None)
    own = service.resolve_versions(session, acme.id, "bot")
    assert own.canary is not None and own.canary.version == 2 and own.canary_percent == 100


def test_promote_rollback_and_uploads_after_a_promote(
        session: Session, acme: tuple[Tenant, list[Adapter]]) -> None:
    tenant, rows = acme
    state = service.promote(session, tenant.id, "bot", 1)  # rollback
    assert state.traffic.promoted and state.version(state.traffic.current_id) == 1
    session.commit()
    assert service.resolve_adapter(session, tenant.id, "bot").id == rows[0].id
    assert service.resolve_adapter(session, tenant.id, "bot@3").id == rows[2].id
    # A new upload does not take over a promoted name: it waits for its own promote.
    v4 = _register(session, tenant, "bot", "v4")
    assert service.resolve_adapter(session, tenant.id, "bot").id == rows[0].id
    service.promote(session, tenant.id, "bot", 4.0)  # JSON Schema's integer 4.0 is 4
    assert service.resolve_adapter(session, tenant.id, "bot").id == v4.id
    listed = service.list_visible_adapters(session, tenant.id)
    assert [(a.name, a.version) for a in listed] == [("bot", 4)]


def test_deleting_the_current_version_makes_the_previous_one_current(
        session: Session, acme: tuple[Tenant, list[Adapter]]) -> None:
    tenant, rows = acme
    _register(session, tenant, "bot", "v4")
    service.promote(session, tenant.id, "bot", 3)
    service.delete_adapter(session, tenant.id, "bot", version=3)
    assert _state(session, tenant)[0] == 2  # the previous active one, not the newer 4
    service.delete_adapter(session, tenant.id, "bot", version=1)
    service.delete_adapter(session, tenant.id, "bot", version=2)
    assert _state(session, tenant)[0] == 4  # none below: the next one up, still promoted
    assert service.resolve_adapter(session, tenant.id, "bot").version == 4
    _register(session, tenant, "bot", "v4b")  # so an upload does not take over
    assert service.resolve_adapter(session, tenant.id, "bot").version == 4
    # Without a promote the latest is current: deleting it leaves the one before.
    other = service.create_tenant(session, "other")
    for n in (1, 2):
        _register(session, other, "x", f"o{n}")
    service.delete_adapter(session, other.id, "x", version=2)
    assert service.resolve_adapter(session, other.id, "x").version == 1
    # Deleting every version drops the route: a new upload starts from the latest again.
    service.delete_adapter(session, tenant.id, "bot")
    v5 = _register(session, tenant, "bot", "v6")
    assert service.resolve_adapter(session, tenant.id, "bot").id == v5.id
    assert not service.name_versions(session, tenant.id, "bot").traffic.promoted


def test_a_split_is_set_changed_and_ended(session: Session,
                                          acme: tuple[Tenant, list[Adapter]]) -> None:
    tenant, rows = acme
    service.promote(session, tenant.id, "bot", 2)
    state = service.start_split(session, tenant.id, "bot", 3, 10)
    assert _state(session, tenant) == (2, 3, 10.0)
    assert state.traffic.percent_of(rows[1].id) == 90 and state.traffic.percent_of(rows[2].id) == 10
    resolution = service.resolve_versions(session, tenant.id, "bot")
    assert (resolution.current.id, resolution.canary.id if resolution.canary else None,
            resolution.canary_percent) == (rows[1].id, rows[2].id, 10.0)
    # A named version is that version, split or not.
    assert service.resolve_versions(session, tenant.id, "bot@2").canary is None
    service.start_split(session, tenant.id, "bot", 1, 12.5)  # replaces the split
    assert _state(session, tenant) == (2, 1, 12.5)
    service.cancel_split(session, tenant.id, "bot")
    assert _state(session, tenant) == (2, None, None)
    service.start_split(session, tenant.id, "bot", 3, 50)
    service.promote(session, tenant.id, "bot", 3)  # the canary won: the split ends
    assert _state(session, tenant) == (3, None, None)


def test_a_split_fixes_the_current_version_against_new_uploads(
        session: Session, acme: tuple[Tenant, list[Adapter]]) -> None:
    tenant, _ = acme
    service.start_split(session, tenant.id, "bot", 1, 5)  # current: the latest, 3
    _register(session, tenant, "bot", "v4")
    assert _state(session, tenant) == (3, 1, 5.0)


def test_deleting_a_canary_ends_its_split(session: Session,
                                          acme: tuple[Tenant, list[Adapter]]) -> None:
    tenant, _ = acme
    service.start_split(session, tenant.id, "bot", 1, 30)
    service.delete_adapter(session, tenant.id, "bot", version=1)
    assert _state(session, tenant) == (3, None, None)
    # Deleting the current version onto the canary ends the split too.
    service.promote(session, tenant.id, "bot", 3)
    service.start_split(session, tenant.id, "bot", 2, 30)
    service.delete_adapter(session, tenant.id, "bot", version=3)
    assert _state(session, tenant) == (2, None, None)


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda s, t: service.promote(s, t, "bot", 9), AdapterNotFoundError, "no version 9"),
    (lambda s, t: service.promote(s, t, "nope", 1), AdapterNotFoundError, "no active"),
    (lambda s, t: service.promote(s, t, "a\x00b", 1), AdapterNotFoundError, "no active"),
    (lambda s, t: service.promote(s, t, "bot", 0), InvalidRequestError, "version must"),
    (lambda s, t: service.promote(s, t, "bot", True), InvalidRequestError, "version must"),
    (lambda s, t: service.promote(s, t, "bot", "2"), InvalidRequestError, "version must"),
    (lambda s, t: service.promote(s, t, "bot", 2.5), InvalidRequestError, "version must"),
    (lambda s, t: service.promote(s, t, "bot", float("nan")), InvalidRequestError,
     "version must"),
    (lambda s, t: service.promote(s, t, "bot", 2**31), InvalidRequestError, "version must"),
    (lambda s, t: service.promote(s, t, "bot", 1), ConflictError, "deleted"),
    (lambda s, t: service.start_split(s, t, "bot", 1, 10), ConflictError, "deleted"),
    (lambda s, t: service.start_split(s, t, "bot", 3, 10), ConflictError, "already the "
                                                                          "current"),
    (lambda s, t: service.start_split(s, t, "bot", 9, 10), AdapterNotFoundError, "no version"),
    (lambda s, t: service.start_split(s, t, "bot", 2, 100.01), InvalidRequestError, "percent"),
    (lambda s, t: service.start_split(s, t, "bot", 2, -0.5), InvalidRequestError, "percent"),
    (lambda s, t: service.start_split(s, t, "bot", 2, float("nan")), InvalidRequestError,
     "percent"),
    (lambda s, t: service.start_split(s, t, "bot", 2, float("inf")), InvalidRequestError,
     "percent"),
    (lambda s, t: service.start_split(s, t, "bot", 2, "10"), InvalidRequestError, "percent"),
    (lambda s, t: service.start_split(s, t, "bot", 2, None), InvalidRequestError, "percent"),
    (lambda s, t: service.cancel_split(s, t, "bot"), ConflictError, "no split"),
])
def test_refusals_change_nothing(session: Session, acme: tuple[Tenant, list[Adapter]],
                                 call: Any, error: type[Exception], match: str) -> None:
    tenant, _ = acme
    service.delete_adapter(session, tenant.id, "bot", version=1)
    session.commit()
    before = _state(session, tenant)
    with pytest.raises(error, match=match):
        call(session, tenant.id)
    session.rollback()
    assert _state(session, tenant) == before == (3, None, None)
    assert not service.name_versions(session, tenant.id, "bot").traffic.promoted


def test_the_split_ends_at_0_and_100_percent(session: Session,
                                             acme: tuple[Tenant, list[Adapter]]) -> None:
    tenant, _ = acme
    for percent in (0, 100):
        service.start_split(session, tenant.id, "bot", 1, percent)
        assert _state(session, tenant) == (3, 1, float(percent))


def test_tenants_versions_are_their_own(session: Session,
                                        acme: tuple[Tenant, list[Adapter]]) -> None:
    tenant, _ = acme
    bob = service.create_tenant(session, "bob")
    _register(session, bob, "bot", "b1")
    with pytest.raises(AdapterNotFoundError):  # bob has no version 3 of his own bot
        service.promote(session, bob.id, "bot", 3)
    service.promote(session, tenant.id, "bot", 1)
    assert service.resolve_adapter(session, bob.id, "bot").version == 1
    assert service.resolve_adapter(session, bob.id, "acme/bot").version == 1
    assert service.resolve_adapter(session, tenant.id, "bot").version == 1
