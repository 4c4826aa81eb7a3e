"""``loraplex adapters upload / add / delete`` through the upload pipeline (SQLite)."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loraplex.adapter_format import folder_digest
from loraplex.cli_registry import _ByteCounter, run_registry_cli
from loraplex.registry.store import CONFIG_FILE, WEIGHTS_FILE


class Cli:
    def __init__(self, tmp_path: Path, model_dir: Path,
                 capsys: pytest.CaptureFixture[str]) -> None:
        self.adapter_dir = tmp_path / "adapters"
        self.options = ["--database-url", f"sqlite:///{tmp_path / 'registry.db'}",
                        "--adapter-dir", str(self.adapter_dir), "--model", str(model_dir),
                        "--json"]
        self.capsys = capsys

    def __call__(self, *argv: str, expect: int = 0) -> Any:
        self.capsys.readouterr()
        rc = run_registry_cli([*argv, *self.options])
        out, err = self.capsys.readouterr()
        assert rc == expect, err
        if expect:
            assert err.startswith("loraplex: error: ") and err.count("\n") == 1, err
            return err
        return json.loads(out)

    def stored(self) -> list[str]:
        return sorted(p.name for p in self.adapter_dir.glob("??/*"))

    def assert_nothing_stored(self) -> None:
        assert self.stored() == []
        assert list((self.adapter_dir / ".tmp").glob("*")) == []


@pytest.fixture
def cli(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> Cli:
    for var in ("LORAPLEX_DATABASE_URL", "LORAPLEX_ADAPTER_DIR", "LORAPLEX_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    c = Cli(tmp_path, model_dir, capsys)
    c("db", "upgrade")
    c("tenants", "create", "acme")
    return c


def _zip(out: Path, folder: Path, extra: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(out, "w") as zf:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            zf.write(folder / name, f"adapter/{name}")
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return out


def test_upload_folder_zip_tgz_and_delete(cli: Cli, tmp_path: Path,
                                          make_adapter: Callable[..., Path]) -> None:
    up = ("adapters", "upload", "--tenant", "acme", "--name", "helper")
    one, two = make_adapter("one", seed=1), make_adapter("two", seed=2)
    v1 = cli(*up, str(one))
    assert (v1["version"], v1["created"]) == (1, True)
    assert v1["digest"] == folder_digest(one)
    v2 = cli(*up, "--public", str(_zip(tmp_path / "two.zip", two)))
    assert (v2["version"], v2["visibility"], v2["created"]) == (2, "public", True)
    tgz = tmp_path / "one.tar.gz"
    with tarfile.open(tgz, "w:gz") as tf:
        tf.add(one, arcname="one")
    v3 = cli(*up, str(tgz))
    assert (v3["version"], v3["digest"], v3["created"]) == (3, v1["digest"], False)
    # `add` is the same pipeline.
    added = cli("adapters", "add", "--tenant", "acme", "--name", "other", str(two))
    assert added["digest"] == v2["digest"] and not added["created"]
    assert len(cli.stored()) == 2

    gone = cli("adapters", "delete", "--tenant", "acme", "--name", "helper", "--version", "2")
    assert [(d["version"], d["identity"]) for d in gone] == [(2, v2["identity"])]
    assert len(cli.stored()) == 2  # "other" still uses v2's weights
    gone = cli("adapters", "delete", "--tenant", "acme", "--name", "helper")
    assert [d["version"] for d in gone] == [1, 3]
    assert cli.stored() == [v2["digest"]]
    assert [a["name"] for a in cli("adapters", "list")] == ["other"]
    assert "no active adapter helper" in cli("adapters", "delete", "--tenant", "acme",
                                             "--name", "helper", expect=2)


def test_bad_uploads_exit_2_and_store_nothing(cli: Cli, tmp_path: Path,
                                              make_adapter: Callable[..., Path]) -> None:
    up = ("adapters", "upload", "--tenant", "acme", "--name", "x")
    src = make_adapter()
    err = cli(*up, str(_zip(tmp_path / "p.zip", src, {"adapter/adapter_model.bin": b"x"})),
              expect=2)
    assert "pickle" in err and "adapter_model.bin" in err
    assert "path traversal" in cli(*up, str(_zip(tmp_path / "t.zip", src, {
        "../evil": b"x"})), expect=2)
    assert "no such file or folder" in cli(*up, str(tmp_path / "nope"), expect=2)
    assert "missing adapter_model.safetensors" in cli(*up, str(src / CONFIG_FILE), expect=2)
    (tmp_path / "model.safetensors").write_bytes((src / WEIGHTS_FILE).read_bytes())
    assert "unexpected file 'model.safetensors'" in cli(
        *up, str(tmp_path / "model.safetensors"), expect=2)
    assert "max_lora_rank" in cli(*up, "--max-lora-rank", "2", str(src), expect=2)
    assert "base model mismatch" in cli(*up, "--served-model-name", "Qwen2-0.5B", str(src),
                                        expect=2)
    # The served model's own name (a hub id, an alias) matches.
    assert cli(*up, "--served-model-name", "Qwen2-0.5B", "--served-model-name",
               "someorg/Tiny-Llama", str(src))["version"] == 1
    cli("adapters", "delete", "--tenant", "acme", "--name", "x")
    cli.assert_nothing_stored()
    assert cli("adapters", "list") == []


def test_uploads_over_a_quota_exit_2_and_store_nothing(
        cli: Cli, make_adapter: Callable[..., Path]) -> None:
    first, second = make_adapter("a", seed=1), make_adapter("b", seed=2)
    size = sum((first / n).stat().st_size for n in (CONFIG_FILE, WEIGHTS_FILE))
    cli("tenants", "limits", "acme", "--max-storage-bytes", str(size + 10))
    up = ("adapters", "upload", "--tenant", "acme")
    kept = cli(*up, "--name", "a", str(first))
    err = cli(*up, "--name", "b", str(second), expect=2)
    assert "storage quota exceeded" in err and "max_storage_bytes" in err
    assert "10 bytes left" in err
    assert cli.stored() == [kept["digest"]]
    assert list((cli.adapter_dir / ".tmp").glob("*")) == []
    assert [a["name"] for a in cli("adapters", "list")] == ["a"]
    limits = cli("tenants", "limits", "acme")
    assert (limits["storage_bytes"], limits["num_adapter_versions"]) == (size, 1)

    # Deleting gives the bytes back; then the version quota refuses a second version.
    cli("adapters", "delete", "--tenant", "acme", "--name", "a")
    assert cli("tenants", "limits", "acme", "--max-adapter-versions",
               "1")["storage_bytes"] == 0
    cli(*up, "--name", "b", str(first))
    err = cli(*up, "--name", "b", str(first), expect=2)
    assert "adapter version quota exceeded" in err and "max_adapter_versions" in err
    assert len(cli("adapters", "list")) == 1


def test_byte_counter() -> None:
    out = io.StringIO()
    counter = _ByteCounter(4 << 20, out, every_s=3600.0)
    counter(1 << 20)
    counter(2 << 20)  # throttled
    counter(4 << 20)  # the last one is always shown
    assert out.getvalue() == "\ruploading 1.0 / 4.0 MiB\ruploading 4.0 / 4.0 MiB\n"
