"""Adapter archives: a .zip or .tar.gz of a PEFT adapter folder, unpacked safely.

Nothing is written from a member's own path: each member is checked (absolute paths, ``..``,
links, devices, counts, sizes as declared and as counted while decompressing) and only the
adapter's own files are written, flat, under their fixed names. Used by the upload pipeline
(``loraplex.registry.upload``), which also takes the limits and file names from here.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, Final

from loraplex.errors import AdapterError, ConfigError
from loraplex.registry.store import CONFIG_FILE, PICKLE_SUFFIXES, WEIGHTS_FILE

README_FILE: Final = "README.md"
ALLOWED_FILES: Final = frozenset({CONFIG_FILE, WEIGHTS_FILE, README_FILE})
ARCHIVE_SUFFIXES: Final = (".zip", ".tar.gz", ".tgz")
HINT: Final = (f"upload {CONFIG_FILE} and {WEIGHTS_FILE}, or one .zip or .tar.gz "
               "holding them")
_CHUNK: Final = 1 << 20
# Bytes of tar headers (512 per member, pax records, end blocks) on top of the members'.
_TAR_HEADER_SLACK: Final = 1 << 20
_DRIVE_RE: Final = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class UploadLimits:
    """Caps on one upload. ``max_files`` counts archive members, folders included."""

    max_upload_bytes: int = 4 << 30
    max_unpacked_bytes: int = 4 << 30
    max_files: int = 8

    def __post_init__(self) -> None:
        for field in ("max_upload_bytes", "max_unpacked_bytes", "max_files"):
            if getattr(self, field) < 1:
                raise ConfigError(f"UploadLimits.{field} must be positive, got "
                                  f"{getattr(self, field)}")


def is_archive(name: str) -> bool:
    """Whether a file name is one of the accepted archive kinds (by suffix)."""
    return name.lower().endswith(ARCHIVE_SUFFIXES)


def refuse_pickle(name: str, where: str = "") -> None:
    """Raises AdapterError naming the file if its name is a pickle format's."""
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise AdapterError(f"{where}pickle files are refused (only safetensors are read): "
                           f"{name}; save the adapter with safe_serialization=True")


def require_adapter_files(folder: Path, what: str) -> None:
    """Raises AdapterError naming the first of the adapter's two files ``folder`` lacks."""
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise AdapterError(f"missing {name} in {what} (a PEFT adapter is {CONFIG_FILE} "
                               f"+ {WEIGHTS_FILE})")


# --- archives ---------------------------------------------------------------------------


class _MemberCheck:
    """Admits archive members one at a time: what is refused is refused by name."""

    def __init__(self, archive: str, limits: UploadLimits) -> None:
        self.archive = archive
        self.limits = limits
        self.num_members = 0
        self.num_declared_bytes = 0
        self._top_dirs: set[str] = set()
        self._flat_files = False
        self._seen: set[str] = set()

    def _fail(self, message: str) -> AdapterError:
        return AdapterError(f"{self.archive}: {message}")

    def count(self, total: int) -> None:
        if total > self.limits.max_files:
            raise self._fail(f"too many files ({total} members, at most "
                             f"{self.limits.max_files})")

    def admit(self, name: str, kind: str, size: int) -> str | None:
        """``kind`` is file, dir, link or special. Returns the base name to extract to, or
        None for a member that is checked but not extracted (folders, README.md)."""
        self.num_members += 1
        self.count(self.num_members)
        if "\x00" in name:
            raise self._fail(f"member name with a NUL byte: {name!r}")
        if name.startswith(("/", "\\")) or _DRIVE_RE.match(name):
            raise self._fail(f"absolute path refused: {name!r}")
        parts = [p for p in re.split(r"[\\/]+", name) if p not in ("", ".")]
        if ".." in parts:
            raise self._fail(f"path traversal refused: {name!r}")
        if kind == "link":
            raise self._fail(f"links are refused: {name!r}")
        if kind == "special":
            raise self._fail(f"special files (devices, fifos) are refused: {name!r}")
        if not parts:  # "." or "./": the archive's own root
            return None
        if kind == "dir":
            if len(parts) > 1:
                raise self._fail(f"nested folders are refused: {name!r} ({HINT})")
            self._top_dirs.add(parts[0])
            return None
        base = parts[-1]
        refuse_pickle(base, f"{self.archive}: ")
        if len(parts) > 2:
            raise self._fail(f"nested folders are refused: {name!r} ({HINT})")
        if len(parts) == 2:
            self._top_dirs.add(parts[0])
        else:
            self._flat_files = True
        if len(self._top_dirs) > 1 or (self._top_dirs and self._flat_files):
            raise self._fail("the files must sit at the top of the archive or in one top "
                             "folder")
        if base not in ALLOWED_FILES:
            raise self._fail(f"unexpected file {name!r}: {HINT}")
        if base in self._seen:
            raise self._fail(f"{base} appears twice")
        self._seen.add(base)
        self.num_declared_bytes += size
        if self.num_declared_bytes > self.limits.max_unpacked_bytes:
            raise self.too_big()
        return None if base == README_FILE else base

    def too_big(self) -> AdapterError:
        return self._fail(f"unpacks to more than {self.limits.max_unpacked_bytes} bytes")


def _copy_capped(src: IO[bytes], dst: BinaryIO, budget: int, check: _MemberCheck) -> int:
    """Copies at most ``budget`` bytes; more means the archive lied about the size."""
    size = 0
    while chunk := src.read(min(_CHUNK, budget - size + 1)):
        size += len(chunk)
        if size > budget:
            raise check.too_big()
        dst.write(chunk)
    return size


def unpack_archive(archive: Path, dest: Path, limits: UploadLimits, *,
                   display_name: str | None = None) -> Path:
    """Extracts an adapter archive (.zip, .tar.gz, .tgz) into ``dest`` (created), flat.

    Nothing is written from a member's own path: only the adapter's two files are written,
    under their fixed names, so a hostile name can make the archive refused but never
    write outside ``dest``. Returns ``dest``. Raises AdapterError naming the problem.
    """
    name = display_name or archive.name
    check = _MemberCheck(name, limits)
    dest.mkdir(parents=True)
    lower = name.lower()
    if lower.endswith(".zip"):
        _unpack_zip(archive, dest, check)
    elif lower.endswith((".tar.gz", ".tgz")):
        _unpack_tar_gz(archive, dest, check)
    else:
        raise AdapterError(f"{name}: not a .zip or .tar.gz archive")
    require_adapter_files(dest, name)
    return dest


def _zip_declared_entries(path: Path) -> int | None:
    """The entry count of the end-of-central-directory record, read before zipfile loads
    the whole directory into memory (a 4 GB zip can declare ~90 million entries)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - (1 << 16) - 22))
        tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) < at + 12:
        return None
    return int.from_bytes(tail[at + 10:at + 12], "little")


def _zip_kind(info: zipfile.ZipInfo) -> str:
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        return "link"
    if mode and stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
        return "special"
    return "dir" if info.is_dir() else "file"


def _unpack_zip(archive: Path, dest: Path, check: _MemberCheck) -> None:
    declared = _zip_declared_entries(archive)
    if declared is not None:
        check.count(declared)  # 0xFFFF (zip64) is over any sane cap too
    try:
        with zipfile.ZipFile(archive) as zf:
            infos = zf.infolist()
            check.count(len(infos))
            wanted: list[tuple[zipfile.ZipInfo, str]] = []
            for info in infos:
                base = check.admit(info.filename, _zip_kind(info), info.file_size)
                if info.flag_bits & 0x1:
                    raise check._fail(f"encrypted members are refused: {info.filename!r}")
                if base is not None:
                    wanted.append((info, base))
            for info, base in wanted:
                budget = check.limits.max_unpacked_bytes - _dir_bytes(dest)
                with zf.open(info) as src, open(dest / base, "xb") as dst:
                    _copy_capped(src, dst, budget, check)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        # zipfile never returns more than a member's declared size and then checks the
        # CRC, so a header that lies ends here.
        raise AdapterError(f"{check.archive}: not a valid zip archive (corrupt: "
                           f"{_one_line(exc)})") from exc


def _dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


class _CappedReader(io.RawIOBase):
    """Counts the decompressed tar stream: a gzip bomb is stopped at the cap, even where
    its bytes are skipped (headers, README, members never written)."""

    def __init__(self, raw: gzip.GzipFile, cap: int, check: _MemberCheck) -> None:
        self._raw = raw
        self._cap = cap
        self._check = check
        self.num_bytes = 0

    def readable(self) -> bool:
        # io.BufferedReader (_unpack_tar_gz) asks; RawIOBase's own answer is False
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer))
        self.num_bytes += len(data)
        if self.num_bytes > self._cap:
            raise self._check.too_big()
        buffer[:len(data)] = data
        return len(data)


def _tar_kind(member: tarfile.TarInfo) -> str:
    if member.issym() or member.islnk():
        return "link"
    if member.isdir():
        return "dir"
    if member.isreg() and not member.issparse():
        return "file"
    return "special"


def _unpack_tar_gz(archive: Path, dest: Path, check: _MemberCheck) -> None:
    cap = check.limits.max_unpacked_bytes + _TAR_HEADER_SLACK
    try:
        with open(archive, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            stream = io.BufferedReader(_CappedReader(gz, cap, check), _CHUNK)
            # Stream mode ("r|"): members are met in order and never seeked back to, so
            # the archive is decompressed once, through the counting reader.
            with tarfile.open(fileobj=stream, mode="r|") as tf:
                for member in tf:
                    base = check.admit(member.name, _tar_kind(member), member.size)
                    if base is None:
                        continue
                    src = tf.extractfile(member)
                    if src is None:  # only for non-regular members, refused above
                        raise check._fail(f"cannot read member {member.name!r}")
                    budget = check.limits.max_unpacked_bytes - _dir_bytes(dest)
                    with src, open(dest / base, "xb") as dst:
                        _copy_capped(src, dst, budget, check)
    except (tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError) as exc:
        raise AdapterError(f"{check.archive}: not a valid .tar.gz archive "
                           f"({_one_line(exc)})") from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
