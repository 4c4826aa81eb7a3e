"""One adapter store, one registry: claiming a store, refusing another registry's, and
moving a registry (with its store) to another database."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
from servers import clean_env, free_port, serve_command, wait_ready
from sqlalchemy.orm import Session, sessionmaker

from loraplex.cli_registry import run_registry_cli
from loraplex.errors import ConfigError, StoreNotOwnedError
from loraplex.registry import db, service
from loraplex.registry.move import move_registry
from loraplex.registry.ownership import open_store, registry_id
from loraplex.registry.store import OWNER_FILE, AdapterStore
from loraplex.registry.sweep import sweep_store


@pytest.fixture
def registry() -> Iterator[Callable[[str], sessionmaker[Session]]]:
    """Migrates a registry database and gives sessions on it (engines disposed after)."""
    engines: list[sa.Engine] = []

    def make(url: str) -> sessionmaker[Session]:
        db.upgrade(url)
        engines.append(db.make_engine(url))
        return db.make_session_factory(engines[-1])

    yield make
    for engine in engines:
        engine.dispose()


def test_each_registry_has_its_own_id(
        registry: Callable[[str], sessionmaker[Session]], empty_db_url: str,
        tmp_path: Path) -> None:
    first = registry(empty_db_url)
    second = registry(f"sqlite:///{tmp_path / 'other.db'}")
    with first() as a, second() as b:
        assert len(registry_id(a)) == 32 and registry_id(a) != registry_id(b)
    db.upgrade(empty_db_url)  # upgrading again keeps the id
    with first() as again, first() as a:
        assert registry_id(again) == registry_id(a)


def test_a_store_owned_by_one_registry_is_refused_to_another(
        registry: Callable[[str], sessionmaker[Session]], empty_db_url: str, tmp_path: Path, make_adapter: Callable[..., Path]) -> None:
    owner_url = f"sqlite:///{tmp_path / 'owner.db'}"
    owner, other = registry(owner_url), registry(empty_db_url)
    root = tmp_path / "store"
    store = open_store(owner, root, owner_url)  # nobody owned it: claimed
    stored = store.put_dir(make_adapter())  # no row names it: an orphan to the other
    record = json.loads((root / OWNER_FILE).read_text())
    assert record == {"registry_id": store.registry_id, "database": owner_url}

    with pytest.raises(StoreNotOwnedError) as refused:
        open_store(other, root, empty_db_url)
    message = str(refused.value)
    assert "\n" not in message and f"belongs to another registry ({owner_url})" in message
    assert "--adapter-dir" in message and "loraplex db migrate" in message
    assert "***" in message or "password" not in empty_db_url  # no password shown
    # Opened anyway, for the other registry: it may not write, delete or sweep there.
    with other() as session:
        theirs = AdapterStore(root, registry_id(session))
    with pytest.raises(StoreNotOwnedError):
        theirs.put_dir(make_adapter(seed=1))
    with pytest.raises(StoreNotOwnedError):
        theirs.remove(stored.digest)
    assert sweep_store(other, theirs, grace_s=0).orphans_removed == ()
    assert store.exists(stored.digest)
    # Even claim-store takes no store another registry owns.
    with pytest.raises(StoreNotOwnedError):
        open_store(other, root, empty_db_url, claim_any=True)


def test_an_unowned_store_with_folders_it_does_not_name_is_refused(
        registry: Callable[[str], sessionmaker[Session]], db_url: str, session_factory: sessionmaker[Session], tmp_path: Path,
        make_adapter: Callable[..., Path]) -> None:
    """A store from before owners were recorded: claimed only by a registry naming all its
    folders, by its home's own registry, or on purpose."""
    root = tmp_path / "home" / "adapters"
    # Put a folder as an older loraplex did (no owner record), then remove the record.
    open_store(registry(f"sqlite:///{tmp_path / 'old.db'}"), root,
               f"sqlite:///{tmp_path / 'old.db'}").put_dir(make_adapter())
    (root / OWNER_FILE).unlink()
    with pytest.raises(StoreNotOwnedError, match=r"has no owner yet and holds 1 adapter "
                                                 r"folder\(s\) that this registry"):
        open_store(session_factory, root, db_url)
    assert not (root / OWNER_FILE).exists()
    home_url = f"sqlite:///{tmp_path / 'home' / 'loraplex.db'}"
    home = open_store(registry(home_url), root, home_url)  # LORAPLEX_HOME's own registry
    assert home.is_owned()
    (root / OWNER_FILE).unlink()
    assert open_store(session_factory, root, db_url, claim_any=True).is_owned()


def test_move_needs_an_empty_target_and_the_store(
        registry: Callable[[str], sessionmaker[Session]], tmp_path: Path,
        empty_db_url: str) -> None:
    source_url = f"sqlite:///{tmp_path / 'source.db'}"
    source = registry(source_url)
    with db.transaction(source) as session:
        service.create_tenant(session, "acme")
    with pytest.raises(ConfigError, match="is the registry being moved"):
        move_registry(source_url, source_url, tmp_path / "store")
    target = registry(empty_db_url)
    with db.transaction(target) as session:
        service.create_tenant(session, "already-here")
    with pytest.raises(ConfigError, match="already holds tenants"):
        move_registry(source_url, empty_db_url, tmp_path / "store")
    # Nothing was handed over: the store is still the source's.
    assert open_store(source, tmp_path / "store", source_url).is_owned()
    # A store the source does not own is not the source's to hand over.
    foreign = tmp_path / "foreign"
    open_store(registry(f"sqlite:///{tmp_path / 'x.db'}"), foreign,
               f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(StoreNotOwnedError):
        move_registry(source_url, f"sqlite:///{tmp_path / 'new.db'}", foreign)


# --- the README's path, SQLite home then PostgreSQL, end to end ---------------------------


class Home:
    """``loraplex`` commands and servers on one LORAPLEX_HOME, as a user runs them."""

    def __init__(self, home: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> None:
        self.home, self.model_dir, self.capsys = home, model_dir, capsys
        for var in ("LORAPLEX_DATABASE_URL", "LORAPLEX_ADAPTER_DIR", "LORAPLEX_MODEL"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("LORAPLEX_HOME", str(home))

    def cli(self, *argv: str, expect: int = 0) -> str:
        self.capsys.readouterr()
        rc = run_registry_cli(list(argv))
        out, err = self.capsys.readouterr()
        assert rc == expect, err
        if expect:
            assert err.startswith("loraplex: error: ") and err.count("\n") == 1, err
            return err
        return out

    def serve(self, *args: str) -> tuple[subprocess.Popen[str], str]:
        port = free_port()
        proc = subprocess.Popen(
            serve_command("--model", str(self.model_dir), "--served-model-name", "tiny",
                          "--port", str(port), "--num-kv-blocks", "32", "--log-level",
                          "warning", *args),
            env=clean_env(self.home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        return proc, f"http://127.0.0.1:{port}"

    def refused(self, *args: str) -> str:
        proc, _ = self.serve(*args)
        _, err = proc.communicate()
        assert proc.returncode == 2, err
        assert "loading" not in err and "Traceback" not in err  # refused before the model
        (line,) = err.splitlines()
        return line


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    proc.communicate()
    assert proc.returncode == 0


def _complete(url: str, key: str, model: str) -> Any:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        return client.completions.create(model=model, prompt="hello", max_tokens=3)


@pytest.mark.slow
@pytest.mark.server
def test_sqlite_home_then_postgres_refused_then_moved(
        registry: Callable[[str], sessionmaker[Session]], tmp_path: Path, tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        make_postgres_schema: Callable[[str], str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    user = Home(tmp_path / "home", tiny_llama_dir, monkeypatch, capsys)
    store_root = tmp_path / "home" / "adapters"
    # The embedded default: a SQLite registry and the home's store, a tenant, an adapter.
    user.cli("db", "upgrade")
    user.cli("tenants", "create", "acme", "--weight", "3", "--priority-class", "batch",
             "--slo-ttft-ms", "700")
    acme_key = json.loads(user.cli("keys", "create", "--tenant", "acme", "--json"))["key"]
    added = json.loads(user.cli("adapters", "add", "--tenant", "acme", "--name", "support",
                                str(llama_adapters["r4"]), "--model", str(tiny_llama_dir),
                                "--json"))
    proc, url = user.serve()
    try:
        wait_ready(url, proc)
        assert _complete(url, acme_key, "support").usage.completion_tokens >= 1
    finally:
        _stop(proc)
    folders = sorted(p.name for p in store_root.glob("??/*"))
    assert folders == [added["digest"]]

    # Scale-out as the README goes: PostgreSQL, the same LORAPLEX_HOME (so the same store).
    pg = make_postgres_schema("owner")
    line = user.refused("--database-url", pg)
    assert "belongs to another registry (sqlite:///" in line and "db migrate" in line
    assert user.cli("adapters", "add", "--tenant", "acme", "--name", "x",
                    str(llama_adapters["r8qv"]), "--model", str(tiny_llama_dir),
                    "--database-url", pg, expect=2)
    # The PostgreSQL registry's sweep, were it to run with no grace at all, deletes nothing.
    postgres = registry(pg)
    with postgres() as session:
        pg_store = AdapterStore(store_root, registry_id(session))
    assert sweep_store(postgres, pg_store, grace_s=0).orphans_removed == ()
    assert sorted(p.name for p in store_root.glob("??/*")) == folders

    # Moved: everything the SQLite registry held, queried back through the API.
    out = user.cli("db", "migrate", "--to", pg)
    assert out.startswith("moved 2 tenants, 2 API keys, 1 adapter versions and ") and \
        f"the adapter store {store_root} now belongs to it" in out
    proc, url = user.serve("--database-url", pg)
    try:
        wait_ready(url, proc)
        with openai.OpenAI(base_url=f"{url}/v1", api_key=acme_key, max_retries=0) as client:
            assert {m.id for m in client.models.list()} == {"tiny", "support"}
        assert _complete(url, acme_key, "support").usage.completion_tokens >= 1
        usage = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {acme_key}"},
                          timeout=30).json()
        assert usage["totals"]["requests"] == 2  # the SQLite era's and this one
        # New rows after the moved ones: the sequences follow the copied ids.
        user.cli("tenants", "create", "beta", "--database-url", pg)
    finally:
        _stop(proc)
    with postgres() as session:
        assert [t.name for t in service.list_tenants(session)] == ["acme", "admin", "beta"]
        acme = service.get_tenant_by_name(session, "acme")  # its scheduling settings too
        assert (acme.weight, acme.priority_class, acme.slo_ttft_ms) == (3.0, "batch", 700)
        requests = session.scalar(sa.text("SELECT sum(requests) FROM usage"))
        assert requests == 2
    # The SQLite registry no longer owns the store: it may not serve on it.
    line = user.refused()
    assert "belongs to another registry (postgresql" in line
    assert sorted(p.name for p in store_root.glob("??/*")) == folders
