"""The adapter upload pipeline: the one code path behind the admin API, the tenant API, the
admin UI and the CLI.

receive → unpack → validate → store → commit:

1. Received bytes stream into a private staging folder under the store's ``.tmp`` (same
   filesystem, locked while this process lives, swept by ``AdapterStore.sweep_tmp`` after
   a crash; see ``registry.sweep``), under a running byte
   cap, and under what is left of the tenant's storage quota (``registry.quotas``). Only
   ``adapter_config.json`` + ``adapter_model.safetensors`` (+ ``README.md``), or
   one ``.zip`` / ``.tar.gz`` of them, are accepted; pickle files are refused by name.
2. An archive is unpacked by ``archive.unpack_archive``, member by member, into a flat
   folder: absolute paths, ``..``, links, devices, too many members and too many bytes are
   refused; sizes are checked as declared and counted while extracting (headers lie).
3. The staged folder is checked by the engine's own loader, injected as ``validate`` so the
   registry never imports the engine.
4. The tenant's storage quotas are checked against the files to be stored, then
   ``AdapterStore.put_dir`` hashes, fsyncs and renames the files into the content-addressed
   store (identical content, both files byte for byte, is stored once).
5. The row is registered and committed in a short transaction the pipeline owns: only then
   can it promise that a failure at any step, the commit included, leaves neither a file
   (that this upload created) nor a row. The quotas are checked again there, under a lock
   on the tenant, so concurrent uploads cannot both fit. ``on_registered`` runs inside
   that transaction.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import (
    AsyncIterable,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Sequence,
)
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Final, Protocol

from sqlalchemy.orm import Session, sessionmaker

from loraplex.adapter_format import read_adapter_config
from loraplex.errors import (
    AdapterError,
    AdapterNotFoundError,
    ConflictError,
    InvalidRequestError,
    UploadTooLargeError,
)
from loraplex.registry import quotas, service
from loraplex.registry.archive import (
    ALLOWED_FILES,
    HINT,
    README_FILE,
    UploadLimits,
    is_archive,
    refuse_pickle,
    require_adapter_files,
    unpack_archive,
)
from loraplex.registry.db import transaction
from loraplex.registry.models import VISIBILITIES, Adapter
from loraplex.registry.names import check_adapter_name
from loraplex.registry.quotas import StorageUsage
from loraplex.registry.store import (
    CONFIG_FILE,
    PICKLE_SUFFIXES,
    WEIGHTS_FILE,
    AdapterStore,
)

__all__ = [
    "AdapterUploader", "DeletedAdapter", "OnDeleted", "OnRegistered", "ProgressFn",
    "UploadLimits", "UploadResult", "UploadStaging", "ValidatedAdapter", "Validator",
    "delete_adapter", "discard_unreferenced", "reclaim_deleted", "remove_unreferenced",
    "stored_digests", "unpack_archive",
]

_CHUNK: Final = 1 << 20
_UPLOAD_PREFIX: Final = "upload-"
# The staging folder's lock keeps sweeps away while this process lives; where flock does
# not work (some network filesystems) only its age does, so a slow upload renews it.
_TOUCH_EVERY_S: Final = 60.0
_MAX_VERSION_ATTEMPTS: Final = 3
# Received bytes are cut off at what is left of the tenant's storage quota. The adapter's
# own files arrive as stored; an archive may hold a README and framing besides (tar
# headers, padding), which this allows for. The exact check is on the unpacked files.
ARCHIVE_QUOTA_SLACK_BYTES: Final = 1 << 20

ProgressFn = Callable[[int], None]  # called with the bytes received so far


class ValidatedAdapter(Protocol):
    """What the pipeline reads from the engine's validation result (``LoRAAdapter``)."""

    @property
    def digest(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def alpha(self) -> float: ...
    @property
    def use_rslora(self) -> bool: ...
    @property
    def target_modules(self) -> tuple[str, ...]: ...
    @property
    def base_model_name_or_path(self) -> str | None: ...


# ``lambda p: validate_adapter_dir(p, target, max_lora_rank)``: raises AdapterError.
Validator = Callable[[Path], ValidatedAdapter]
# Runs inside the row's transaction, after the row is flushed and before the commit.
OnRegistered = Callable[[Session, Adapter], None]


@dataclass(frozen=True)
class UploadResult:
    """The committed row (readable: sessions do not expire on commit) and whether the
    weights were new to the store (False: identical content was already stored)."""

    adapter: Adapter
    created: bool
    size_bytes: int
    # False: ``unless_current`` found the same files as the name's current version, and
    # nothing was registered (``adapter`` is that version).
    new_version: bool = True


@dataclass(frozen=True)
class DeletedAdapter:
    """A snapshot of a deleted version, safe to hand to another thread (the engine's)."""

    id: int
    tenant_id: int
    name: str
    version: int
    digest: str

    @property
    def identity(self) -> str:
        """``adapter_id@digest``: what the engine's caches and slots are keyed on."""
        return f"{self.id}@{self.digest}"

    @classmethod
    def of(cls, row: Adapter) -> DeletedAdapter:
        return cls(id=row.id, tenant_id=row.tenant_id, name=row.name, version=row.version,
                   digest=row.digest)


# The gateway wires this to the engine: drop the versions' prefix-cache entries and free
# their slots once the requests already running on them finish.
OnDeleted = Callable[[Sequence[DeletedAdapter]], None]


# --- receiving ---------------------------------------------------------------------------


def _upload_basename(filename: str) -> str:
    """The file name of a received part. Browsers send folder uploads as ``dir/name`` and
    some send Windows paths: only the last component counts, so nothing can point outside
    the staging folder."""
    base = re.split(r"[\\/]", filename.strip())[-1]
    if not base or base in (".", "..") or "\x00" in base:
        raise AdapterError(f"invalid file name {filename!r}; {HINT}")
    return base


class UploadStaging:
    """One upload's private folder under the store's ``.tmp``; removed on ``close``.

    ``write``/``write_async`` receive one file each under a running cap on the bytes of the
    whole upload (UploadTooLargeError as soon as it is passed, before the rest is read),
    and, given the tenant's ``quota``, on the bytes of its adapter files or archive
    (QuotaExceededError as soon as they pass what is left of it, plus an archive's slack).
    """

    def __init__(self, store: AdapterStore, limits: UploadLimits,
                 progress: ProgressFn | None = None,
                 quota: StorageUsage | None = None) -> None:
        self.limits = limits
        self.num_bytes = 0
        self._progress = progress
        self._quota = quota
        self._num_quota_bytes = 0  # received bytes that will be stored (README excluded)
        self._quota_cap: int | None = None  # for the file being received
        # Locked while this process lives: a sweep in any process leaves it alone.
        self._dir = store.tmp_dir(_UPLOAD_PREFIX)
        self.path = self._dir.path
        self._inbox = self.path / "in"
        self._inbox.mkdir()
        self._received: list[str] = []
        self._touched = time.monotonic()

    def __enter__(self) -> UploadStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._dir.close()

    @property
    def received(self) -> list[str]:
        """Names of the files received so far, in order."""
        return list(self._received)

    def write(self, filename: str, src: BinaryIO | IO[bytes] | Iterable[bytes]) -> int:
        """Receives one file from a binary file object or an iterable of chunks."""
        with self._open(filename) as out:
            start = self.num_bytes
            if hasattr(src, "read"):
                while chunk := src.read(_CHUNK):
                    self._put(out, chunk)
            else:
                for chunk in src:
                    self._put(out, chunk)
            return self.num_bytes - start

    async def write_async(self, filename: str, chunks: AsyncIterable[bytes]) -> int:
        """Receives one file from an async stream (a multipart part, a request body).

        Chunks are written inline: buffered writes to the page cache cost microseconds, and
        the cap must stop the stream as soon as it is passed.
        """
        with self._open(filename) as out:
            start = self.num_bytes
            async for chunk in chunks:
                self._put(out, chunk)
            return self.num_bytes - start

    @contextmanager
    def _open(self, filename: str) -> Iterator[BinaryIO]:
        base = _upload_basename(filename)
        refuse_pickle(base)
        if base not in ALLOWED_FILES and not is_archive(base):
            raise AdapterError(f"unexpected file {base!r}: {HINT}")
        if base in self._received:
            raise AdapterError(f"{base} was sent twice")
        self._received.append(base)
        left = None if self._quota is None else self._quota.bytes_left
        self._quota_cap = None if left is None or base == README_FILE else \
            left + (ARCHIVE_QUOTA_SLACK_BYTES if is_archive(base) else 0)
        with open(self._inbox / base, "xb") as out:
            yield out

    def _put(self, out: BinaryIO, chunk: bytes) -> None:
        self.num_bytes += len(chunk)
        if self.num_bytes > self.limits.max_upload_bytes:
            raise UploadTooLargeError(
                f"upload too large: more than {self.limits.max_upload_bytes} bytes",
                self.limits.max_upload_bytes)
        if self._quota_cap is not None:
            self._num_quota_bytes += len(chunk)
            if self._num_quota_bytes > self._quota_cap:
                assert self._quota is not None
                # Refused before this chunk is written; the staging folder goes on close.
                self._quota.check_bytes(self._num_quota_bytes, at_least=True)
        out.write(chunk)
        if self._progress is not None:
            self._progress(self.num_bytes)
        now = time.monotonic()
        if now - self._touched > _TOUCH_EVERY_S:
            self._dir.touch()
            self._touched = now

    def adapter_dir(self) -> Path:
        """The folder holding the received adapter: the files as sent, or an archive
        unpacked. Raises AdapterError if the upload is not one of the accepted shapes."""
        archives = [n for n in self._received if is_archive(n)]
        if archives:
            if len(self._received) > 1:
                raise AdapterError(f"send either one archive or the adapter's files, not "
                                   f"both ({', '.join(self._received)})")
            out = self.path / "adapter"
            if out.exists():  # a second commit of the same staging (a retry) unpacks afresh
                shutil.rmtree(out)
            unpack_archive(self._inbox / archives[0], out, self.limits,
                           display_name=archives[0])
            return out
        if not self._received:
            raise AdapterError(f"empty upload: {HINT}")
        require_adapter_files(self._inbox, "the upload")
        return self._inbox


# --- the pipeline ------------------------------------------------------------------------


def _stored_size(adapter_dir: Path) -> int:
    """The bytes ``put_dir`` will store from a validated folder: its two files."""
    return sum((adapter_dir / name).stat().st_size for name in (WEIGHTS_FILE, CONFIG_FILE))


def _model_key(name: str) -> str:
    # "meta-llama/Llama-3.1-8B", "/models/llama-3.1-8b/" and "Llama-3.1-8B" are one model.
    return re.split(r"[\\/]", name.strip().rstrip("/\\"))[-1].lower()


class AdapterUploader:
    """Receives, validates, stores and registers adapters; see the module docstring.

    ``validate`` is the engine's check (``validate_adapter_dir`` bound to the served
    model's shapes and max rank). ``base_model`` is recorded on each row.

    Base model names: an adapter's ``base_model_name_or_path`` is compared only when it is
    set and the server was told its own names (``base_model_names``, e.g. the served model
    name and hub id): it is accepted when its last path component matches one of them,
    case-insensitively, so hub ids and local paths of the same model agree. Names are
    unreliable (local paths, mirrors), so with no names given only the shapes are checked:
    the shapes are the real guard, they decide whether the adapter can be served at all.
    """

    def __init__(self, store: AdapterStore, validate: Validator, *, base_model: str,
                 base_model_names: Collection[str] = (),
                 reserved_names: Collection[str] = (),
                 limits: UploadLimits | None = None) -> None:
        self.store = store
        self.validate = validate
        self.base_model = base_model
        self.base_model_names = tuple(n for n in base_model_names if n.strip())
        # The names requests use for the base model: an adapter named so could never be
        # called (``model`` resolves to the base model first).
        self.reserved_names = frozenset(n.casefold() for n in reserved_names if n)
        self.limits = limits or UploadLimits()

    def check_request(self, name: str, visibility: str) -> None:
        """Refuses a bad name or visibility before any byte is received or stored (a bad
        name must not cost a 4 GB upload)."""
        self.check_field("name", name)
        self.check_field("visibility", visibility)

    def check_field(self, field: str, value: str) -> None:
        """Refuses a bad ``name`` (the served model's own name included) or
        ``visibility``."""
        if field == "name":
            check_adapter_name(value)
            if value.casefold() in self.reserved_names:
                raise InvalidRequestError(
                    f"adapter name {value!r} is the served model's name: requests naming "
                    "it would reach the base model; choose another name", param="name")
        elif value not in VISIBILITIES:
            raise InvalidRequestError(f"visibility must be one of {', '.join(VISIBILITIES)}, "
                                      f"got {value!r}", param="visibility")

    def staging(self, progress: ProgressFn | None = None,
                quota: StorageUsage | None = None) -> UploadStaging:
        """A fresh staging folder to receive one upload into (use as a context manager),
        then pass to ``commit``; ``quota`` (from ``check_quota``) cuts the upload off
        where it passes what is left of the tenant's storage quota."""
        return UploadStaging(self.store, self.limits, progress, quota)

    def check_quota(self, factory: sessionmaker[Session], tenant_id: int,
                    size_bytes: int | None = None) -> StorageUsage:
        """The tenant's storage and quotas; QuotaExceededError if one more version (of
        ``size_bytes``, or of any size) does not fit. NotFoundError for no such tenant.

        Call it before receiving a byte; ``commit`` checks again before the files are
        stored, and ``register_adapter`` under a lock before the row is written."""
        with transaction(factory) as session:
            usage = quotas.storage_usage(session, tenant_id)
        usage.check(size_bytes)
        return usage

    def upload_path(self, factory: sessionmaker[Session], *, tenant_id: int, name: str,
                    path: str | os.PathLike[str], visibility: str = "private",
                    progress: ProgressFn | None = None,
                    on_registered: OnRegistered | None = None,
                    unless_current: bool = False) -> UploadResult:
        """Uploads a local adapter folder or archive (the CLI). In a folder, pickle files
        anywhere refuse the upload; other files (tokenizer, trainer state) are ignored.
        ``unless_current``: see ``commit``."""
        self.check_request(name, visibility)
        src = Path(path)
        quota = self.check_quota(factory, tenant_id)
        with self.staging(progress, quota) as staging:
            if src.is_dir():
                pickles = sorted(str(p.relative_to(src)) for p in src.rglob("*")
                                 if p.name.lower().endswith(PICKLE_SUFFIXES))
                if pickles:
                    raise AdapterError(f"{src}: pickle files are refused (only safetensors "
                                       f"are read): {', '.join(pickles)}; save the adapter "
                                       "with safe_serialization=True")
                for base in (CONFIG_FILE, WEIGHTS_FILE, README_FILE):
                    if (src / base).is_file():
                        with open(src / base, "rb") as f:
                            staging.write(base, f)
            elif src.is_file():
                with open(src, "rb") as f:
                    staging.write(src.name, f)
            else:
                raise AdapterError(f"{src}: no such file or folder")
            return self.commit(factory, staging, tenant_id=tenant_id, name=name,
                               visibility=visibility, on_registered=on_registered,
                               unless_current=unless_current)

    def commit(self, factory: sessionmaker[Session], staging: UploadStaging, *,
               tenant_id: int, name: str, visibility: str = "private",
               on_registered: OnRegistered | None = None,
               unless_current: bool = False) -> UploadResult:
        """Unpacks, validates, stores and registers what ``staging`` received; commits.

        ``unless_current``: when the name's current version has the same digest, nothing is
        stored or registered and that version is returned (``new_version`` false): the
        idempotent registration of ``--lora-modules`` and ``/v1/load_lora_adapter``.

        Blocking (disk, torch, database): call it from a worker thread in async code.
        Raises AdapterError (UploadTooLargeError), InvalidRequestError, NotFoundError,
        ConflictError, QuotaExceededError, or whatever ``on_registered`` or the database
        raise; in every case no row is left and no stored copy this upload created.
        """
        self.check_request(name, visibility)
        adapter_dir = staging.adapter_dir()
        adapter = self._validate(adapter_dir)
        if unless_current:
            current = self._current_version(factory, tenant_id, name)
            if current is not None and current.digest == adapter.digest:
                return UploadResult(adapter=current, created=False,
                                    size_bytes=current.size_bytes, new_version=False)
        # What put_dir will store, checked before a byte of it is kept.
        self.check_quota(factory, tenant_id, _stored_size(adapter_dir))
        stored = self.store.put_dir(adapter_dir)
        try:
            if adapter.digest != stored.digest:
                # Both hash the same private staged file: a mismatch is a bug, never served.
                raise AdapterError(f"the validated digest {adapter.digest[:12]} differs from "
                                   f"the stored {stored.digest[:12]}")
            # The files are in place: only now is the row written and committed.
            for attempt in range(1, _MAX_VERSION_ATTEMPTS + 1):
                try:
                    with transaction(factory) as session:
                        row = service.register_adapter(
                            session, tenant_id=tenant_id, name=name, digest=stored.digest,
                            size_bytes=stored.size, storage_path=stored.relative_path,
                            base_model=self.base_model, rank=adapter.rank,
                            alpha=adapter.alpha, use_rslora=adapter.use_rslora,
                            target_modules=list(adapter.target_modules),
                            visibility=visibility)
                        if on_registered is not None:
                            on_registered(session, row)
                    break
                except ConflictError:
                    # Two uploads of one name took the same version number: the loser
                    # takes the next one; the files are already in place.
                    if attempt == _MAX_VERSION_ATTEMPTS:
                        raise
        except BaseException:
            if stored.created:
                discard_unreferenced(factory, self.store, stored.digest)
            raise
        # A concurrent delete or sweep may have removed the files between put_dir and our
        # commit (it saw no row yet): our row needs them, and the staged copy is still here.
        self.store.ensure(stored.digest, adapter_dir)
        return UploadResult(adapter=row, created=stored.created, size_bytes=stored.size)

    @staticmethod
    def _current_version(factory: sessionmaker[Session], tenant_id: int,
                         name: str) -> Adapter | None:
        with transaction(factory) as session:
            try:
                return service.resolve_adapter(session, tenant_id, name)
            except AdapterNotFoundError:
                return None

    def _validate(self, adapter_dir: Path) -> ValidatedAdapter:
        mismatch = self._base_model_mismatch(adapter_dir)
        try:
            adapter = self.validate(adapter_dir)
        except AdapterError as exc:
            # The engine's messages name the folder; a tenant must not see server paths.
            message = str(exc).replace(f" in {adapter_dir}", "").replace(str(adapter_dir),
                                                                          "the upload")
            if mismatch:
                message = f"{message} ({mismatch})"
            raise AdapterError(message) from exc
        if mismatch:
            raise AdapterError(f"base model mismatch: {mismatch}")
        return adapter

    def _base_model_mismatch(self, adapter_dir: Path) -> str | None:
        """Why the adapter's declared base model is not this server's, or None. A config
        that cannot be read is left to the validator, which names the problem."""
        if not self.base_model_names:
            return None
        try:
            declared = read_adapter_config(adapter_dir / CONFIG_FILE)[0].get(
                "base_model_name_or_path")
        except (OSError, AdapterError):
            return None
        if not isinstance(declared, str) or not declared.strip():
            return None
        if _model_key(declared) in {_model_key(n) for n in self.base_model_names}:
            return None
        return (f"the adapter was trained on {declared!r} (base_model_name_or_path) but this "
                f"server serves {self.base_model_names[0]!r}")


# --- deleting and collecting -------------------------------------------------------------


def discard_unreferenced(factory: sessionmaker[Session], store: AdapterStore,
                         digest: str, *, older_than_s: float | None = None,
                         wait: bool = True) -> bool:
    """Removes the stored copy of ``digest`` unless an active row needs it; True if removed.

    The registry is asked under the store's lock for ``digest``, so an upload that is
    putting the same content in place waits, then finds it gone and stores it again. A
    database failure keeps the files: an orphan copy is harmless, a missing one is not.
    """

    def referenced() -> bool:
        try:
            with transaction(factory) as session:
                return service.is_digest_referenced(session, digest)
        except Exception:
            return True

    return store.remove(digest, unless=referenced, older_than_s=older_than_s, wait=wait)


def delete_adapter(factory: sessionmaker[Session], store: AdapterStore, *, tenant_id: int,
                   name: str, version: int | None = None,
                   on_deleted: OnDeleted | None = None,
                   remove_files: bool = True) -> list[DeletedAdapter]:
    """Deletes the tenant's adapter (every version, or one) and commits.

    Once this returns, ``resolve_adapter`` no longer finds it, so no new request starts on
    it. ``on_deleted`` then tells the engine, which drops the versions' cache entries and
    slots while the requests already running on them finish from memory. Finally the
    files of digests no active row needs are removed (``remove_files``). Raises
    AdapterNotFoundError when there is no such active adapter.
    """
    with transaction(factory) as session:
        deleted = [DeletedAdapter.of(row) for row in
                   service.delete_adapter(session, tenant_id, name, version=version)]
    try:
        if on_deleted is not None:
            on_deleted(deleted)
    finally:
        if remove_files:
            digests = sorted({d.digest for d in deleted})
            for digest in digests:
                discard_unreferenced(factory, store, digest)
            reclaim_deleted(factory, store, digests)
    return deleted


def reclaim_deleted(factory: sessionmaker[Session], store: AdapterStore,
                    digests: Collection[str] | None = None) -> int:
    """Deleted versions (of ``digests``, or all) stop counting against their tenants'
    storage quotas once no copy is kept for them: their stored copy is gone, or an active
    row holds the same content. Returns how many rows were marked. A database failure
    marks nothing: the next sweep tries again."""
    try:
        with transaction(factory) as session:
            pending = quotas.unreclaimed_digests(session, digests)
        num_marked = 0
        for digest in pending:
            with transaction(factory) as session:
                if _is_stored(store, digest) and not service.is_digest_referenced(session,
                                                                                 digest):
                    continue
                num_marked += quotas.mark_reclaimed(session, digest)
    except Exception:  # counted a little longer, never freed wrongly
        return 0
    return num_marked


def _is_stored(store: AdapterStore, digest: str) -> bool:
    try:
        return store.exists(digest)
    except (AdapterError, ValueError):  # not a digest the store can hold
        return False


def stored_digests(store: AdapterStore) -> list[str]:
    """Digests with a folder in the store (complete or not), sorted."""
    return store.stored_digests()


def remove_unreferenced(factory: sessionmaker[Session], store: AdapterStore, *,
                        older_than_s: float = 3600.0) -> list[str]:
    """Removes stored copies no active row needs (deleted adapters, or a crash between
    store and commit); returns their digests. Copies younger than ``older_than_s`` stay:
    an upload in flight has stored (or found) its files but not yet committed its row."""
    return [digest for digest in stored_digests(store)
            if discard_unreferenced(factory, store, digest, older_than_s=older_than_s,
                                    wait=False)]
