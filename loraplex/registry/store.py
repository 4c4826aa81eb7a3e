"""Content-addressed store of adapter files on disk.

Layout: ``<root>/<digest[:2]>/<digest>/{adapter_config.json, adapter_model.safetensors}``
where ``digest`` is the sha256 of the weights file. A folder appears under its final name
only by one ``rename`` of a complete, fsynced temporary folder, so a reader (or a crash)
never sees half an adapter. Identical weights are stored once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Final

from loraplex.errors import AdapterError, ConflictError
from loraplex.files import fsync_dir

CONFIG_FILE: Final = "adapter_config.json"
WEIGHTS_FILE: Final = "adapter_model.safetensors"
# Pickle-based formats run code when loaded; a folder holding any of them is refused whole.
PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Config keys that change what the adapter computes; two uploads of the same weights must
# agree on them, or one stored copy would serve the other's scaling.
SEMANTIC_CONFIG_KEYS: Final = ("r", "lora_alpha", "use_rslora", "target_modules",
                               "rank_pattern", "alpha_pattern", "use_dora", "fan_in_fan_out",
                               "peft_type", "bias", "modules_to_save", "layers_to_transform")
MAX_CONFIG_BYTES: Final = 1 << 20
_CHUNK: Final = 1 << 20
_DIGEST_RE: Final = re.compile(r"^[0-9a-f]{64}$")
_TMP_DIR: Final = ".tmp"
_TRASH_PREFIX: Final = "trash-"


@dataclass(frozen=True)
class StoredAdapter:
    """Where an adapter's files ended up.

    ``path`` is absolute; ``relative_path`` is what the registry records, so the store can
    be mounted at another path (a container) without rewriting rows. ``created`` is False
    when identical weights were already stored.
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


def _semantic_config(raw: bytes, origin: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{origin}: {CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise AdapterError(f"{origin}: {CONFIG_FILE} must hold a JSON object")
    out = {key: data.get(key) for key in SEMANTIC_CONFIG_KEYS}
    if isinstance(out["target_modules"], list):
        out["target_modules"] = sorted(out["target_modules"])
    return out


class AdapterStore:
    """Adapter folders under ``root``, addressed by the sha256 of their weights."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()

    def path_for(self, digest: str) -> Path:
        """The folder of ``digest`` (which may not exist)."""
        return self.root / self.relative_path_for(digest)

    @staticmethod
    def relative_path_for(digest: str) -> str:
        """``<digest[:2]>/<digest>``; refuses anything but 64 lowercase hex digits."""
        if not _DIGEST_RE.match(digest):
            raise ValueError(f"not a sha256 hex digest: {digest!r}")
        return f"{digest[:2]}/{digest}"

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

    def put_dir(self, src_dir: str | os.PathLike[str]) -> StoredAdapter:
        """Copies a PEFT adapter folder into the store, atomically.

        Only ``adapter_config.json`` and ``adapter_model.safetensors`` are copied; a folder
        holding pickle files is refused. The weights are hashed while they are copied, so
        the digest names exactly the bytes stored even if the source changes meanwhile.
        Raises AdapterError for a bad folder, ConflictError when the same weights are
        already stored with a config that computes something else (alpha, rslora...).
        """
        src = Path(src_dir)
        self._check_source(src)
        tmp_root = self.root / _TMP_DIR
        tmp_root.mkdir(parents=True, exist_ok=True)
        tmp = tmp_root / uuid.uuid4().hex
        tmp.mkdir()
        try:
            hasher = hashlib.sha256()
            try:
                with open(src / WEIGHTS_FILE, "rb") as fin, open(tmp / WEIGHTS_FILE, "xb") as fout:
                    weights_size = _copy_stream(fin, fout, hasher)
                    fout.flush()
                    os.fsync(fout.fileno())
                with open(src / CONFIG_FILE, "rb") as fin:
                    config_raw = fin.read(MAX_CONFIG_BYTES + 1)
            except FileNotFoundError as exc:
                raise AdapterError(f"{src}: {Path(exc.filename or '').name} vanished while "
                                   "it was being copied") from exc
            if len(config_raw) > MAX_CONFIG_BYTES:
                raise AdapterError(f"{src}: {CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} "
                                   "bytes")
            new_config = _semantic_config(config_raw, str(src))
            with open(tmp / CONFIG_FILE, "xb") as fout:
                fout.write(config_raw)
                fout.flush()
                os.fsync(fout.fileno())
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                os.chmod(tmp / name, 0o444)  # content-addressed files never change
            fsync_dir(tmp)

            digest = hasher.hexdigest()
            final = self.path_for(digest)
            stored = StoredAdapter(digest=digest, path=final,
                                   size=weights_size + len(config_raw),
                                   relative_path=self.relative_path_for(digest))
            if self.exists(digest):
                self._check_same_config(final, new_config, digest)
                return replace(stored, created=False)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another writer renamed the same content in first: theirs is as good.
                if not self.exists(digest):
                    raise
                self._check_same_config(final, new_config, digest)
                return replace(stored, created=False)
            fsync_dir(final.parent)
            return stored
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def remove(self, digest: str) -> bool:
        """Deletes the stored copy of ``digest``; False if there was none.

        The folder is first renamed out of its addressable name, so a concurrent reader
        sees the whole adapter or nothing. The caller checks no registry row needs it.
        """
        final = self.path_for(digest)
        if not final.exists():
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

    def sweep_tmp(self, older_than_s: float = 3600.0) -> int:
        """Removes temporary folders left by crashed writers; returns how many.

        Only folders older than ``older_than_s`` go, so uploads in progress are safe.
        """
        tmp_root = self.root / _TMP_DIR
        if not tmp_root.is_dir():
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        for entry in tmp_root.iterdir():
            try:
                if entry.stat().st_mtime < cutoff:
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

    @staticmethod
    def _check_same_config(final: Path, new_config: dict[str, Any], digest: str) -> None:
        stored_raw = (final / CONFIG_FILE).read_bytes()
        if _semantic_config(stored_raw, str(final)) != new_config:
            raise ConflictError(f"weights {digest[:12]} are already stored with a different "
                                f"{CONFIG_FILE} (rank, alpha or targets differ)")

