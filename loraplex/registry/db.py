"""Engines, sessions and migrations of the registry database.

Nothing here runs at import time: callers build an engine from the configured URL and pass
it (or a session factory) down explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import ConfigError
from loraplex.registry.names import check_text

# Ids and limits are 32-bit integer columns: a larger number is not looked up or stored.
MAX_INT32: Final = 2**31 - 1

# Alembic's version table; also used to tell "never migrated" from "out of date".
VERSION_TABLE = "alembic_version"


def _sqlite_file(url: sa.URL) -> str | None:
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return database


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Builds an engine for ``url``.

    SQLite: creates the file's parent folder, turns foreign keys on for every connection,
    and uses WAL so a running server keeps reading while the CLI writes. Every backend
    gets ``pool_pre_ping`` so a database restart costs one retry, not a failed request.
    """
    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ConfigError(f"invalid database URL {url!r}: {exc}") from exc
    sqlite_file = _sqlite_file(parsed)
    if sqlite_file is not None:
        Path(sqlite_file).expanduser().parent.mkdir(parents=True, exist_ok=True)
    kwargs.setdefault("pool_pre_ping", True)
    try:
        engine = sa.create_engine(parsed, **kwargs)
    except (sa.exc.ArgumentError, ImportError) as exc:
        raise ConfigError(f"cannot use database URL {parsed!r}: {exc}") from exc
    if parsed.get_backend_name() == "sqlite":
        _configure_sqlite(engine, wal=sqlite_file is not None)
    sa.event.listen(engine, "before_cursor_execute", _check_parameters)
    return engine


def _check_parameters(_conn: Any, _cursor: Any, _statement: str, parameters: Any,
                      _context: Any, _executemany: bool) -> None:
    # The last line before the driver: whatever route a string took, text the database
    # cannot hold is the caller's 400 on every backend, never a DataError on PostgreSQL.
    stack = [parameters]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            check_text(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)


def _configure_sqlite(engine: Engine, *, wal: bool) -> None:
    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=5000")
            if wal:
                cursor.execute("PRAGMA journal_mode=WAL")
        finally:
            cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions for request handlers and CLI commands.

    ``expire_on_commit=False`` keeps returned rows readable after the handler commits
    (e.g. to serialise the response), without a second round trip.
    """
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commits if the block succeeds, rolls back if it raises.

    This is where a request or command owns the transaction; services never commit.
    """
    with factory() as session, session.begin():
        yield session


def migrations_dir() -> Path:
    """The repository's ``migrations/`` folder (an editable install points at the checkout)."""
    override = os.environ.get("LORAPLEX_MIGRATIONS_DIR")
    candidates = [Path(override)] if override else []
    # loraplex/registry/db.py -> repository root is three levels up.
    candidates.append(Path(__file__).resolve().parents[2] / "migrations")
    for path in candidates:
        if (path / "env.py").is_file():
            return path
    raise ConfigError("cannot find the migrations folder (looked in "
                      f"{', '.join(str(p) for p in candidates)}); set LORAPLEX_MIGRATIONS_DIR")


def alembic_config(engine: Engine, adapter_dir: str | None = None) -> Any:
    """An Alembic ``Config`` built in code: no alembic.ini, no dependence on the cwd.

    ``migrations/env.py`` picks the engine up from ``config.attributes``; migrations that
    rewrite stored adapter files (0002) find the adapter store there too.
    """
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["engine"] = engine
    config.attributes["adapter_dir"] = adapter_dir
    return config


def upgrade(url: str, revision: str = "head", *, adapter_dir: str | None = None) -> None:
    """Migrates the database at ``url`` up to ``revision``. ``adapter_dir`` is the adapter
    store whose folders the rows name (needed once rows exist: 0002 moves files)."""
    _migrate(url, revision, up=True, adapter_dir=adapter_dir)


def downgrade(url: str, revision: str, *, adapter_dir: str | None = None) -> None:
    """Migrates the database at ``url`` down to ``revision`` (``base`` drops everything)."""
    _migrate(url, revision, up=False, adapter_dir=adapter_dir)


def _migrate(url: str, revision: str, *, up: bool, adapter_dir: str | None) -> None:
    from alembic import command
    from alembic.util.exc import CommandError

    engine = make_engine(url)
    try:
        if up:
            command.upgrade(alembic_config(engine, adapter_dir), revision)
        else:
            command.downgrade(alembic_config(engine, adapter_dir), revision)
    except CommandError as exc:  # e.g. an unknown revision: the user's input, not a bug
        raise ConfigError(f"migration failed: {exc}") from exc
    finally:
        engine.dispose()


def head_revision() -> str | None:
    """The newest revision in ``migrations/versions``."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrations_dir()))
    return script.get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; ``None`` if it was never migrated."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def check_schema(engine: Engine) -> None:
    """Raises ConfigError unless the database is migrated to the newest revision."""
    current = current_revision(engine)
    head = head_revision()
    if current != head:
        state = "is not initialised" if current is None else f"is at revision {current}"
        raise ConfigError(f"the registry database {state}, expected {head}: "
                          "run `loraplex db upgrade`")
