"""The upload pipeline end to end, on SQLite and PostgreSQL: every refusal names the problem
and leaves nothing behind (no stored copy, no staging folder, no row)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import stat
import tarfile
import time
import zipfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from owned_stores import owned_store
from safetensors.numpy import load_file, save_file
from sqlalchemy.orm import Session, sessionmaker

from loraplex.adapter_format import folder_digest
from loraplex.errors import (
    AdapterError,
    AdapterNotFoundError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    UploadTooLargeError,
)
from loraplex.model.adapter_loader import TargetShapes, validate_adapter_dir
from loraplex.registry import service
from loraplex.registry.models import Adapter, Tenant
from loraplex.registry.store import CONFIG_FILE, WEIGHTS_FILE, AdapterStore
from loraplex.registry.upload import (
    AdapterUploader,
    DeletedAdapter,
    UploadLimits,
    UploadResult,
    delete_adapter,
    remove_unreferenced,
    stored_digests,
)

MAX_RANK = 8
MiB = 1 << 20
MakeAdapter = Callable[..., Path]


@pytest.fixture(scope="session")
def target(model_dir: Path) -> TargetShapes:
    return TargetShapes.from_model_dir(model_dir)


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    return owned_store(tmp_path / "store")


@pytest.fixture
def make_uploader(store: AdapterStore, target: TargetShapes,
                  model_dir: Path) -> Callable[..., AdapterUploader]:
    def make(limits: UploadLimits | None = None,
             names: tuple[str, ...] = ()) -> AdapterUploader:
        return AdapterUploader(store, lambda p: validate_adapter_dir(p, target, MAX_RANK),
                               base_model=str(model_dir), base_model_names=names,
                               limits=limits)

    return make


@pytest.fixture
def uploader(make_uploader: Callable[..., AdapterUploader]) -> AdapterUploader:
    return make_uploader()


@pytest.fixture
def tenant_id(session_factory: sessionmaker[Session]) -> int:
    with session_factory.begin() as session:
        return service.create_tenant(session, "acme").id


def upload_files(up: AdapterUploader, factory: sessionmaker[Session],
                 files: dict[str, Any], **kwargs: Any) -> UploadResult:
    """A multipart upload as the gateway makes one: files staged, then committed."""
    with up.staging() as staging:
        for filename, src in files.items():
            staging.write(filename, src)
        return up.commit(factory, staging, **kwargs)


def _rows(factory: sessionmaker[Session]) -> list[Adapter]:
    with factory() as session:
        return list(session.scalars(sa.select(Adapter).order_by(Adapter.id)))


def assert_nothing_left(store: AdapterStore, factory: sessionmaker[Session]) -> None:
    assert stored_digests(store) == []
    tmp = store.root / ".tmp"
    assert not tmp.exists() or list(tmp.iterdir()) == []
    assert _rows(factory) == []


def _sha(folder: Path) -> str:
    return folder_digest(folder)


# --- building bad inputs -----------------------------------------------------------------


def _members(folder: Path, prefix: str = "") -> list[tuple[str, bytes]]:
    return [(prefix + n, (folder / n).read_bytes()) for n in (CONFIG_FILE, WEIGHTS_FILE)]


def _zip(out: Path, members: list[tuple[str | zipfile.ZipInfo, bytes]]) -> Path:
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return out


def _tar_info(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE,
              link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


def _pax_bomb() -> tuple[tarfile.TarInfo, bytes]:
    info, data = _tar_info("README.md", b"#")
    info.pax_headers = {"comment": "x" * (3 * MiB)}
    return info, data


def _tgz(out: Path, members: list[tuple[str, bytes] | tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(out, "w:gz") as tf:
        for entry, data in members:
            info = entry if isinstance(entry, tarfile.TarInfo) else _tar_info(entry, data)[0]
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out


def _zip_symlink(name: str, target: str) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info, target.encode()


def _lying_zip(out: Path, folder: Path) -> Path:
    """A zip whose headers say the weights are 100 bytes; the data inflates to 3 MiB."""
    _zip(out, [(CONFIG_FILE, (folder / CONFIG_FILE).read_bytes()),
               (WEIGHTS_FILE, b"\0" * (3 * MiB))])
    raw = bytearray(out.read_bytes())
    name = WEIGHTS_FILE.encode()
    for sig, size_at, name_at in ((b"PK\x03\x04", 22, 30), (b"PK\x01\x02", 24, 46)):
        at = raw.find(sig)
        while at >= 0:
            if raw[at + name_at:at + name_at + len(name)] == name:
                raw[at + size_at:at + size_at + 4] = (100).to_bytes(4, "little")
            at = raw.find(sig, at + 1)
    out.write_bytes(bytes(raw))
    return out


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _edit_weights(folder: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> Path:
    tensors = load_file(str(folder / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    return folder


def _set(tensors: dict[str, np.ndarray], key: str, value: np.ndarray) -> None:
    tensors[key] = value


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
LM_HEAD_A = "base_model.model.lm_head.lora_A.weight"


def _poison(value: float) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(tensors: dict[str, np.ndarray]) -> None:
        tensors[Q_A] = tensors[Q_A].copy()
        tensors[Q_A][0, 0] = value

    return edit


@dataclass
class Case:
    """A bad upload: ``build(tmp_path, make_adapter)`` gives a path (folder or archive) or
    a ``{filename: bytes}`` mapping; the refusal message must contain every ``expect``."""

    build: Callable[[Path, MakeAdapter], Path | dict[str, bytes]]
    expect: tuple[str, ...]
    limits: UploadLimits | None = None
    names: tuple[str, ...] = ()
    error: type[Exception] = AdapterError
    kwargs: dict[str, Any] = field(default_factory=dict)


def _folder_with(name: str, data: bytes) -> Callable[[Path, MakeAdapter], Path]:
    def build(tmp: Path, make: MakeAdapter) -> Path:
        folder = make()
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
        return folder

    return build


def _without(name: str) -> Callable[[Path, MakeAdapter], Path]:
    def build(tmp: Path, make: MakeAdapter) -> Path:
        folder = make()
        (folder / name).unlink()
        return folder

    return build


def _config(**extra: object) -> Callable[[Path, MakeAdapter], Path]:
    return lambda tmp, make: make(extra_config=extra)


def _zip_case(members: Callable[[Path], list[tuple[str | zipfile.ZipInfo, bytes]]]
              ) -> Callable[[Path, MakeAdapter], Path]:
    return lambda tmp, make: _zip(tmp / "adapter.zip", members(make()))


def _tgz_case(members: Callable[[Path], list[Any]]) -> Callable[[Path, MakeAdapter], Path]:
    return lambda tmp, make: _tgz(tmp / "adapter.tar.gz", members(make()))


ONE_MIB = UploadLimits(max_upload_bytes=64 * MiB, max_unpacked_bytes=MiB)
BAD_UPLOADS: dict[str, Case] = {
    # pickles, wherever they are
    "pickle-in-folder": Case(_folder_with("adapter_model.bin", b"\x80\x04."),
                             ("pickle", "adapter_model.bin")),
    "pickle-in-subfolder": Case(_folder_with("checkpoint-1/optimizer.pt", b"\x80\x04."),
                                ("pickle", "optimizer.pt")),
    "pickle-in-zip": Case(_zip_case(lambda f: [*_members(f), ("adapter_model.bin", b"x")]),
                          ("pickle", "adapter_model.bin")),
    "pickle-in-tgz": Case(_tgz_case(lambda f: [*_members(f, "a/"), ("a/training_args.bin",
                                                                    b"x")]),
                          ("pickle", "training_args.bin")),
    "pickle-part": Case(lambda tmp, make: {"adapter_model.bin": b"\x80\x04."},
                        ("pickle", "adapter_model.bin")),
    # hostile archives
    "zip-traversal": Case(_zip_case(lambda f: [*_members(f), ("../evil/README.md", b"x")]),
                          ("path traversal", "../evil")),
    "tgz-traversal": Case(_tgz_case(lambda f: [*_members(f, "a/"), ("a/../../README.md",
                                                                    b"x")]),
                          ("path traversal",)),
    "zip-absolute": Case(_zip_case(lambda f: [("/" + n, d) for n, d in _members(f)]),
                         ("absolute path", "/adapter_config.json")),
    "tgz-absolute": Case(_tgz_case(lambda f: [("/tmp/" + n, d) for n, d in _members(f)]),
                         ("absolute path",)),
    "zip-symlink": Case(_zip_case(lambda f: [_members(f)[0],
                                             _zip_symlink(WEIGHTS_FILE, "/etc/passwd")]),
                        ("links are refused", WEIGHTS_FILE)),
    "tgz-symlink": Case(_tgz_case(lambda f: [_members(f)[0], _tar_info(
        WEIGHTS_FILE, kind=tarfile.SYMTYPE, link="/etc/passwd")]),
                        ("links are refused", WEIGHTS_FILE)),
    "tgz-hardlink": Case(_tgz_case(lambda f: [_members(f)[0], _tar_info(
        WEIGHTS_FILE, kind=tarfile.LNKTYPE, link=CONFIG_FILE)]), ("links are refused",)),
    "tgz-fifo": Case(_tgz_case(lambda f: [*_members(f), _tar_info("README.md",
                                                                  kind=tarfile.FIFOTYPE)]),
                     ("special files",)),
    "zip-too-many-files": Case(_zip_case(lambda f: [*_members(f), *(
        (f"x{i}.txt", b"") for i in range(7))]), ("too many files", "9 members")),
    # A tar is read as a stream, so the count is met member by member: members that are
    # each allowed (the top folder, over and over) must still stop at the cap.
    "tgz-too-many-files": Case(_tgz_case(lambda f: [*(
        _tar_info("a", kind=tarfile.DIRTYPE) for _ in range(7)), *_members(f, "a/")]),
        ("too many files", "9 members")),
    "zip-bomb-declared": Case(_zip_case(lambda f: [(CONFIG_FILE, b"{}"), (
        WEIGHTS_FILE, b"\0" * (3 * MiB))]), ("unpacks to more than 1048576 bytes",),
                              limits=ONE_MIB),
    "zip-bomb-lying": Case(lambda tmp, make: _lying_zip(tmp / "bomb.zip", make()),
                           ("not a valid zip archive", "CRC"), limits=ONE_MIB),
    "tgz-bomb-declared": Case(_tgz_case(lambda f: [*_members(f), (
        "README.md", b"\0" * (3 * MiB))]), ("unpacks to more than",), limits=ONE_MIB),
    # Bytes that are in no member (a 3 MiB pax header) still count while decompressing.
    "tgz-bomb-in-headers": Case(_tgz_case(lambda f: [_pax_bomb(), *_members(f)]),
                                ("unpacks to more than",), limits=ONE_MIB),
    "zip-nested": Case(_zip_case(lambda f: _members(f, "a/b/")), ("nested folders",)),
    "zip-two-top-folders": Case(_zip_case(lambda f: [
        (f"{d}/{n}", b) for d, (n, b) in zip("ab", _members(f), strict=True)]),
        ("one top folder",)),
    "zip-unexpected-file": Case(_zip_case(lambda f: [*_members(f), ("notes.txt", b"")]),
                                ("unexpected file", "notes.txt")),
    "tgz-duplicate": Case(_tgz_case(lambda f: [*_members(f), _members(f)[1]]),
                          ("appears twice",)),
    "zip-garbage": Case(lambda tmp, make: _write(tmp / "a.zip", os.urandom(4096)),
                        ("not a valid zip archive",)),
    "tgz-garbage": Case(lambda tmp, make: _write(tmp / "a.tar.gz", b"junk" * 99),
                        ("not a valid .tar.gz",)),
    "archive-and-files": Case(lambda tmp, make: {"a.zip": b"PK", CONFIG_FILE: b"{}"},
                              ("not both",)),
    "unexpected-part": Case(lambda tmp, make: {"model.safetensors": b"x"},
                            ("unexpected file", "model.safetensors")),
    "empty-upload": Case(lambda tmp, make: {}, ("empty upload",)),
    "too-large": Case(lambda tmp, make: {WEIGHTS_FILE: b"\0" * 5000, CONFIG_FILE: b"{}"},
                      ("upload too large", "4096"), error=UploadTooLargeError,
                      limits=UploadLimits(max_upload_bytes=4096)),
    # the files themselves
    "not-safetensors": Case(_folder_with(WEIGHTS_FILE, os.urandom(4096)),
                            ("not a valid safetensors",)),
    "missing-config": Case(_without(CONFIG_FILE), ("missing adapter_config.json",)),
    "missing-weights-in-zip": Case(_zip_case(lambda f: _members(f)[:1]),
                                   ("missing adapter_model.safetensors",)),
    "unparsable-config": Case(_folder_with(CONFIG_FILE, b"{r: 4,"),
                              ("adapter_config.json is not valid JSON",)),
    "not-lora": Case(_config(peft_type="IA3"), ("peft_type 'IA3'",)),
    "rank-above-max": Case(lambda tmp, make: make(rank=16),
                           ("rank 16 is above max_lora_rank 8",)),
    "unknown-module-tensor": Case(lambda tmp, make: _edit_weights(make(), lambda t: _set(
        t, LM_HEAD_A, np.zeros((4, 32), np.float32))), ("no supported module", "lm_head")),
    "unknown-target-module": Case(_config(target_modules=["q_proj", "v_proj", "lm_head"]),
                                  ("targets unsupported modules: lm_head",)),
    "targeted-without-weights": Case(_config(target_modules=["q_proj", "k_proj", "v_proj"]),
                                     ("no weights", "k_proj")),
    "wrong-shape": Case(lambda tmp, make: _edit_weights(make(), lambda t: _set(
        t, Q_A, np.zeros((4, 16), np.float32))), ("shape mismatch", "q_proj")),
    "nan": Case(lambda tmp, make: _edit_weights(make(), _poison(float("nan"))),
                ("contains NaN",)),
    "inf": Case(lambda tmp, make: _edit_weights(make(), _poison(float("inf"))),
                ("contains Inf",)),
    "dora": Case(_config(use_dora=True), ("unsupported PEFT option use_dora",)),
    "modules-to-save": Case(_config(modules_to_save=["lm_head"]),
                            ("unsupported PEFT option modules_to_save",)),
    "bias": Case(_config(bias="lora_only"), ("unsupported PEFT option bias",)),
    "rank-pattern": Case(_config(rank_pattern={"q_proj": 8}),
                         ("unsupported PEFT option rank_pattern",)),
    "alpha-pattern": Case(_config(alpha_pattern={"q_proj": 2}),
                          ("unsupported PEFT option alpha_pattern",)),
    "base-model-mismatch": Case(lambda tmp, make: make(),
                                ("base model mismatch", "'tiny-llama'", "'meta-llama/Llama-3.1-8B'"),
                                names=("meta-llama/Llama-3.1-8B",)),
    "base-model-mismatch-and-shapes": Case(
        lambda tmp, make: _edit_weights(make(), lambda t: _set(
            t, Q_A, np.zeros((4, 16), np.float32))),
        ("shape mismatch", "trained on 'tiny-llama'"), names=("Llama-3.1-8B",)),
    # the request
    "bad-name": Case(lambda tmp, make: make(), ("invalid adapter name",),
                     error=InvalidRequestError, kwargs={"name": "a/b"}),
    "bad-visibility": Case(lambda tmp, make: make(), ("visibility",),
                           error=InvalidRequestError, kwargs={"visibility": "world"}),
    # refused by the database after the files were stored: they go again
    "unknown-tenant": Case(lambda tmp, make: make(), ("no tenant",), error=NotFoundError,
                           kwargs={"tenant_id": 999_999}),
}


@pytest.mark.parametrize("case_id", list(BAD_UPLOADS))
def test_bad_upload_is_refused_and_leaves_nothing(
        case_id: str, tmp_path: Path, make_adapter: MakeAdapter,
        make_uploader: Callable[..., AdapterUploader], store: AdapterStore,
        session_factory: sessionmaker[Session], tenant_id: int) -> None:
    case = BAD_UPLOADS[case_id]
    source = case.build(tmp_path, make_adapter)
    up = make_uploader(limits=case.limits, names=case.names)
    kwargs: dict[str, Any] = {"tenant_id": tenant_id, "name": "x"} | case.kwargs
    with pytest.raises(case.error) as info:
        if isinstance(source, dict):
            upload_files(up, session_factory, files={
                k: io.BytesIO(v) for k, v in source.items()}, **kwargs)
        else:
            up.upload_path(session_factory, path=source, **kwargs)
    message = str(info.value)
    for fragment in case.expect:
        assert fragment in message, message
    assert "\n" not in message
    assert str(store.root) not in message  # server paths stay private
    assert_nothing_left(store, session_factory)


# --- success paths -----------------------------------------------------------------------


def test_folder_upload(uploader: AdapterUploader, store: AdapterStore, model_dir: Path,
                       make_adapter: MakeAdapter, session_factory: sessionmaker[Session],
                       tenant_id: int) -> None:
    src = make_adapter(rank=4, alpha=8.0)
    (src / "tokenizer.json").write_text("{}")  # a trainer's leftovers are ignored
    result = uploader.upload_path(session_factory, tenant_id=tenant_id, name="helper",
                                  path=src, visibility="public")
    row = result.adapter
    assert result.created
    assert (row.version, row.rank, row.alpha, row.visibility, row.status) == (
        1, 4, 8.0, "public", "active")
    assert row.digest == _sha(src)
    assert row.identity == f"{row.id}@{row.digest}"
    assert row.target_modules == ["q_proj", "v_proj"]
    assert row.base_model == str(model_dir)
    stored = store.resolve(row.storage_path)
    assert sorted(p.name for p in stored.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert (stored / WEIGHTS_FILE).read_bytes() == (src / WEIGHTS_FILE).read_bytes()
    assert row.size_bytes == result.size_bytes == sum(
        (src / n).stat().st_size for n in (CONFIG_FILE, WEIGHTS_FILE))
    assert list((store.root / ".tmp").iterdir()) == []
    assert [r.id for r in _rows(session_factory)] == [row.id]  # committed


ARCHIVE_LAYOUTS: dict[str, Callable[[Path, Path], Path]] = {
    "zip-flat": lambda f, out: _zip(out / "a.zip", [*_members(f)]),
    "zip-top-folder": lambda f, out: _zip(out / "a.ZIP", [
        ("my-adapter/", b""), *_members(f, "my-adapter/"), ("my-adapter/README.md", b"#")]),
    "tgz-dot-prefix": lambda f, out: _tgz(out / "a.tgz", [
        _tar_info(".", kind=tarfile.DIRTYPE), *_members(f, "./")]),
    "tar.gz-top-folder": lambda f, out: _tgz(out / "a.tar.gz", [
        _tar_info("lora", kind=tarfile.DIRTYPE), ("lora/README.md", b"# hi"),
        *_members(f, "lora/")]),
}


@pytest.mark.parametrize("layout", list(ARCHIVE_LAYOUTS))
def test_archive_upload(layout: str, tmp_path: Path, uploader: AdapterUploader,
                        store: AdapterStore, make_adapter: MakeAdapter,
                        session_factory: sessionmaker[Session], tenant_id: int) -> None:
    src = make_adapter()
    archive = ARCHIVE_LAYOUTS[layout](src, tmp_path)
    result = uploader.upload_path(session_factory, tenant_id=tenant_id, name="x",
                                  path=archive)
    assert result.adapter.digest == _sha(src)
    assert stored_digests(store) == [result.adapter.digest]
    assert list((store.root / ".tmp").iterdir()) == []


def test_multipart_files(uploader: AdapterUploader, make_adapter: MakeAdapter,
                         session_factory: sessionmaker[Session], tenant_id: int) -> None:
    src = make_adapter()
    weights = (src / WEIGHTS_FILE).read_bytes()
    chunks = [weights[i:i + 100] for i in range(0, len(weights), 100)]
    with open(src / CONFIG_FILE, "rb") as config:
        result = upload_files(uploader, session_factory, tenant_id=tenant_id, name="x", files={
            # Browsers send a folder's files with their relative path: only the name counts.
            f"my-adapter/{CONFIG_FILE}": config,
            f"C:\\Users\\me\\{WEIGHTS_FILE}": iter(chunks),
            "README.md": io.BytesIO(b"# notes"),
        })
    assert result.adapter.digest == _sha(src)


def test_async_streaming(uploader: AdapterUploader, store: AdapterStore,
                         make_adapter: MakeAdapter, session_factory: sessionmaker[Session],
                         tenant_id: int) -> None:
    src = make_adapter()
    seen: list[int] = []

    async def chunks(data: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(data), 4096):
            await asyncio.sleep(0)
            yield data[i:i + 4096]

    async def handler() -> Adapter:
        with uploader.staging(progress=seen.append) as staging:
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                await staging.write_async(name, chunks((src / name).read_bytes()))
            result = await asyncio.to_thread(uploader.commit, session_factory, staging,
                                             tenant_id=tenant_id, name="x")
        return result.adapter

    row = asyncio.run(handler())
    assert row.digest == _sha(src)
    total = sum((src / n).stat().st_size for n in (CONFIG_FILE, WEIGHTS_FILE))
    assert seen == sorted(seen) and seen[-1] == total and len(seen) > 2
    assert list((store.root / ".tmp").iterdir()) == []


def test_too_large_stops_the_stream(make_uploader: Callable[..., AdapterUploader],
                                    store: AdapterStore) -> None:
    up = make_uploader(limits=UploadLimits(max_upload_bytes=10_000))
    pulled = 0

    def endless() -> Any:
        nonlocal pulled
        while True:
            pulled += 1
            yield b"\0" * 1000

    with up.staging() as staging, pytest.raises(UploadTooLargeError) as info:
        staging.write(WEIGHTS_FILE, endless())
    assert info.value.max_bytes == 10_000 and pulled == 11
    assert list((store.root / ".tmp").iterdir()) == []


def test_same_name_makes_a_new_version(uploader: AdapterUploader, store: AdapterStore,
                                       make_adapter: MakeAdapter,
                                       session_factory: sessionmaker[Session],
                                       tenant_id: int) -> None:
    v1 = uploader.upload_path(session_factory, tenant_id=tenant_id, name="helper",
                              path=make_adapter("one", seed=1)).adapter
    v2 = uploader.upload_path(session_factory, tenant_id=tenant_id, name="helper",
                              path=make_adapter("two", seed=2)).adapter
    assert (v1.version, v2.version) == (1, 2)
    assert v1.digest != v2.digest and v1.identity != v2.identity
    with session_factory() as session:
        assert service.resolve_adapter(session, tenant_id, "helper").id == v2.id
        # The old version stays intact for the requests already running on it.
        assert service.get_adapter(session, v1.id).status == "active"
    assert stored_digests(store) == sorted([v1.digest, v2.digest])


def test_identical_content_is_stored_once(tmp_path: Path, uploader: AdapterUploader,
                                          store: AdapterStore, make_adapter: MakeAdapter,
                                          session_factory: sessionmaker[Session],
                                          tenant_id: int) -> None:
    src = make_adapter()
    first = uploader.upload_path(session_factory, tenant_id=tenant_id, name="a", path=src)
    again = uploader.upload_path(session_factory, tenant_id=tenant_id, name="a", path=src)
    zipped = uploader.upload_path(session_factory, tenant_id=tenant_id, name="b",
                                  path=_zip(tmp_path / "b.zip", _members(src)))
    assert (first.created, again.created, zipped.created) == (True, False, False)
    assert (again.adapter.version, zipped.adapter.version) == (2, 1)
    assert len(stored_digests(store)) == 1 and len(_rows(session_factory)) == 3


def test_crash_between_store_and_commit_leaves_nothing(
        uploader: AdapterUploader, store: AdapterStore, make_adapter: MakeAdapter,
        session_factory: sessionmaker[Session], tenant_id: int) -> None:
    seen: list[bool] = []

    def crash(session: Session, row: Adapter) -> None:
        seen.append(store.exists(row.digest))  # the files are in place before the commit
        raise RuntimeError("power cut")

    with pytest.raises(RuntimeError, match="power cut"):
        uploader.upload_path(session_factory, tenant_id=tenant_id, name="x",
                             path=make_adapter(), on_registered=crash)
    assert seen == [True]
    assert_nothing_left(store, session_factory)


def test_failed_commit_leaves_nothing(uploader: AdapterUploader, store: AdapterStore,
                                      make_adapter: MakeAdapter,
                                      session_factory: sessionmaker[Session],
                                      tenant_id: int) -> None:
    def clash(session: Session, row: Adapter) -> None:
        session.add(Tenant(name="acme"))  # a duplicate: the commit's flush fails

    with pytest.raises(sa.exc.IntegrityError):
        uploader.upload_path(session_factory, tenant_id=tenant_id, name="x",
                             path=make_adapter(), on_registered=clash)
    assert_nothing_left(store, session_factory)


def test_failure_keeps_content_it_did_not_create(
        uploader: AdapterUploader, store: AdapterStore, make_adapter: MakeAdapter,
        session_factory: sessionmaker[Session], tenant_id: int) -> None:
    src = make_adapter()
    kept = uploader.upload_path(session_factory, tenant_id=tenant_id, name="a", path=src)

    def crash(session: Session, row: Adapter) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        uploader.upload_path(session_factory, tenant_id=tenant_id, name="b", path=src,
                             on_registered=crash)
    assert stored_digests(store) == [kept.adapter.digest]
    assert [r.name for r in _rows(session_factory)] == ["a"]


def test_upload_restores_content_a_concurrent_delete_removed(
        uploader: AdapterUploader, store: AdapterStore, make_adapter: MakeAdapter,
        session_factory: sessionmaker[Session], tenant_id: int) -> None:
    src = make_adapter()
    first = uploader.upload_path(session_factory, tenant_id=tenant_id, name="a", path=src)

    def racing_delete(session: Session, row: Adapter) -> None:
        # Another worker deletes "a" and, seeing no committed row that needs them, removes
        # the shared files, between our put_dir (which found them stored) and our commit.
        # (Its row update would wait for our write lock on SQLite: only the effect is
        # replayed here.)
        assert store.remove(row.digest)

    second = uploader.upload_path(session_factory, tenant_id=tenant_id, name="b", path=src,
                                  on_registered=racing_delete)
    assert not second.created
    assert store.exists(first.adapter.digest)


def test_delete(uploader: AdapterUploader, store: AdapterStore, make_adapter: MakeAdapter,
                session_factory: sessionmaker[Session], tenant_id: int) -> None:
    shared, own = make_adapter("shared", seed=1), make_adapter("own", seed=2)
    with session_factory.begin() as session:
        other = service.create_tenant(session, "bob").id
    v1 = uploader.upload_path(session_factory, tenant_id=tenant_id, name="h", path=shared)
    v2 = uploader.upload_path(session_factory, tenant_id=tenant_id, name="h", path=own)
    uploader.upload_path(session_factory, tenant_id=other, name="copy", path=shared)

    told: list[list[DeletedAdapter]] = []
    gone = delete_adapter(session_factory, store, tenant_id=tenant_id, name="h", version=2,
                          on_deleted=lambda d: told.append(list(d)))
    assert [(d.version, d.identity) for d in gone] == [(2, v2.adapter.identity)]
    assert told == [gone]
    assert not store.exists(v2.adapter.digest)  # no active row needs it
    with session_factory() as session:
        assert service.resolve_adapter(session, tenant_id, "h").version == 1

    delete_adapter(session_factory, store, tenant_id=tenant_id, name="h")
    with session_factory() as session, pytest.raises(AdapterNotFoundError):
        service.resolve_adapter(session, tenant_id, "h")
    assert store.exists(v1.adapter.digest)  # bob's copy still needs it
    with pytest.raises(AdapterNotFoundError):
        delete_adapter(session_factory, store, tenant_id=tenant_id, name="h")


def test_delete_hook_failure_still_removes_files(
        uploader: AdapterUploader, store: AdapterStore, make_adapter: MakeAdapter,
        session_factory: sessionmaker[Session], tenant_id: int) -> None:
    row = uploader.upload_path(session_factory, tenant_id=tenant_id, name="h",
                               path=make_adapter()).adapter

    def broken(deleted: object) -> None:
        raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError):
        delete_adapter(session_factory, store, tenant_id=tenant_id, name="h",
                       on_deleted=broken)
    assert not store.exists(row.digest)
    assert [r.status for r in _rows(session_factory)] == ["deleted"]


def test_remove_unreferenced(uploader: AdapterUploader, store: AdapterStore,
                             make_adapter: MakeAdapter, session_factory: sessionmaker[Session],
                             tenant_id: int) -> None:
    kept = uploader.upload_path(session_factory, tenant_id=tenant_id, name="a",
                                path=make_adapter("a", seed=1)).adapter
    orphan = store.put_dir(make_adapter("b", seed=2))  # as if the process died before commit
    assert remove_unreferenced(session_factory, store) == []  # too young: maybe in flight
    old = time.time() - 7200
    os.utime(orphan.path, (old, old))
    os.utime(store.path_for(kept.digest), (old, old))
    assert remove_unreferenced(session_factory, store) == [orphan.digest]
    assert stored_digests(store) == [kept.digest]


def test_upload_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_files"):
        UploadLimits(max_files=0)


def test_config_check_is_size_capped(tmp_path: Path, uploader: AdapterUploader,
                                     store: AdapterStore, make_adapter: MakeAdapter,
                                     session_factory: sessionmaker[Session],
                                     tenant_id: int) -> None:
    src = make_adapter()
    config = json.loads((src / CONFIG_FILE).read_text())
    config["task_type"] = "x" * (2 * MiB)
    (src / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="larger than"):
        uploader.upload_path(session_factory, tenant_id=tenant_id, name="x", path=src)
    assert_nothing_left(store, session_factory)


def test_version_race_takes_the_next_version(uploader: AdapterUploader,
                                             make_adapter: MakeAdapter,
                                             session_factory: sessionmaker[Session],
                                             tenant_id: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    real = service.register_adapter
    calls: list[int] = []

    def racing(session: Session, **kwargs: Any) -> Adapter:
        calls.append(1)
        if len(calls) == 1:
            # Another upload of the same name commits version 1 between our read of the
            # latest version and our insert: what register_adapter then raises.
            with session_factory.begin() as other:
                real(other, **kwargs)
            raise ConflictError("adapter 'x' was uploaded concurrently; retry")
        return real(session, **kwargs)

    monkeypatch.setattr(service, "register_adapter", racing)
    result = uploader.upload_path(session_factory, tenant_id=tenant_id, name="x",
                                  path=make_adapter())
    assert len(calls) == 2 and result.adapter.version == 2
