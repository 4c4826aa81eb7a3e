"""Content-addressed store of adapter files on disk.

Layout: ``<root>/<digest[:2]>/<digest>/{adapter_config.json, adapter_model.safetensors}``
where ``digest`` is the content digest of both files together
(``loraplex.adapter_format``): two uploads share a folder only when both files are
byte-identical, so sharing it tells nobody anything and changes nothing for anybody. A
folder appears under its final name only by one ``rename`` of a complete, fsynced
temporary folder, so a reader (or a crash) never sees half an adapter.

Crash leftovers and concurrent writers (several gateway processes may share one store):

- Every temporary folder under ``.tmp`` is ``flock``-ed by its writer for as long as the
  writer lives; the kernel drops the lock when the process dies (``kill -9`` included).
  ``sweep_tmp`` removes only folders nobody holds and that are older than the grace
  period (the age alone guards filesystems without working ``flock``).
- Putting a folder in place (or finding it there) and removing one happen under the
  ``flock`` of its ``<digest[:2]>`` shard folder, shared for writers and exclusive for the
  remover, and a writer refreshes the folder's mtime: a removal that checked "no row needs
  it and it is older than the grace period" cannot interleave with an upload that is about
  to commit a row for it. An uploader re-checks after its commit (``ensure``).

Ownership: one store belongs to one registry. ``<root>/.registry`` names it (written by
``registry.ownership.claim_store``); an ``AdapterStore`` opened for a registry that is not
the owner may read but never put, remove or sweep (``StoreNotOwnedError``), so a second
registry pointed at the same folder can never delete the first one's adapters as orphans.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Final

from loraplex.adapter_format import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    combine_digests,
    parse_adapter_config,
    stored_folder,
)
from loraplex.errors import AdapterError, StoreNotOwnedError
from loraplex.files import fsync_dir

__all__ = ["CONFIG_FILE", "MAX_CONFIG_BYTES", "OWNER_FILE", "PICKLE_SUFFIXES", "WEIGHTS_FILE",
           "AdapterStore", "StoreOwner", "StoredAdapter", "TmpDir"]

# Pickle-based formats run code when loaded; a folder holding any of them is refused whole.
PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_CHUNK: Final = 1 << 20
_DIGEST_RE: Final = re.compile(r"^[0-9a-f]{64}$")
_TMP_DIR: Final = ".tmp"
_TRASH_PREFIX: Final = "trash-"
OWNER_FILE: Final = ".registry"


@dataclass(frozen=True)
class StoreOwner:
    """What ``<root>/.registry`` says: the owning registry's id and, for people reading an
    error, its database (password hidden)."""

    registry_id: str
    database: str


@dataclass(frozen=True)
class StoredAdapter:
    """Where an adapter's files ended up.

    ``path`` is absolute; ``relative_path`` is what the registry records, so the store can
    be mounted at another path (a container) without rewriting rows. ``created`` is False
    when identical content was already stored.
    """

    digest: str
    path: Path
    size: int
    relative_path: str
    created: bool = True


def _copy_stream(src: BinaryIO, dst: BinaryIO, hasher: Any) -> int:
    size = 0
    while chunk := src.read(_CHUNK):
        hasher.update(chunk)
        dst.write(chunk)
        size += len(chunk)
    return size


def _try_flock(fd: int, flags: int) -> bool:
    try:
        fcntl.flock(fd, flags | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextmanager
def _dir_lock(path: Path, *, exclusive: bool, wait: bool = True) -> Iterator[bool]:
    """Holds a ``flock`` on the folder ``path``; yields False (holding nothing) when
    ``wait`` is False and another process or thread holds a conflicting lock."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if wait:
            fcntl.flock(fd, flags)
            yield True
        else:
            yield _try_flock(fd, flags)
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class TmpDir:
    """A private folder under the store's ``.tmp``, locked while its writer holds it.

    Use as a context manager: the folder is removed at exit. The lock is taken right after
    ``mkdir``; the grace period covers that instant.
    """

    def __init__(self, store_root: Path, prefix: str = "") -> None:
        tmp_root = store_root / _TMP_DIR
        tmp_root.mkdir(parents=True, exist_ok=True)
        self.path = tmp_root / f"{prefix}{uuid.uuid4().hex}"
        self.path.mkdir()
        self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __enter__(self) -> TmpDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def touch(self) -> None:
        """Refreshes the folder's mtime, the age a sweep without ``flock`` goes by."""
        os.utime(self.path)

    def close(self) -> None:
        """Removes the folder (if still here) and releases the lock."""
        if self._fd is None:
            return
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(self._fd)
            self._fd = None


class AdapterStore:
    """Adapter folders under ``root``, addressed by their content digest.

    ``registry_id``: the registry this store is opened for. It may put, remove and sweep
    only while ``<root>/.registry`` names it (``StoreNotOwnedError`` otherwise; ``None``
    opens the store to read only).
    """

    def __init__(self, root: str | os.PathLike[str], registry_id: str | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.registry_id = registry_id

    def owner(self) -> StoreOwner | None:
        """The registry that owns this store, or None while nobody has claimed it."""
        try:
            with open(self.root / OWNER_FILE, encoding="utf-8") as f:
                data = json.load(f)
            return StoreOwner(str(data["registry_id"]), str(data.get("database", "")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StoreNotOwnedError(f"{self.root / OWNER_FILE} is unreadable ({exc}); it "
                                     "names the registry that owns this adapter store") from None

    def is_owned(self) -> bool:
        """Whether this store is opened for the registry that owns it."""
        owner = self.owner()
        return owner is not None and owner.registry_id == self.registry_id

    def check_owned(self) -> None:
        """Raises StoreNotOwnedError unless ``is_owned()``: before anything is written or
        removed."""
        if self.registry_id is None:
            raise StoreNotOwnedError(f"the adapter store {self.root} is open to read only")
        if not self.is_owned():
            raise StoreNotOwnedError(f"the adapter store {self.root} does not belong to this "
                                     f"registry ({self.registry_id}); nothing is written there")

    def write_owner(self, owner: StoreOwner, *, replacing: str | None) -> bool:
        """Records ``owner``. ``replacing`` None: only where no owner is recorded yet
        (False if another got there first); else only over that registry id (a move of the
        registry). Atomic either way: written aside, fsynced, then linked or renamed."""
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.root / OWNER_FILE
        fd, tmp = tempfile.mkstemp(prefix=".registry-", dir=self.root)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"registry_id": owner.registry_id, "database": owner.database}, f)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            if replacing is None:
                try:
                    os.link(tmp, target)  # fails if any owner is there
                except FileExistsError:
                    return False
                except OSError:  # a filesystem without hard links: create it exclusively
                    try:
                        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    except FileExistsError:
                        return False
                    with os.fdopen(fd, "wb") as out, open(tmp, "rb") as src:
                        out.write(src.read())
                        out.flush()
                        os.fsync(out.fileno())
            else:
                current = self.owner()
                if current is None or current.registry_id != replacing:
                    raise StoreNotOwnedError(f"the adapter store {self.root} no longer "
                                             f"belongs to registry {replacing}")
                os.replace(tmp, target)
            fsync_dir(self.root)
            return True
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def path_for(self, digest: str) -> Path:
        """The folder of ``digest`` (which may not exist)."""
        return self.root / self.relative_path_for(digest)

    @staticmethod
    def relative_path_for(digest: str) -> str:
        """``<digest[:2]>/<digest>``; refuses anything but 64 lowercase hex digits."""
        return stored_folder(digest)

    def resolve(self, relative_path: str) -> Path:
        """The absolute folder of a path recorded in the registry, kept inside the root."""
        path = (self.root / relative_path).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"storage path escapes the adapter store: {relative_path!r}")
        return path

    def exists(self, digest: str) -> bool:
        """Whether a complete copy of ``digest`` is stored."""
        path = self.path_for(digest)
        return (path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file()

    def tmp_dir(self, prefix: str = "") -> TmpDir:
        """A fresh private folder under ``.tmp`` that no sweep touches while it is held."""
        return TmpDir(self.root, prefix)

    @contextmanager
    def _shard_lock(self, digest: str, *, exclusive: bool,
                    wait: bool = True) -> Iterator[bool]:
        shard = self.path_for(digest).parent
        shard.mkdir(parents=True, exist_ok=True)  # shard folders are never removed
        with _dir_lock(shard, exclusive=exclusive, wait=wait) as locked:
            yield locked

    def put_dir(self, src_dir: str | os.PathLike[str]) -> StoredAdapter:
        """Copies a PEFT adapter folder into the store, atomically.

        Only ``adapter_config.json`` and ``adapter_model.safetensors`` are copied; a folder
        holding pickle files is refused. Both files are hashed as they are copied, so the
        digest names exactly the bytes stored even if the source changes meanwhile.
        Raises AdapterError for a bad folder (a config that is no JSON object included).
        """
        src = Path(src_dir)
        self.check_owned()
        self._check_source(src)
        with self.tmp_dir() as tmp:
            hasher = hashlib.sha256()
            try:
                with (open(src / WEIGHTS_FILE, "rb") as fin,
                      open(tmp.path / WEIGHTS_FILE, "xb") as fout):
                    weights_size = _copy_stream(fin, fout, hasher)
                    fout.flush()
                    os.fsync(fout.fileno())
                with open(src / CONFIG_FILE, "rb") as fin:
                    config_raw = fin.read(MAX_CONFIG_BYTES + 1)
            except FileNotFoundError as exc:
                raise AdapterError(f"{src}: {Path(exc.filename or '').name} vanished while "
                                   "it was being copied") from exc
            try:
                parse_adapter_config(config_raw)
            except AdapterError as exc:
                raise AdapterError(f"{src}: {exc}") from None
            with open(tmp.path / CONFIG_FILE, "xb") as fout:
                fout.write(config_raw)
                fout.flush()
                os.fsync(fout.fileno())
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                os.chmod(tmp.path / name, 0o444)  # content-addressed files never change
            fsync_dir(tmp.path)

            digest = combine_digests(hasher.digest(), hashlib.sha256(config_raw).digest())
            final = self.path_for(digest)
            stored = StoredAdapter(digest=digest, path=final,
                                   size=weights_size + len(config_raw),
                                   relative_path=self.relative_path_for(digest))
            with self._shard_lock(digest, exclusive=False):
                if self._refresh(digest):
                    return replace(stored, created=False)
                try:
                    os.rename(tmp.path, final)
                except OSError:
                    # Another writer renamed the same content in first: theirs is as good.
                    if not self._refresh(digest):
                        raise
                    return replace(stored, created=False)
                os.utime(final)  # the grace period counts from now, not from the copy
                fsync_dir(final.parent)
            return stored

    def _refresh(self, digest: str) -> bool:
        """Under the shard lock: whether ``digest`` is stored; if so its mtime is renewed,
        so a sweep does not take it for an old orphan before our row is committed."""
        if not self.exists(digest):
            return False
        try:
            os.utime(self.path_for(digest))
        except FileNotFoundError:
            return False
        return True

    def ensure(self, digest: str, src_dir: str | os.PathLike[str]) -> None:
        """After a row naming ``digest`` is committed: makes sure its files are stored,
        putting ``src_dir`` again if a concurrent removal took them before the commit."""
        with self._shard_lock(digest, exclusive=False):
            if self.exists(digest):
                return
        again = self.put_dir(src_dir)
        if again.digest != digest:
            raise AdapterError(f"the files of {digest[:12]} changed while being stored")

    def remove(self, digest: str, *, unless: Callable[[], bool] | None = None,
               older_than_s: float | None = None, wait: bool = True) -> bool:
        """Deletes the stored copy of ``digest``; True if this call removed it.

        Under the shard's exclusive lock the copy is kept if it is younger than
        ``older_than_s`` or if ``unless()`` is true (the registry still needs it; the caller
        passes that check), then renamed out of its addressable name, so a concurrent
        reader sees the whole adapter or nothing. With ``wait`` False a busy shard is left
        for the next sweep.
        """
        final = self.path_for(digest)
        if not final.parent.is_dir():
            return False
        self.check_owned()
        with self._shard_lock(digest, exclusive=True, wait=wait) as locked:
            if not locked:
                return False
            try:
                mtime = final.stat().st_mtime
            except FileNotFoundError:
                return False
            if older_than_s is not None and mtime >= time.time() - older_than_s:
                return False
            if unless is not None and unless():
                return False
            tmp_root = self.root / _TMP_DIR
            tmp_root.mkdir(parents=True, exist_ok=True)
            trash = tmp_root / f"{_TRASH_PREFIX}{uuid.uuid4().hex}"
            try:
                os.rename(final, trash)
            except FileNotFoundError:
                return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def stored_digests(self) -> list[str]:
        """Digests with a folder in the store (complete or not), sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.glob("??/*")
                      if p.is_dir() and p.parent.name == p.name[:2]
                      and _DIGEST_RE.match(p.name))

    def sweep_tmp(self, older_than_s: float = 3600.0) -> int:
        """Removes what crashed writers left under ``.tmp``; returns how many entries.

        A folder goes only if no live writer holds its lock and it is older than
        ``older_than_s``, so uploads in progress, in any process, are never touched.
        """
        tmp_root = self.root / _TMP_DIR
        if not tmp_root.is_dir():
            return 0
        self.check_owned()
        cutoff = time.time() - older_than_s
        removed = 0
        for entry in tmp_root.iterdir():
            try:
                if entry.lstat().st_mtime >= cutoff:
                    continue
                if entry.is_symlink() or not entry.is_dir():
                    entry.unlink()
                    removed += 1
                    continue
                with _dir_lock(entry, exclusive=True, wait=False) as free:
                    if free:
                        shutil.rmtree(entry, ignore_errors=True)
                        removed += 1
            except FileNotFoundError:
                continue
        return removed

    @staticmethod
    def _check_source(src: Path) -> None:
        if not src.is_dir():
            raise AdapterError(f"{src}: not a folder")
        pickles = sorted(str(p.relative_to(src)) for p in src.rglob("*")
                         if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(f"{src}: pickle files are refused ({', '.join(pickles)}); "
                               "save the adapter with safe_serialization=True")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (src / name).is_file():
                raise AdapterError(f"{src}: missing {name}")
