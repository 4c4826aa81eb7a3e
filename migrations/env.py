"""Alembic environment of the registry.

Run programmatically by ``loraplex.registry.db.upgrade/downgrade`` (which hand over an engine
in ``config.attributes["engine"]``), or by the ``alembic`` command with ``-x url=...``,
``sqlalchemy.url`` or ``LORAPLEX_DATABASE_URL``.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy.engine import Connection, Engine

from loraplex.registry.db import VERSION_TABLE, make_engine
from loraplex.registry.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = (context.get_x_argument(as_dictionary=True).get("url")
           or config.get_main_option("sqlalchemy.url")
           or os.environ.get("LORAPLEX_DATABASE_URL"))
    if not url:
        raise RuntimeError("no database URL: pass -x url=..., or set LORAPLEX_DATABASE_URL")
    return url


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        # SQLite cannot ALTER most things; batch mode rebuilds tables instead.
        render_as_batch=True,
        compare_type=True,
        **kwargs,  # type: ignore[arg-type]
    )


def _run(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # Batch migrations drop and recreate tables; with foreign keys on, dropping a
        # referenced table would fail or cascade. The pragma only works outside a transaction.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()
    try:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    finally:
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")
            connection.commit()


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine: Engine | None = config.attributes.get("engine")
    owned = engine is None
    if engine is None:
        engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        if owned:
            engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
