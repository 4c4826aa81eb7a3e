"""Which version of an adapter a request reaches: versions by number, the current one,
canary splits.

A ``model`` field names a version (``name@N``, ``owner/name@N``) or a name. A name reaches
its **current** version: the latest active one, unless a promote set another
(``adapter_routes.current_id``); rollback is promoting an older version. During a canary
split the name sends ``canary_percent`` of its requests to the canary version instead;
which request goes where is the gateway's choice (``gateway.splits``), so each request
still reaches one concrete ``id@digest``. A promote or a cancel ends the split.

Deleting versions keeps the route on active ones: a deleted current version hands over to
the previous active one (the newest below it; with none, the oldest above it), a deleted
canary ends the split, and deleting a name's last version drops its route.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session, aliased, contains_eager

from loraplex.errors import AdapterNotFoundError, ConflictError, InvalidRequestError
from loraplex.registry.models import Adapter, AdapterRoute, Tenant
from loraplex.registry.names import (
    MAX_VERSION,
    is_adapter_name,
    is_tenant_name,
    parse_model_name,
)


@dataclass(frozen=True)
class Resolution:
    """What a ``model`` field reached for its caller: one version, or (a name during a
    split) the current version and a canary that gets ``canary_percent`` of requests."""

    current: Adapter
    canary: Adapter | None = None
    canary_percent: float = 0.0


@dataclass(frozen=True)
class Traffic:
    """Where a name's requests go: its current version (``promoted``: set by a promote,
    else the latest) and a canary split, if one is in progress."""

    current_id: int
    promoted: bool
    canary_id: int | None = None
    canary_percent: float | None = None

    def percent_of(self, adapter_id: int) -> float:
        """The share of the name's requests that version gets, in percent."""
        if adapter_id == self.current_id:
            return 100.0 - (self.canary_percent or 0.0)
        if adapter_id == self.canary_id:
            return self.canary_percent or 0.0
        return 0.0


@dataclass(frozen=True)
class NameVersions:
    """A tenant's adapter name: its active versions (oldest first) and their traffic."""

    tenant_id: int
    name: str
    versions: list[Adapter]
    traffic: Traffic

    def version(self, adapter_id: int | None) -> int | None:
        return next((a.version for a in self.versions if a.id == adapter_id), None)


# --- checks ------------------------------------------------------------------------------


def check_version(value: object, param: str = "version") -> int:
    """A version number: an integer from 1 to MAX_VERSION (``3.0`` too, as JSON Schema
    counts integers); InvalidRequestError naming ``param`` otherwise."""
    if isinstance(value, float) and value.is_integer() and 1 <= value <= MAX_VERSION:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_VERSION:
        raise InvalidRequestError(f"{param} must be an integer from 1 to {MAX_VERSION}, got "
                                  f"{_shown(value)}", param=param)
    return value


def check_percent(value: object, param: str = "percent") -> float:
    """A split's percentage: a number from 0 to 100; InvalidRequestError naming ``param``."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or not 0 <= value <= 100:
        raise InvalidRequestError(f"{param} must be a number from 0 to 100, got "
                                  f"{_shown(value)}", param=param)
    return float(value)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}..."


# --- resolution --------------------------------------------------------------------------


def _is_visible(row: Adapter, tenant_id: int) -> bool:
    return row.tenant_id == tenant_id or (row.is_public and row.tenant.status == "active")


def resolve_versions(session: Session, tenant_id: int, model_name: str) -> Resolution:
    """What ``model_name`` reaches for the calling tenant.

    ``name`` is the caller's own adapter, ``owner/name`` the owner's (visible if the
    caller is the owner, or if the version is public and its owner active); ``@N`` names
    version N, else the name's current version and its split (a canary the caller may not
    see is left out). Anything else raises AdapterNotFoundError with the same message, so
    a private adapter's existence is not revealed (a malformed ``@`` form too, its message
    saying what a version looks like).
    """
    parsed = parse_model_name(model_name)
    not_found = AdapterNotFoundError(f"the model {model_name!r} does not exist or you do not "
                                     "have access to it")
    # A name no tenant or adapter can have is not looked up (nor sent to the database).
    if not is_adapter_name(parsed.name) or (parsed.owner is not None
                                            and not is_tenant_name(parsed.owner)):
        raise not_found
    # One statement whatever exists: a missing owner, a missing adapter or version and a
    # private one cost the same queries, so the answer's timing does not tell them apart.
    owner = Tenant.name == parsed.owner if parsed.owner is not None else Tenant.id == tenant_id
    stmt = (sa.select(Adapter, AdapterRoute.current_id, AdapterRoute.canary_id,
                      AdapterRoute.canary_percent)
            .join(Adapter.tenant).options(contains_eager(Adapter.tenant))
            .outerjoin(AdapterRoute, sa.and_(AdapterRoute.tenant_id == Adapter.tenant_id,
                                             AdapterRoute.name == Adapter.name))
            .where(owner, Adapter.name == parsed.name, Adapter.status == "active"))
    if parsed.version is not None:
        stmt = stmt.where(Adapter.version == parsed.version)
    else:
        other = aliased(Adapter)
        latest = (sa.select(sa.func.max(other.version))
                  .where(other.tenant_id == Adapter.tenant_id, other.name == Adapter.name,
                         other.status == "active").scalar_subquery())
        stmt = stmt.where(sa.or_(Adapter.id == AdapterRoute.current_id,
                                 Adapter.id == AdapterRoute.canary_id,
                                 Adapter.version == latest))
    # A long-lived session must still see a deletion or promote made elsewhere.
    rows = session.execute(stmt.execution_options(populate_existing=True)).all()
    if not rows:
        raise not_found
    found = {row[0].id: row[0] for row in rows}
    latest_row = max(found.values(), key=lambda a: a.version)
    if parsed.version is not None:
        current, canary, percent = latest_row, None, 0.0
    else:
        _, current_id, canary_id, canary_percent = rows[0]
        current = found.get(current_id, latest_row) if current_id is not None else latest_row
        canary = found.get(canary_id) if canary_id is not None else None
        percent = canary_percent or 0.0
    if not _is_visible(current, tenant_id):
        raise not_found
    if canary is None or canary.id == current.id or not _is_visible(canary, tenant_id):
        return Resolution(current)
    return Resolution(current, canary, percent)


def list_current_versions(session: Session, tenant_id: int) -> list[Adapter]:
    """One row per adapter name the tenant can call (its own, and other active tenants'
    public ones): the version the name reaches, listed only if that version is visible.
    Rows come with ``tenant`` loaded, ordered by owner name and adapter name."""
    latest = (sa.select(Adapter.tenant_id, Adapter.name,
                        sa.func.max(Adapter.version).label("version"))
              .where(Adapter.status == "active")
              .group_by(Adapter.tenant_id, Adapter.name).subquery())
    visible = sa.or_(Adapter.tenant_id == tenant_id,
                     sa.and_(Adapter.visibility == "public", Tenant.status == "active"))
    stmt = (sa.select(Adapter).join(Adapter.tenant).options(contains_eager(Adapter.tenant))
            .join(latest, sa.and_(Adapter.tenant_id == latest.c.tenant_id,
                                  Adapter.name == latest.c.name))
            .outerjoin(AdapterRoute, sa.and_(AdapterRoute.tenant_id == Adapter.tenant_id,
                                             AdapterRoute.name == Adapter.name))
            .where(Adapter.status == "active", visible,
                   sa.or_(Adapter.id == AdapterRoute.current_id,
                          sa.and_(AdapterRoute.current_id.is_(None),
                                  Adapter.version == latest.c.version)))
            .order_by(Tenant.name, Adapter.name))
    return list(session.scalars(stmt))


def traffic(session: Session, keys: Iterable[tuple[int, str]]) -> dict[tuple[int, str],
                                                                      Traffic]:
    """The traffic of each ``(tenant_id, name)`` that has an active version."""
    wanted = set(keys)
    if not wanted:
        return {}
    tenant_ids = sorted({t for t, _ in wanted})
    names = sorted({n for _, n in wanted})
    latest: dict[tuple[int, str], int] = {}
    stmt = (sa.select(Adapter.tenant_id, Adapter.name, Adapter.id, Adapter.version)
            .where(Adapter.status == "active", Adapter.tenant_id.in_(tenant_ids),
                   Adapter.name.in_(names))
            .order_by(Adapter.version))
    for owner, name, adapter_id, _ in session.execute(stmt):
        if (owner, name) in wanted:
            latest[(owner, name)] = adapter_id  # ordered by version: the last is latest
    routes = {(r.tenant_id, r.name): r for r in session.scalars(
        sa.select(AdapterRoute).where(AdapterRoute.tenant_id.in_(tenant_ids),
                                      AdapterRoute.name.in_(names)))}
    out = {}
    for key, latest_id in latest.items():
        route = routes.get(key)
        if route is None or route.current_id is None:
            out[key] = Traffic(latest_id, False, route.canary_id if route else None,
                               route.canary_percent if route else None)
        else:
            out[key] = Traffic(route.current_id, True, route.canary_id, route.canary_percent)
    return out


# --- a name's versions -------------------------------------------------------------------


def name_versions(session: Session, tenant_id: int, name: str) -> NameVersions:
    """The tenant's adapter ``name``: its active versions and where its requests go;
    AdapterNotFoundError if it has no active version."""
    if not is_adapter_name(name):  # none can exist: nothing to look up
        raise AdapterNotFoundError(f"no active adapter {name}")
    rows = list(session.scalars(
        sa.select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name,
                                 Adapter.status == "active").order_by(Adapter.version)
        .execution_options(populate_existing=True)))
    if not rows:
        raise AdapterNotFoundError(f"no active adapter {name}")
    return NameVersions(tenant_id, name, rows, traffic(session, [(tenant_id, name)])
                        [(tenant_id, name)])


def _route(session: Session, tenant_id: int, name: str) -> AdapterRoute | None:
    return session.scalar(
        sa.select(AdapterRoute).where(AdapterRoute.tenant_id == tenant_id,
                                      AdapterRoute.name == name)
        .with_for_update().execution_options(populate_existing=True))


def _flush(session: Session, name: str) -> None:
    try:
        session.flush()
    except sa.exc.IntegrityError as exc:
        raise ConflictError(f"the versions of adapter {name!r} were changed concurrently; "
                            "retry") from exc


def active_version(session: Session, state: NameVersions, version: int, verb: str) -> Adapter:
    """The active version ``version`` of the name; 404 if it never existed, 409 if it
    was deleted."""
    row = next((a for a in state.versions if a.version == version), None)
    if row is not None:
        return row
    deleted = session.scalar(sa.select(sa.exists().where(
        Adapter.tenant_id == state.tenant_id, Adapter.name == state.name,
        Adapter.version == version)))
    if not deleted:
        raise AdapterNotFoundError(f"adapter {state.name} has no version {version} (its "
                                   f"versions: {_listed(state)})")
    raise ConflictError(f"cannot {verb} adapter {state.name} version {version}: that version "
                        f"is deleted (active versions: {_listed(state)})")


def _listed(state: NameVersions) -> str:
    return ", ".join(str(a.version) for a in state.versions)


def promote(session: Session, tenant_id: int, name: str, version: object) -> NameVersions:
    """Makes ``version`` the current version of the tenant's adapter ``name`` (rollback:
    promote an older one) and ends a split in progress. AdapterNotFoundError for an
    unknown name or version, ConflictError for a deleted version, InvalidRequestError for
    a version that is no version number."""
    number = check_version(version)
    state = name_versions(session, tenant_id, name)
    row = active_version(session, state, number, "promote")
    route = _route(session, tenant_id, name)
    if route is None:
        route = AdapterRoute(tenant_id=tenant_id, name=name)
        session.add(route)
    route.current_id = row.id
    route.canary_id = None
    route.canary_percent = None
    _flush(session, name)
    return name_versions(session, tenant_id, name)


def start_split(session: Session, tenant_id: int, name: str, version: object,
                percent: object) -> NameVersions:
    """Sends ``percent`` of the requests naming the tenant's adapter ``name`` to
    ``version`` (the canary), the rest to the current version, which this fixes (a new
    upload during the split does not take over). A split in progress is replaced. The same
    errors as ``promote``; ConflictError too for a canary that is the current version."""
    number = check_version(version)
    share = check_percent(percent)
    state = name_versions(session, tenant_id, name)
    canary = active_version(session, state, number, "split traffic onto")
    if canary.id == state.traffic.current_id:
        raise ConflictError(f"version {number} is already the current version of adapter "
                            f"{name}: split onto another version")
    route = _route(session, tenant_id, name)
    if route is None:
        route = AdapterRoute(tenant_id=tenant_id, name=name)
        session.add(route)
    route.current_id = state.traffic.current_id
    route.canary_id = canary.id
    route.canary_percent = share
    _flush(session, name)
    return name_versions(session, tenant_id, name)


def cancel_split(session: Session, tenant_id: int, name: str) -> NameVersions:
    """Ends the split of the tenant's adapter ``name``: every request goes to the current
    version again. ConflictError if no split is in progress."""
    name_versions(session, tenant_id, name)  # AdapterNotFoundError for an unknown name
    route = _route(session, tenant_id, name)
    if route is None or route.canary_id is None:
        raise ConflictError(f"adapter {name} has no split in progress")
    route.canary_id = None
    route.canary_percent = None
    _flush(session, name)
    return name_versions(session, tenant_id, name)


def after_delete(session: Session, tenant_id: int, name: str,
                 deleted: Sequence[Adapter]) -> None:
    """Keeps the name's route on active versions once ``deleted`` (flushed as deleted)
    are gone: the previous active version (else the next) becomes current in place of a
    deleted promoted one, a deleted canary ends the split, no active version left drops
    the route. Without a promote the latest active version is current anyway."""
    route = _route(session, tenant_id, name)
    if route is None:
        return
    active = list(session.scalars(
        sa.select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name,
                                 Adapter.status == "active").order_by(Adapter.version)))
    if not active:
        session.delete(route)
        session.flush()
        return
    gone = {row.id: row for row in deleted}
    if route.current_id in gone:
        old = gone[route.current_id].version
        below = [a for a in active if a.version < old]
        # The newest version below the deleted one; with none, the oldest above it: still
        # promoted, so an upload never becomes current by a deletion.
        route.current_id = below[-1].id if below else next(
            a.id for a in active if a.version > old)
    current_id = route.current_id if route.current_id is not None else active[-1].id
    if route.canary_id in gone or route.canary_id == current_id:
        route.canary_id = None
        route.canary_percent = None
    session.flush()
