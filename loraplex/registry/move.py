"""Moving a registry to another database (the README's path from the embedded SQLite
default to PostgreSQL for scale-out): ``loraplex db migrate --to URL``.

Every tenant, API key (its hash: the keys people hold keep working), adapter version and
usage row is copied with its id, in one transaction of the target, which must be empty;
then the adapter store is handed to the target registry (its owner record rewritten), so
the files stay where they are and the source registry can no longer write or sweep there.
The source database itself is left as it was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import sqlalchemy as sa

from loraplex.errors import ConfigError
from loraplex.registry import db
from loraplex.registry.models import Adapter, AdapterRoute, ApiKey, Tenant, Usage
from loraplex.registry.ownership import describe_database, open_store, registry_id
from loraplex.registry.store import StoreOwner

# In the order foreign keys need them.
TABLES: tuple[sa.Table, ...] = tuple(
    model.__table__ for model in (Tenant, ApiKey, Adapter, AdapterRoute, Usage))  # type: ignore[misc]
_BATCH = 1000


@dataclass(frozen=True)
class MoveResult:
    """Rows copied per table, and the store now owned by the target."""

    num_rows: dict[str, int]
    adapter_dir: str


def move_registry(source_url: str, target_url: str,
                  adapter_dir: str | os.PathLike[str]) -> MoveResult:
    """Copies the registry at ``source_url`` into the empty one at ``target_url`` (migrated
    to head first) and hands it the store at ``adapter_dir``, which the source must own."""
    source = db.make_engine(source_url)
    target: sa.Engine | None = None
    try:
        db.check_schema(source)
        store = open_store(db.make_session_factory(source), adapter_dir, source_url)
        db.upgrade(target_url)
        target = db.make_engine(target_url)
        with db.transaction(db.make_session_factory(target)) as session:
            target_id = registry_id(session)
        if target_id == store.registry_id:
            raise ConfigError(f"{describe_database(target_url)} is the registry being moved")
        num_rows = _copy_rows(source, target)
        store.write_owner(StoreOwner(target_id, describe_database(target_url)),
                          replacing=store.registry_id)
        return MoveResult(num_rows, str(store.root))
    finally:
        source.dispose()
        if target is not None:
            target.dispose()


def _copy_rows(source: sa.Engine, target: sa.Engine) -> dict[str, int]:
    counts: dict[str, int] = {}
    with target.begin() as out, source.connect() as into:
        held = [t.name for t in TABLES
                if out.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()]
        if held:
            raise ConfigError(f"the target registry already holds {', '.join(held)}: move "
                              "into an empty database (a new one, migrated or not)")
        for table in TABLES:
            counts[table.name] = 0
            rows = into.execute(sa.select(table).order_by(table.c.id))
            while batch := rows.mappings().fetchmany(_BATCH):
                out.execute(sa.insert(table), [dict(row) for row in batch])
                counts[table.name] += len(batch)
        if out.dialect.name == "postgresql":
            # Rows came with their ids: the next id each sequence hands out follows them.
            for table in TABLES:
                out.execute(sa.text(
                    f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), "
                    f"coalesce((SELECT max(id) FROM {table.name}), 1), "
                    f"(SELECT count(*) > 0 FROM {table.name}))"))
    return counts
