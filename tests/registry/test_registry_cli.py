"""The registry's CLI commands end to end on SQLite, through ``--json`` output."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import sqlalchemy as sa
from safetensors.numpy import load_file, save_file
from sqlalchemy.orm import Session, sessionmaker

from loraplex.adapter_format import folder_digest
from loraplex.cli_registry import run_registry_cli
from loraplex.errors import TenantSuspendedError
from loraplex.gateway.auth import ensure_admin_key
from loraplex.registry import db, service
from loraplex.registry import store as store_module
from loraplex.registry.store import WEIGHTS_FILE


class Cli:
    """Runs a command with explicit options and ``--json``; returns the parsed output (or,
    when a failure is expected, the one line on stderr)."""

    def __init__(self, tmp_path: Path, model_dir: Path,
                 capsys: pytest.CaptureFixture[str], url: str | None = None) -> None:
        self.url = url or f"sqlite:///{tmp_path / 'db' / 'registry.db'}"
        self.adapter_dir = tmp_path / "adapters"
        self.options = ["--database-url", self.url, "--adapter-dir", str(self.adapter_dir),
                        "--model", str(model_dir), "--json"]
        self.capsys = capsys

    def __call__(self, *argv: str, expect: int = 0) -> Any:
        self.capsys.readouterr()
        rc = run_registry_cli([*argv, *self.options])
        out, err = self.capsys.readouterr()
        assert rc == expect, err
        if expect:
            assert err.startswith("loraplex: error: ") and err.count("\n") == 1, err
            assert "Traceback" not in err
            return err
        return json.loads(out)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty LORAPLEX_HOME, and none of the registry's variables set."""
    for var in ("LORAPLEX_DATABASE_URL", "LORAPLEX_ADAPTER_DIR", "LORAPLEX_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def cli(tmp_path: Path, home: Path, model_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(tmp_path, model_dir, capsys)


@pytest.fixture
def any_cli(tmp_path: Path, home: Path, model_dir: Path, empty_db_url: str,
            capsys: pytest.CaptureFixture[str]) -> Cli:
    """A CLI on an empty database, SQLite and PostgreSQL."""
    return Cli(tmp_path, model_dir, capsys, empty_db_url)


@pytest.fixture
def server_view() -> Iterator[Callable[[str], sessionmaker[Session]]]:
    """Sessions on a separate engine, as a running server would hold."""
    engines: list[sa.Engine] = []

    def view(url: str) -> sessionmaker[Session]:
        engines.append(db.make_engine(url))
        return db.make_session_factory(engines[-1])

    yield view
    for engine in engines:
        engine.dispose()


def _stored_digests(adapter_dir: Path) -> list[str]:
    return sorted(p.name for p in adapter_dir.glob("??/*") if p.is_dir())


def test_end_to_end(cli: Cli, make_adapter: Callable[..., Path],
                    server_view: Callable[[str], sessionmaker[Session]]) -> None:
    assert cli("db", "upgrade")["revision"] == "0008"
    assert cli("db", "current")["head"] == "0008"

    acme = cli("tenants", "create", "acme", "--rpm", "60", "--tpm", "1000",
               "--max-concurrency", "2")
    assert (acme["name"], acme["status"], acme["max_requests_per_minute"],
            acme["max_tokens_per_minute"], acme["max_concurrent_requests"]) == (
        "acme", "active", 60, 1000, 2)
    cli("tenants", "create", "bob")
    assert [t["name"] for t in cli("tenants", "list")] == ["acme", "bob"]

    key = cli("keys", "create", "--tenant", "acme", "--name", "ci")
    assert key["key"].startswith("lpx-") and key["role"] == "tenant"
    admin = cli("keys", "create", "--tenant", "bob", "--admin")
    assert admin["role"] == "admin"
    listed = cli("keys", "list")
    assert [k["id"] for k in listed] == [key["id"], admin["id"]]
    assert all("key" not in k and "key_hash" not in k for k in listed)
    assert [k["id"] for k in cli("keys", "list", "--tenant", "bob")] == [admin["id"]]

    # What the CLI committed, a running server sees at once.
    server = server_view(cli.url)
    with server() as session:
        principal = service.authenticate(session, key["key"])
        assert principal is not None and principal.tenant_name == "acme"
        assert principal.max_requests_per_minute == 60
        session.commit()
    revoked = cli("keys", "revoke", str(key["id"]))
    assert revoked["revoked_at"] is not None
    with server() as session:
        assert service.authenticate(session, key["key"]) is None

    src = make_adapter("helper", seed=1, rank=4, alpha=8.0)
    v1 = cli("adapters", "add", "--tenant", "acme", "--name", "helper", str(src))
    digest = folder_digest(src)
    assert (v1["version"], v1["digest"], v1["visibility"], v1["rank"], v1["alpha"]) == (
        1, digest, "private", 4, 8.0)
    assert v1["target_modules"] == ["q_proj", "v_proj"]
    assert v1["identity"] == f"{v1['id']}@{digest}"
    assert (cli.adapter_dir / v1["storage_path"] / WEIGHTS_FILE).is_file()
    v2 = cli("adapters", "add", "--tenant", "acme", "--name", "helper", "--public",
             str(make_adapter("helper2", seed=2, rank=4)))
    assert (v2["version"], v2["visibility"]) == (2, "public")
    # Identical content under another name and owner: stored once, two rows.
    copy = cli("adapters", "add", "--tenant", "bob", "--name", "mine", str(src))
    assert copy["digest"] == digest
    assert len(_stored_digests(cli.adapter_dir)) == 2

    every = cli("adapters", "list")
    assert [(a["model"], a["version"]) for a in every] == [
        ("acme/helper", 1), ("acme/helper", 2), ("bob/mine", 1)]
    bob_sees = cli("adapters", "list", "--tenant", "bob")
    assert [(a["model"], a["version"]) for a in bob_sees] == [
        ("acme/helper", 2), ("bob/mine", 1)]
    with server() as session:
        bob = service.get_tenant_by_name(session, "bob")
        assert service.resolve_adapter(session, bob.id, "acme/helper").id == v2["id"]


def test_env_vars_and_defaults(home: Path, tmp_path: Path, model_dir: Path,
                               make_adapter: Callable[..., Path],
                               monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    # No options at all: everything lands under LORAPLEX_HOME.
    assert run_registry_cli(["db", "upgrade"]) == 0
    assert run_registry_cli(["tenants", "create", "acme"]) == 0
    assert (home / "loraplex.db").is_file()

    # The environment variables win over the defaults.
    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", url)
    monkeypatch.setenv("LORAPLEX_ADAPTER_DIR", str(tmp_path / "env-adapters"))
    monkeypatch.setenv("LORAPLEX_MODEL", str(model_dir))
    assert run_registry_cli(["db", "upgrade"]) == 0
    assert run_registry_cli(["tenants", "create", "other"]) == 0
    assert run_registry_cli(["adapters", "add", "--tenant", "other", "--name", "x",
                             str(make_adapter())]) == 0
    assert _stored_digests(tmp_path / "env-adapters")
    capsys.readouterr()
    assert run_registry_cli(["tenants", "list", "--json"]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr().out)] == ["other"]
    # A flag wins over the environment.
    assert run_registry_cli(["tenants", "list", "--json",
                             "--database-url", f"sqlite:///{home / 'loraplex.db'}"]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr().out)] == ["acme"]


def test_text_output_prints_key_alone(cli: Cli, capsys: pytest.CaptureFixture[str]) -> None:
    cli("db", "upgrade")
    cli("tenants", "create", "acme")
    capsys.readouterr()
    rc = run_registry_cli(["keys", "create", "--tenant", "acme", "--database-url", cli.url])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.count("\n") == 1 and out.startswith("lpx-")
    assert "only this once" in err
    assert run_registry_cli(["tenants", "list", "--database-url", cli.url]) == 0
    assert "acme" in capsys.readouterr().out


def test_errors_are_one_line(cli: Cli) -> None:
    assert "loraplex db upgrade" in cli("tenants", "list", expect=2)
    cli("db", "upgrade")
    cli("tenants", "create", "acme")
    assert "already exists" in cli("tenants", "create", "acme", expect=2)
    assert "invalid tenant name" in cli("tenants", "create", "Bad/Name", expect=2)
    assert "no tenant named 'ghost'" in cli("keys", "create", "--tenant", "ghost", expect=2)
    assert "no API key" in cli("keys", "revoke", "999", expect=2)
    assert "migration failed" in cli("db", "upgrade", "--revision", "zzz", expect=2)
    cli("db", "downgrade", "base")
    assert "not initialised" in cli("tenants", "list", expect=2)


def _adapter_rows(url: str) -> int:
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM adapters")).scalar_one())
    finally:
        engine.dispose()


def test_adapters_add_refusals_leave_nothing(cli: Cli, tmp_path: Path,
                                             make_adapter: Callable[..., Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cli("db", "upgrade")
    cli("tenants", "create", "acme")
    add = ("adapters", "add", "--tenant", "acme", "--name", "x")

    pickled = make_adapter("pickled")
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04.")
    assert "pickle" in cli(*add, str(pickled), expect=2)

    # Stored, then refused by the engine's loader (config says rank 8, tensors have 4):
    # the copy is removed again.
    wrong = make_adapter("wrong", rank=4, extra_config={"r": 8})
    assert "rank" in cli(*add, str(wrong), expect=2)

    wide = make_adapter("wide", rank=16)
    assert "max_lora_rank" in cli(*add, "--max-lora-rank", "8", str(wide), expect=2)

    # Admission fails closed (issue 56): weights for a module the config does not target,
    # an adapter saved untrained (every lora_B zero).
    untargeted = make_adapter("untargeted", extra_config={"target_modules": ["q_proj"]})
    assert "target_modules does not name" in cli(*add, str(untargeted), expect=2)
    untrained = make_adapter("untrained", seed=3)
    weights = untrained / "adapter_model.safetensors"
    save_file({k: v * 0 if ".lora_B." in k else v for k, v in load_file(str(weights)).items()},
              str(weights))
    assert "every lora_B is zero" in cli(*add, str(untrained), expect=2)

    assert "no tenant" in cli("adapters", "add", "--tenant", "ghost", "--name", "x",
                              str(make_adapter()), expect=2)
    assert "invalid adapter name" in cli("adapters", "add", "--tenant", "acme", "--name",
                                         "a/b", str(make_adapter()), expect=2)

    # A failure in the middle of the copy (disk full).
    def half_then_fail(fin: BinaryIO, fout: BinaryIO, hasher: object) -> int:
        fout.write(fin.read(64))
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(store_module, "_copy_stream", half_then_fail)
        assert "No space" in cli(*add, str(make_adapter("full", seed=5)), expect=2)

    # The database refuses the row after the files are in place: they go again.
    with monkeypatch.context() as m:
        def refuse(*args: object, **kwargs: object) -> None:
            raise sa.exc.OperationalError("INSERT", {}, Exception("database is locked"))

        m.setattr(service, "register_adapter", refuse)
        assert "database is locked" in cli(*add, str(make_adapter("late", seed=6)),
                                           expect=2)

    assert _stored_digests(cli.adapter_dir) == []
    assert not any((cli.adapter_dir / ".tmp").iterdir())
    assert _adapter_rows(cli.url) == 0
    assert cli("adapters", "list") == []


def test_python_m_entry_point(tmp_path: Path, home: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    env = {**os.environ, "LORAPLEX_HOME": str(home)}
    # Set up in-process; each interpreter start costs seconds on a loaded machine.
    assert run_registry_cli(["db", "upgrade", "--database-url", url]) == 0
    assert run_registry_cli(["tenants", "create", "acme", "--rpm", "5",
                             "--database-url", url]) == 0
    done = subprocess.run([sys.executable, "-m", "loraplex.cli_registry", "tenants", "list",
                           "--json", "--database-url", url], check=True, env=env,
                          capture_output=True, text=True)
    assert json.loads(done.stdout)[0]["max_requests_per_minute"] == 5
    failed = subprocess.run([sys.executable, "-m", "loraplex.cli_registry", "tenants",
                             "create", "acme", "--database-url", url], env=env,
                            capture_output=True, text=True)
    assert failed.returncode == 2
    assert failed.stderr.strip() == "loraplex: error: tenant 'acme' already exists"


@pytest.mark.skipif(importlib.util.find_spec("loraplex.cli") is None,
                    reason="loraplex/cli.py (the console script's module) is not written yet")
def test_console_script(tmp_path: Path, home: Path) -> None:
    exe = shutil.which("loraplex")
    assert exe is not None
    url = f"sqlite:///{tmp_path / 'r.db'}"
    env = {**os.environ, "LORAPLEX_HOME": str(home), "LORAPLEX_DATABASE_URL": url}
    subprocess.run([exe, "db", "upgrade"], check=True, env=env, capture_output=True)
    subprocess.run([exe, "tenants", "create", "acme"], check=True, env=env,
                   capture_output=True)
    done = subprocess.run([exe, "tenants", "list", "--json"], check=True, env=env,
                          capture_output=True, text=True)
    assert [t["name"] for t in json.loads(done.stdout)] == ["acme"]


def test_admin_key_recovery_needs_no_tenant(
        any_cli: Cli, server_view: Callable[[str], sessionmaker[Session]]) -> None:
    cli = any_cli
    cli("db", "upgrade")
    server = server_view(cli.url)
    with server() as session:  # what the first `loraplex serve` does
        bootstrap = ensure_admin_key(session, None)
        session.commit()
    assert bootstrap is not None
    # The bootstrap key is lost: one command, no tenant named, gives a working admin key.
    new = cli("keys", "create", "--admin")
    assert (new["tenant"], new["role"]) == ("admin", "admin")
    with server() as session:
        principal = service.authenticate(session, new["key"])
        assert principal is not None and principal.is_admin
        assert principal.tenant_name == "admin"
        session.commit()
    # A suspended admin tenant is named, with the way out, instead of a key that fails.
    cli("tenants", "suspend", "admin")
    assert "reactivate" in cli("keys", "create", "--admin", expect=2)
    cli("tenants", "reactivate", "admin")
    assert cli("keys", "create", "--admin", "--name", "ops")["name"] == "ops"
    assert "--tenant" in cli("keys", "create", expect=2)


def test_admin_key_recovery_on_a_fresh_database(cli: Cli) -> None:
    cli("db", "upgrade")
    key = cli("keys", "create", "--admin")  # no server ever started: the tenant is made
    assert (key["tenant"], key["role"]) == ("admin", "admin")
    assert [t["name"] for t in cli("tenants", "list")] == ["admin"]


def test_tenants_suspend_reactivate_and_limits(
        any_cli: Cli, server_view: Callable[[str], sessionmaker[Session]]) -> None:
    cli = any_cli
    cli("db", "upgrade")
    cli("tenants", "create", "acme", "--rpm", "60", "--tpm", "1000")
    key = cli("keys", "create", "--tenant", "acme")["key"]
    server = server_view(cli.url)

    def principal() -> service.Principal | None:
        with server() as session:
            found = service.authenticate(session, key)
            session.commit()
            return found

    assert cli("tenants", "suspend", "acme")["status"] == "suspended"
    with pytest.raises(TenantSuspendedError, match="'acme' of this API key is suspended"):
        principal()
    assert cli("tenants", "reactivate", "acme")["status"] == "active"
    assert principal() is not None

    changed = cli("tenants", "limits", "acme", "--tpm", "none", "--max-concurrency", "3")
    assert (changed["max_requests_per_minute"], changed["max_tokens_per_minute"],
            changed["max_concurrent_requests"]) == (60, None, 3)  # --rpm left as it was
    found = principal()
    assert found is not None
    assert (found.max_requests_per_minute, found.max_tokens_per_minute,
            found.max_concurrent_requests) == (60, None, 3)
    assert cli("tenants", "limits", "acme") == changed  # no flag: shown, not changed

    assert "at most" in cli("tenants", "limits", "acme", "--rpm", str(2**31), expect=2)
    assert "no tenant named 'ghost'" in cli("tenants", "suspend", "ghost", expect=2)
    assert "no tenant named 'ghost'" in cli("tenants", "limits", "ghost", "--rpm", "1",
                                            expect=2)


def test_tenants_limits_text_output(cli: Cli, capsys: pytest.CaptureFixture[str]) -> None:
    cli("db", "upgrade")
    cli("tenants", "create", "acme")
    capsys.readouterr()
    assert run_registry_cli(["tenants", "limits", "acme", "--rpm", "5",
                             "--database-url", cli.url]) == 0
    assert capsys.readouterr().out == (
        "tenant acme: --rpm 5, --tpm unlimited, --max-concurrency unlimited, "
        "--max-storage-bytes unlimited, --max-adapter-versions unlimited, --weight 1.0, "
        "--priority-class interactive, --max-kv-fraction default, --slo-ttft-ms default, "
        "--slo-tpot-ms default; stores 0 bytes in 0 adapter versions\n")
    with pytest.raises(SystemExit) as exited:
        run_registry_cli(["tenants", "limits", "acme", "--rpm", "0", "--database-url", cli.url])
    assert exited.value.code == 2
    assert "must be positive: 0" in capsys.readouterr().err


SETTINGS = ("weight", "priority_class", "max_kv_fraction", "slo_ttft_ms", "slo_tpot_ms")


def _settings(data: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(data[field] for field in SETTINGS)


def test_tenants_scheduling_settings(
        any_cli: Cli, server_view: Callable[[str], sessionmaker[Session]]) -> None:
    cli = any_cli
    cli("db", "upgrade")
    assert _settings(cli("tenants", "create", "plain")) == (
        1.0, "interactive", None, None, None)
    acme = cli("tenants", "create", "acme", "--weight", "2.5", "--priority-class", "batch",
               "--max-kv-fraction", "0.25", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50")
    assert _settings(acme) == (2.5, "batch", 0.25, 500, 50)
    assert [_settings(t) for t in cli("tenants", "list")] == [
        (2.5, "batch", 0.25, 500, 50), (1.0, "interactive", None, None, None)]
    key = cli("keys", "create", "--tenant", "acme")["key"]

    changed = cli("tenants", "limits", "acme", "--weight", "4", "--slo-ttft-ms", "default",
                  "--max-kv-fraction", "none", "--rpm", "9")
    assert _settings(changed) == (4.0, "batch", None, None, 50)  # the rest unchanged
    assert changed["max_requests_per_minute"] == 9
    assert cli("tenants", "limits", "acme") == changed
    server = server_view(cli.url)
    with server() as session:
        principal = service.authenticate(session, key)
        session.commit()
    assert principal is not None
    assert (principal.weight, principal.priority_class, principal.max_kv_fraction,
            principal.slo_ttft_ms, principal.slo_tpot_ms) == (4.0, "batch", None, None, 50)


@pytest.mark.parametrize(("flag", "value"), [
    ("--weight", "0"), ("--weight", "-1"), ("--weight", "nan"), ("--weight", "inf"),
    ("--weight", "1000.5"), ("--weight", "abc"), ("--weight", ""), ("--weight", "default"),
    ("--priority-class", "urgent"), ("--priority-class", "default"),
    ("--max-kv-fraction", "0"), ("--max-kv-fraction", "1.01"), ("--max-kv-fraction", "x"),
    ("--slo-ttft-ms", "0"), ("--slo-ttft-ms", "-3"), ("--slo-ttft-ms", "3600001"),
    ("--slo-ttft-ms", "1.5"), ("--slo-tpot-ms", "fast"), ("--slo-tpot-ms", "9" * 30)])
def test_bad_scheduling_settings_are_one_line_naming_the_flag(
        cli: Cli, flag: str, value: str) -> None:
    cli("db", "upgrade")
    before = cli("tenants", "create", "acme", "--weight", "3", "--slo-tpot-ms", "70")
    for argv in (["tenants", "create", "bob", "--priority-class", "batch", flag, value],
                 ["tenants", "limits", "acme", "--rpm", "5", "--priority-class", "batch",
                  flag, value]):
        err = cli(*argv, expect=2)
        assert err.startswith(f"loraplex: error: {flag} must be"), err
        assert len(err) < 200, err
    assert cli("tenants", "list") == [before]  # nothing created, nothing changed


QUOTAS = ("max_storage_bytes", "max_adapter_versions")


def test_tenants_storage_quotas(any_cli: Cli) -> None:
    cli = any_cli
    cli("db", "upgrade")
    plain = cli("tenants", "create", "plain")
    assert [plain[f] for f in (*QUOTAS, "storage_bytes", "num_adapter_versions")] == [
        None, None, 0, 0]
    acme = cli("tenants", "create", "acme", "--max-storage-bytes", "500M",
               "--max-adapter-versions", "20")
    assert [acme[f] for f in QUOTAS] == [500 << 20, 20]
    for text, expected in (("2G", 2 << 30), ("1048576", 1 << 20), ("3 KiB", 3 << 10),
                           ("7mb", 7 << 20), ("1T", 1 << 40), ("10b", 10)):
        assert cli("tenants", "limits", "acme", "--max-storage-bytes",
                   text)["max_storage_bytes"] == expected, text
    changed = cli("tenants", "limits", "acme", "--max-adapter-versions", "none", "--rpm", "4")
    assert [changed[f] for f in QUOTAS] == [10, None]  # the bytes quota unchanged
    assert cli("tenants", "limits", "acme", "--max-storage-bytes",
               "default")["max_storage_bytes"] is None
    assert [[t[f] for f in QUOTAS] for t in cli("tenants", "list")] == [
        [None, None], [None, None]]


@pytest.mark.parametrize(("flag", "value"), [
    ("--max-storage-bytes", "0"), ("--max-storage-bytes", "-5"),
    ("--max-storage-bytes", "1.5G"), ("--max-storage-bytes", "5X"),
    ("--max-storage-bytes", "9" * 30), ("--max-storage-bytes", "9" * 5000),
    ("--max-storage-bytes", "8388608T"), ("--max-storage-bytes", ""),
    ("--max-adapter-versions", "0"), ("--max-adapter-versions", "2K"),
    ("--max-adapter-versions", str(2**31)), ("--max-adapter-versions", "many")])
def test_bad_quotas_are_one_line_naming_the_flag(cli: Cli, flag: str, value: str) -> None:
    cli("db", "upgrade")
    before = cli("tenants", "create", "acme", "--max-storage-bytes", "1G")
    for argv in (["tenants", "create", "bob", "--max-adapter-versions", "3", flag, value],
                 ["tenants", "limits", "acme", "--rpm", "5", "--weight", "2", flag, value]):
        err = cli(*argv, expect=2)
        assert err.startswith(f"loraplex: error: {flag} must be"), err
        assert len(err) < 200, err
    assert cli("tenants", "list") == [before]  # nothing created, nothing changed


@pytest.mark.parametrize("argv", [["keys", "revoke", "9" * 23],
                                  ["adapters", "delete", "--tenant", "acme", "--name", "a",
                                   "--version", str(2**31)]])
def test_ids_past_the_integer_columns_are_refused_by_the_parser(
        cli: Cli, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # on SQLite they had reached the driver: "Python int too large to convert"
    cli("db", "upgrade")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_registry_cli([*argv, "--database-url", cli.url])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "must be at most 2147483647" in err and "Traceback" not in err


def test_adapters_add_imports_neither_torch_nor_transformers(
        cli: Cli, make_adapter: Callable[..., Path]) -> None:
    # Importing them was most of the command's 8.9 s; validation needs neither.
    cli("db", "upgrade")
    cli("tenants", "create", "acme")
    code = ("import sys\n"
            "from loraplex.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "print('heavy:', heavy, file=sys.stderr)\n"
            "sys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", code, "adapters", "add", "--tenant", "acme",
                           "--name", "x", str(make_adapter(seed=3)), *cli.options],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["version"] == 1
    assert "heavy: []" in done.stderr


def test_upgrade_reports_adapters_named_like_the_served_model(
        tmp_path: Path, home: Path, model_dir: Path, make_adapter: Callable[..., Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    """A name uploads refuse now (the served model's) may be in rows from before: db upgrade
    names each one, since no request can reach it."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    served = tmp_path / "support"  # a model folder named like the adapter below
    shutil.copytree(model_dir, served)
    common = ["--database-url", url, "--adapter-dir", str(tmp_path / "store")]
    assert run_registry_cli(["db", "upgrade", *common]) == 0
    assert run_registry_cli(["tenants", "create", "acme", *common]) == 0
    # Under another served model, "support" is a fine name; under this one it is not.
    assert run_registry_cli(["adapters", "add", "--tenant", "acme", "--name", "support",
                             str(make_adapter()), "--model", str(model_dir), *common]) == 0
    capsys.readouterr()
    assert run_registry_cli(["adapters", "add", "--tenant", "acme", "--name", "Support",
                             str(make_adapter(seed=2)), "--model", str(served), *common]) == 2
    assert "served model's name" in capsys.readouterr().err
    assert run_registry_cli(["db", "upgrade", "--model", str(served), *common]) == 0
    err = capsys.readouterr().err
    assert err.startswith("loraplex: warning: 1 adapter(s) named like the served model (support)")
    assert "acme/support" in err and err.count("\n") == 1
    assert run_registry_cli(["db", "upgrade", "--model", str(model_dir), *common]) == 0
    assert capsys.readouterr().err == ""
