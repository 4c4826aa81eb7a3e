"""Migrations: up, down to base, up again, on SQLite and PostgreSQL; models match them."""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from loraplex.adapter_format import CONFIG_FILE, WEIGHTS_FILE, folder_digest
from loraplex.errors import ConfigError, StoreNotOwnedError
from loraplex.registry import db, pins, service
from loraplex.registry.models import Base
from loraplex.registry.ownership import open_store
from loraplex.registry.store import AdapterStore
from loraplex.registry.sweep import sweep_store

TABLES = {"tenants", "api_keys", "adapters", "adapter_routes", "usage", "registry_identity"}


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {db.VERSION_TABLE}
    finally:
        engine.dispose()



def _old_versions(conn: sa.Connection, versions: list[tuple[str, str]]) -> int:
    """Raw rows as an older revision holds them: tenant "old" and versions 1.. of its
    adapter "a", each (digest, status), stored at ``<digest[:2]>/<digest>``; the tenant's
    id."""
    conn.execute(sa.text(
        "INSERT INTO tenants (name, status, created_at, updated_at) "
        "VALUES ('old', 'active', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
    tenant_id: int = conn.execute(sa.text("SELECT id FROM tenants")).scalar_one()
    for version, (digest, status) in enumerate(versions, start=1):
        conn.execute(sa.text(
            "INSERT INTO adapters (tenant_id, name, version, base_model, rank, alpha, "
            "use_rslora, target_modules, digest, size_bytes, storage_path, "
            "visibility, status, created_at) VALUES (:t, 'a', :v, 'm', 1, 1.0, "
            "false, '[]', :d, 10, :p, 'private', :s, CURRENT_TIMESTAMP)"),
            {"t": tenant_id, "v": version, "d": digest, "p": f"{digest[:2]}/{digest}",
             "s": status})
    return tenant_id

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
        assert db.current_revision(engine) == db.head_revision() == "0008"
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


# --- 0002: the content digest ------------------------------------------------------------


def _put_as_0001(root: Path, src: Path, folder: str | None = None) -> tuple[str, str]:
    """Stores ``src`` as revision 0001's store did: one folder per sha256 of the weights
    (the first config kept); returns (weights digest, relative path)."""
    digest = hashlib.sha256((src / WEIGHTS_FILE).read_bytes()).hexdigest()
    relative = folder or f"{digest[:2]}/{digest}"
    final = root / relative
    if not final.exists():
        final.mkdir(parents=True)
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            shutil.copyfile(src / name, final / name)
            os.chmod(final / name, 0o444)
    return digest, relative


def _insert_row(url: str, tenant_id: int, name: str, digest: str, path: str,
                status: str = "active") -> int:
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            return int(conn.execute(sa.text(
                "INSERT INTO adapters (tenant_id, name, version, base_model, rank, alpha, "
                "use_rslora, target_modules, digest, size_bytes, storage_path, visibility, "
                "status, created_at) VALUES (:t, :n, 1, 'tiny', 4, 8.0, false, "
                "'[\"q_proj\"]', :d, 1, :p, 'private', :s, CURRENT_TIMESTAMP) RETURNING id"),
                {"t": tenant_id, "n": name, "d": digest, "p": path, "s": status}).scalar_one())
    finally:
        engine.dispose()


def _row_digests(url: str) -> dict[str, tuple[str, str]]:
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            return {n: (d, p) for n, d, p in conn.execute(sa.text(
                "SELECT name, digest, storage_path FROM adapters"))}
    finally:
        engine.dispose()


def test_0002_recomputes_digests_and_moves_folders(
        empty_db_url: str, tmp_path: Path, make_adapter: Callable[..., Path]) -> None:
    url, root = empty_db_url, tmp_path / "store"
    db.upgrade(url, "0001")
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            tenants = [conn.execute(sa.text(
                "INSERT INTO tenants (name, status, created_at, updated_at) VALUES "
                "(:n, 'active', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP) RETURNING id"),
                {"n": n}).scalar_one() for n in ("a", "b")]
    finally:
        engine.dispose()
    w1 = make_adapter("w1", seed=1)
    w1_other = make_adapter("w1-other", seed=1, alpha=16.0)  # same weights, another config
    w2 = make_adapter("w2", seed=2)
    gone = make_adapter("gone", seed=3)
    d1, p1 = _put_as_0001(root, w1)
    _insert_row(url, tenants[0], "x", d1, p1)
    _insert_row(url, tenants[1], "y", *_put_as_0001(root, w1))  # 0001 shared the folder
    _insert_row(url, tenants[1], "w", d1, _put_as_0001(root, w1_other, "legacy/w")[1])
    _insert_row(url, tenants[0], "z", *_put_as_0001(root, w2))
    d_gone = hashlib.sha256((gone / WEIGHTS_FILE).read_bytes()).hexdigest()
    _insert_row(url, tenants[0], "old", d_gone, f"{d_gone[:2]}/{d_gone}", status="deleted")

    with pytest.raises(ConfigError, match="adapter store"):
        db.upgrade(url)  # rows exist, and nobody said where their files are
    db.upgrade(url, adapter_dir=str(root))

    rows = _row_digests(url)
    store = AdapterStore(root)
    assert rows["x"][0] == rows["y"][0] == folder_digest(w1) != rows["w"][0]
    assert rows["w"][0] == folder_digest(w1_other) and rows["z"][0] == folder_digest(w2)
    assert rows["old"] == (d_gone, f"{d_gone[:2]}/{d_gone}")  # nothing to recompute
    for name in ("x", "y", "w", "z"):
        digest, path = rows[name]
        assert path == store.relative_path_for(digest)
        assert folder_digest(root / path) == digest  # the engine's check will pass
    # The 0001 folders are orphans now: the sweep of the registry that owns the store (its
    # operator claims it knowing they are its own) collects them, the new ones stay.
    engine = db.make_engine(url)
    try:
        factory = db.make_session_factory(engine)
        sweep_store(factory, store, grace_s=0)  # opened to read only: removes nothing
        assert len(store.stored_digests()) == 5
        with pytest.raises(StoreNotOwnedError, match="does not name"):
            open_store(factory, root, url)
        store = open_store(factory, root, url, claim_any=True)
        sweep_store(factory, store, grace_s=0)
    finally:
        engine.dispose()
    assert set(store.stored_digests()) == {rows[n][0] for n in ("x", "w", "z")}

    # Down again: the weights-only layout cannot hold "w" next to "x".
    with pytest.raises(ConfigError, match="differ in adapter_config"):
        db.downgrade(url, "0001", adapter_dir=str(root))
    _delete_row(url, "w")
    db.downgrade(url, "0001", adapter_dir=str(root))
    rows = _row_digests(url)
    assert rows["x"] == rows["y"] == (d1, p1)
    assert (root / p1 / WEIGHTS_FILE).is_file()


def _delete_row(url: str, name: str) -> None:
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM adapters WHERE name = :n"), {"n": name})
    finally:
        engine.dispose()


# --- 0004: tenants' scheduling settings ---------------------------------------------------

_SETTINGS = "weight, priority_class, max_kv_fraction, slo_ttft_ms, slo_tpot_ms"


def test_0004_gives_existing_tenants_the_defaults_and_goes_down_again(
        empty_db_url: str) -> None:
    url = empty_db_url
    db.upgrade(url, "0003")
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO tenants (name, status, max_requests_per_minute, created_at, "
                "updated_at) VALUES ('old', 'active', 5, CURRENT_TIMESTAMP, "
                "CURRENT_TIMESTAMP)"))
            tenant_id = conn.execute(sa.text("SELECT id FROM tenants")).scalar_one()
            conn.execute(sa.text(
                "INSERT INTO api_keys (tenant_id, role, prefix, key_hash, created_at) "
                "VALUES (:t, 'tenant', 'lpx-x', 'h', CURRENT_TIMESTAMP)"), {"t": tenant_id})
        db.upgrade(url)
        with engine.connect() as conn:
            row = conn.execute(sa.text(
                f"SELECT name, max_requests_per_minute, {_SETTINGS} FROM tenants")).one()
            assert tuple(row) == ("old", 5, 1.0, "interactive", None, None, None)
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("UPDATE tenants SET weight = 0"))
        with engine.begin() as conn:  # the rebuilt table (SQLite) keeps its old rules too
            conn.execute(sa.text("UPDATE tenants SET weight = 2, slo_ttft_ms = 300"))
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("UPDATE tenants SET max_requests_per_minute = 0"))
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("UPDATE tenants SET status = 'gone'"))

        db.downgrade(url, "0003")
        columns = {c["name"] for c in sa.inspect(engine).get_columns("tenants")}
        assert not columns & set(_SETTINGS.split(", "))
        with engine.connect() as conn:
            assert conn.execute(sa.text(
                "SELECT name, max_requests_per_minute FROM tenants")).one() == ("old", 5)
            assert conn.execute(sa.text("SELECT count(*) FROM api_keys")).scalar_one() == 1
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("UPDATE tenants SET max_requests_per_minute = 0"))
        db.upgrade(url, "0004")
        assert db.current_revision(engine) == "0004"
    finally:
        engine.dispose()


# --- 0005: storage quotas -----------------------------------------------------------------


def test_0005_adds_quotas_backfills_reclaimed_and_goes_down_again(
        empty_db_url: str, tmp_path: Path) -> None:
    url = empty_db_url
    db.upgrade(url, "0004")
    engine = db.make_engine(url)
    shared, gone, kept = "a" * 64, "b" * 64, "c" * 64
    store = tmp_path / "store"
    (store / kept[:2] / kept).mkdir(parents=True)  # only "kept" still has its folder
    try:
        with engine.begin() as conn:
            _old_versions(conn, [(shared, "active"), (shared, "deleted"), (gone, "deleted"),
                                 (kept, "deleted")])
        db.upgrade(url, adapter_dir=str(store))
        with engine.connect() as conn:
            assert conn.execute(sa.text(
                "SELECT max_storage_bytes, max_adapter_versions FROM tenants")).one() == (
                None, None)
            reclaimed = dict(conn.execute(sa.text(
                "SELECT version, reclaimed_at IS NOT NULL FROM adapters")).all())
        # The active row counts; of the deleted ones, those whose bytes no copy is kept for
        # (held by an active row, or folder gone) are reclaimed; "kept" waits for the sweep.
        assert {v: bool(r) for v, r in reclaimed.items()} == {
            1: False, 2: True, 3: True, 4: False}
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("UPDATE tenants SET max_storage_bytes = 0"))
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("UPDATE tenants SET max_adapter_versions = 0"))
        with engine.begin() as conn:  # a bigint: past 32 bits
            conn.execute(sa.text("UPDATE tenants SET max_storage_bytes = 5000000000000, "
                                 "max_adapter_versions = 3"))
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("UPDATE tenants SET weight = 0"))  # 0004's rules stay

        db.downgrade(url, "0004", adapter_dir=str(store))
        assert not {c["name"] for c in sa.inspect(engine).get_columns("tenants")} & {
            "max_storage_bytes", "max_adapter_versions"}
        assert "reclaimed_at" not in {c["name"] for c in
                                      sa.inspect(engine).get_columns("adapters")}
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM adapters")).scalar_one() == 4
        db.upgrade(url, "0005", adapter_dir=str(store))
        assert db.current_revision(engine) == "0005"
    finally:
        engine.dispose()


def test_0006_keeps_every_name_on_its_latest_version_and_goes_down_again(
        empty_db_url: str) -> None:
    """An existing database gets the routes table and no row in it: a name keeps reaching
    its latest active version; the table's rules hold; downgrade drops only the table."""
    url = empty_db_url
    db.upgrade(url, "0005")
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            tenant_id = _old_versions(conn, [("1" * 64, "active"), ("2" * 64, "active"),
                                             ("3" * 64, "deleted")])
        db.upgrade(url)
        assert db.current_revision(engine) == db.head_revision()
        factory = db.make_session_factory(engine)
        with db.transaction(factory) as session:
            assert service.resolve_adapter(session, tenant_id, "a").version == 2
            assert service.resolve_adapter(session, tenant_id, "a@1").version == 1
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM adapter_routes")).scalar_one() == 0
            ids = dict(conn.execute(sa.text("SELECT version, id FROM adapters")).all())
        insert = ("INSERT INTO adapter_routes (tenant_id, name, current_id, canary_id, "
                  "canary_percent, updated_at) VALUES (:t, 'a', :c, :k, :p, CURRENT_TIMESTAMP)")
        for canary, percent in ((ids[2], 100.5), (ids[2], -1), (ids[2], None), (None, 5)):
            with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
                conn.execute(sa.text(insert), {"t": tenant_id, "c": ids[1], "k": canary,
                                               "p": percent})
        with engine.begin() as conn:
            conn.execute(sa.text(insert), {"t": tenant_id, "c": ids[1], "k": ids[2], "p": 10})
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:  # one per name
            conn.execute(sa.text(insert), {"t": tenant_id, "c": ids[2], "k": None, "p": None})
        with db.transaction(factory) as session:
            assert service.resolve_adapter(session, tenant_id, "a").version == 1

        db.downgrade(url, "0005")
        assert "adapter_routes" not in sa.inspect(engine).get_table_names()
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM adapters")).scalar_one() == 3
        db.upgrade(url)
        assert db.current_revision(engine) == db.head_revision()
    finally:
        engine.dispose()


def test_0007_adds_pins_unset_and_goes_down_again(empty_db_url: str) -> None:
    """Existing versions come up unpinned; a pin is kept; downgrade drops only the column
    (the rows stay), and upgrading again works."""
    url = empty_db_url
    db.upgrade(url, "0006")
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            tenant_id = _old_versions(conn, [("1" * 64, "active"), ("2" * 64, "active")])
        db.upgrade(url)
        assert db.current_revision(engine) == db.head_revision()
        factory = db.make_session_factory(engine)
        with db.transaction(factory) as session:
            assert [a.pinned_at for a in service.list_adapters(session, tenant_id)] == [
                None, None]
            assert pins.pinned_adapters(session) == []
            pins.pin(session, tenant_id, "a", 2)
        with db.transaction(factory) as session:
            assert [(a.name, a.version) for a in pins.pinned_adapters(session)] == [("a", 2)]
        db.downgrade(url, "0006")
        assert "pinned_at" not in {c["name"] for c in sa.inspect(engine).get_columns("adapters")}
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM adapters")).scalar_one() == 2
        db.upgrade(url)
        with db.transaction(factory) as session:
            assert pins.pinned_adapters(session) == []
    finally:
        engine.dispose()


def test_0008_adds_the_measured_effect_unset_and_goes_down_again(empty_db_url: str) -> None:
    """Existing versions come up unmeasured (effect NULL); a measured effect is kept;
    downgrade drops only the columns (the rows stay), and upgrading again works."""
    url = empty_db_url
    db.upgrade(url, "0007")
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            tenant_id = _old_versions(conn, [("1" * 64, "active")])
        db.upgrade(url)
        assert db.current_revision(engine) == "0008"
        factory = db.make_session_factory(engine)
        with db.transaction(factory) as session:
            (row,) = service.list_adapters(session, tenant_id)
            assert (row.effect_kl, row.effect_changed, row.effect_measured_at) == (
                None, None, None)
            row.effect_kl, row.effect_changed = 0.25, 0.5
        with db.transaction(factory) as session:
            (row,) = service.list_adapters(session, tenant_id)
            assert (row.effect_kl, row.effect_changed) == (0.25, 0.5)
        db.downgrade(url, "0007")
        columns = {c["name"] for c in sa.inspect(engine).get_columns("adapters")}
        assert not columns & {"effect_kl", "effect_changed", "effect_measured_at"}
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM adapters")).scalar_one() == 1
        db.upgrade(url)
        with db.transaction(factory) as session:
            assert service.list_adapters(session, tenant_id)[0].effect_kl is None
    finally:
        engine.dispose()
