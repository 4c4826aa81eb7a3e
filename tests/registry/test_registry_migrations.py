"""Migrations: up, down to base, up again, on SQLite and PostgreSQL; models match them."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from loraplex.errors import ConfigError
from loraplex.registry import db
from loraplex.registry.models import Base

TABLES = {"tenants", "api_keys", "adapters", "usage"}


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {db.VERSION_TABLE}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_db_url: str) -> None:
    assert _tables(empty_db_url) == set()
    db.upgrade(empty_db_url)
    assert _tables(empty_db_url) == TABLES
    db.downgrade(empty_db_url, "base")
    assert _tables(empty_db_url) == set()
    db.upgrade(empty_db_url, "head")
    assert _tables(empty_db_url) == TABLES

    engine = db.make_engine(empty_db_url)
    try:
        assert db.current_revision(engine) == db.head_revision() == "0002"
        db.check_schema(engine)
        with engine.begin() as conn:  # the re-created tables are usable
            conn.exec_driver_sql(
                "INSERT INTO tenants (name, status, created_at, updated_at) "
                "VALUES ('t', 'active', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)")
    finally:
        engine.dispose()


def test_check_schema_refuses_unmigrated_and_old(empty_db_url: str) -> None:
    engine = db.make_engine(empty_db_url)
    try:
        with pytest.raises(ConfigError, match="not initialised.*loraplex db upgrade"):
            db.check_schema(engine)
        db.upgrade(empty_db_url)
        db.check_schema(engine)
        db.downgrade(empty_db_url, "base")
        with pytest.raises(ConfigError):
            db.check_schema(engine)
    finally:
        engine.dispose()


def test_unknown_revision_is_a_config_error(empty_db_url: str) -> None:
    with pytest.raises(ConfigError, match="migration failed"):
        db.upgrade(empty_db_url, "nope")


def test_models_match_migrations(engine: sa.Engine) -> None:
    with engine.connect() as conn, warnings.catch_warnings():
        # Neither backend's reflection compares the expression index of usage; the
        # upsert tests cover it.
        warnings.filterwarnings("ignore", message=".*expression-based index")
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        diffs = compare_metadata(context, Base.metadata)
    assert diffs == []


def test_foreign_keys_are_enforced(engine: sa.Engine) -> None:
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO api_keys (tenant_id, role, prefix, key_hash, created_at) "
            "VALUES (999999, 'tenant', 'lpx-x', 'h', CURRENT_TIMESTAMP)")


def test_sqlite_parent_folder_is_created(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a' / 'b' / 'registry.db'}"
    db.upgrade(url)
    assert (tmp_path / "a" / "b" / "registry.db").is_file()


def test_invalid_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        db.make_engine("not a url")
    with pytest.raises(ConfigError):
        db.make_engine("nosuchdialect://x")


def test_migrations_dir_does_not_depend_on_cwd(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert (db.migrations_dir() / "versions" / "0001_initial.py").is_file()
    db.upgrade(f"sqlite:///{tmp_path / 'r.db'}")
