"""The content-addressed adapter store: atomic puts, dedupe, pickle refusal, removal."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest
from owned_stores import owned_store

from loraplex.errors import AdapterError
from loraplex.registry import store as store_module
from loraplex.registry.store import CONFIG_FILE, OWNER_FILE, WEIGHTS_FILE, AdapterStore


def _visible(root: Path) -> list[Path]:
    """Adapter folders and files outside the temporary area (an empty ``<digest[:2]>``
    shard folder is no adapter)."""
    return sorted(p for p in root.rglob("*")
                  if ".tmp" not in p.relative_to(root).parts and p.name != OWNER_FILE
                  and (p.is_file() or len(p.relative_to(root).parts) >= 2))


def _tmp_entries(root: Path) -> list[Path]:
    tmp = root / ".tmp"
    return list(tmp.iterdir()) if tmp.exists() else []


def test_put_dir(tmp_path: Path, make_adapter: Callable[..., Path]) -> None:
    src = make_adapter("a")
    (src / "README.md").write_text("not copied")
    store = owned_store(tmp_path / "store")
    stored = store.put_dir(src)
    weights = (src / WEIGHTS_FILE).read_bytes()
    config = (src / CONFIG_FILE).read_bytes()
    # The definition of the content digest (docs/registry.md), restated independently.
    assert stored.digest == hashlib.sha256(
        b"loraplex-adapter-v1\0" + hashlib.sha256(weights).digest()
        + hashlib.sha256(config).digest()).hexdigest()
    assert stored.path == store.path_for(stored.digest)
    assert stored.path == tmp_path / "store" / stored.digest[:2] / stored.digest
    assert stored.relative_path == f"{stored.digest[:2]}/{stored.digest}"
    assert store.resolve(stored.relative_path) == stored.path
    assert sorted(p.name for p in stored.path.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert (stored.path / WEIGHTS_FILE).read_bytes() == weights
    assert (stored.path / CONFIG_FILE).read_bytes() == (src / CONFIG_FILE).read_bytes()
    assert stored.size == len(weights) + (src / CONFIG_FILE).stat().st_size
    assert stored.created and store.exists(stored.digest)
    assert not (stored.path / WEIGHTS_FILE).stat().st_mode & stat.S_IWUSR  # immutable
    assert _tmp_entries(store.root) == []


def test_identical_content_stored_once(tmp_path: Path,
                                       make_adapter: Callable[..., Path]) -> None:
    first = make_adapter("one", seed=1)
    second = make_adapter("two", seed=1)  # the same bytes in both files, another folder
    store = owned_store(tmp_path / "store")
    a = store.put_dir(first)
    b = store.put_dir(second)
    assert a.digest == b.digest and a.path == b.path
    assert a.created and not b.created
    assert len([p for p in _visible(store.root) if p.name == WEIGHTS_FILE]) == 1
    c = store.put_dir(make_adapter("three", seed=2))
    assert c.digest != a.digest and c.created
    assert _tmp_entries(store.root) == []


@pytest.mark.parametrize("change", [{"lora_alpha": 16.0}, {"base_model_name_or_path": "x"}])
def test_same_weights_other_config_is_other_content(
        tmp_path: Path, make_adapter: Callable[..., Path], change: dict[str, object]) -> None:
    """Any byte of the config is part of the identity: the second upload neither conflicts
    with the first nor is served the first's config."""
    store = owned_store(tmp_path / "store")
    one = store.put_dir(make_adapter("one", seed=1))
    src = make_adapter("two", seed=1)
    config = json.loads((src / CONFIG_FILE).read_text())
    config.update(change)
    (src / CONFIG_FILE).write_text(json.dumps(config))
    two = store.put_dir(src)
    assert one.created and two.created and one.digest != two.digest
    assert (two.path / CONFIG_FILE).read_bytes() == (src / CONFIG_FILE).read_bytes()
    assert (one.path / WEIGHTS_FILE).read_bytes() == (two.path / WEIGHTS_FILE).read_bytes()
    assert _tmp_entries(store.root) == []


@pytest.mark.parametrize("pickle_name", ["adapter_model.bin", "extra.pt", "sub/x.pkl"])
def test_pickle_files_refused(tmp_path: Path, make_adapter: Callable[..., Path],
                              pickle_name: str) -> None:
    src = make_adapter("a")
    (src / pickle_name).parent.mkdir(exist_ok=True)
    (src / pickle_name).write_bytes(b"\x80\x04K\x01.")
    store = owned_store(tmp_path / "store")
    with pytest.raises(AdapterError, match="pickle"):
        store.put_dir(src)
    assert not store.root.exists() or _visible(store.root) == []


def test_only_safetensors_accepted(tmp_path: Path, make_adapter: Callable[..., Path]) -> None:
    src = make_adapter("a")
    (src / WEIGHTS_FILE).unlink()
    store = owned_store(tmp_path / "store")
    with pytest.raises(AdapterError, match=WEIGHTS_FILE):
        store.put_dir(src)
    with pytest.raises(AdapterError, match="not a folder"):
        store.put_dir(tmp_path / "missing")
    bad = make_adapter("b")
    (bad / CONFIG_FILE).write_text("[1, 2]")
    with pytest.raises(AdapterError, match="JSON object"):
        store.put_dir(bad)
    assert not store.root.exists() or _visible(store.root) == []
    assert _tmp_entries(store.root) == [] if store.root.exists() else True


def test_failure_mid_copy_leaves_nothing(tmp_path: Path, make_adapter: Callable[..., Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_adapter("a")
    store = owned_store(tmp_path / "store")

    def half_then_fail(fin: BinaryIO, fout: BinaryIO, hasher: object) -> int:
        fout.write(fin.read(100))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "_copy_stream", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        store.put_dir(src)
    assert _visible(store.root) == []
    assert _tmp_entries(store.root) == []


def test_source_file_vanishing_leaves_nothing(tmp_path: Path,
                                              make_adapter: Callable[..., Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_adapter("a")
    # The config is a link to a file that disappears after the checks: the weights are
    # already copied when reading it fails.
    real = tmp_path / "real_config.json"
    (src / CONFIG_FILE).rename(real)
    (src / CONFIG_FILE).symlink_to(real)
    store = owned_store(tmp_path / "store")
    original_check = AdapterStore._check_source

    def check_then_vanish(path: Path) -> None:
        original_check(path)
        real.unlink()

    monkeypatch.setattr(store, "_check_source", check_then_vanish)
    with pytest.raises(AdapterError, match="vanished"):
        store.put_dir(src)
    assert _visible(store.root) == []
    assert _tmp_entries(store.root) == []


def test_crash_before_rename_is_invisible(tmp_path: Path, make_adapter: Callable[..., Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    store = owned_store(tmp_path / "store")

    def crash(*args: object) -> None:
        raise KeyboardInterrupt  # stands for the process dying just before the rename

    monkeypatch.setattr(store_module.os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        store.put_dir(make_adapter("a"))
    assert _visible(store.root) == []


def test_remove(tmp_path: Path, make_adapter: Callable[..., Path]) -> None:
    store = owned_store(tmp_path / "store")
    stored = store.put_dir(make_adapter("a"))
    assert store.remove(stored.digest)
    assert not store.exists(stored.digest) and not stored.path.exists()
    assert not store.remove(stored.digest)
    assert store.put_dir(make_adapter("a")).created  # can be stored again
    assert [p.name for p in _tmp_entries(store.root)] == []


def test_paths_are_checked(tmp_path: Path) -> None:
    store = owned_store(tmp_path / "store")
    for bad in ("../etc", "A" * 64, "0" * 63, ""):
        with pytest.raises(ValueError):
            store.path_for(bad)
    with pytest.raises(ValueError, match="escapes"):
        store.resolve("../../etc")


def test_sweep_tmp(tmp_path: Path) -> None:
    store = owned_store(tmp_path / "store")
    old = store.root / ".tmp" / "old"
    new = store.root / ".tmp" / "new"
    old.mkdir(parents=True)
    new.mkdir()
    past = time.time() - 7200
    os.utime(old, (past, past))
    assert store.sweep_tmp(older_than_s=3600) == 1
    assert not old.exists() and new.exists()
    assert owned_store(tmp_path / "none").sweep_tmp() == 0
