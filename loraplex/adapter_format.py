"""What an adapter folder is, for every layer that reads one: its two file names, the one
parser of ``adapter_config.json``, and the adapter's content digest.

Torch-free and importing only ``loraplex.errors``, so the registry (which stores adapters)
and the model loader (which serves them) agree on identity without importing each other.

Content digest (the ``digest`` of ``adapter_id@digest``)::

    digest = sha256( b"loraplex-adapter-v1\\0"
                     || sha256(adapter_model.safetensors bytes)   # 32 raw bytes
                     || sha256(adapter_config.json bytes) )       # 32 raw bytes

as 64 lowercase hex digits. Both files are hashed exactly as stored (no JSON
canonicalisation), so two adapters share a digest only when both files are byte-identical;
the two inner digests have a fixed length, so the framing is unambiguous, and the domain
tag keeps the digest from ever equalling a plain file hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Final

from loraplex.errors import AdapterError

CONFIG_FILE: Final = "adapter_config.json"
WEIGHTS_FILE: Final = "adapter_model.safetensors"
MAX_CONFIG_BYTES: Final = 1 << 20
# PEFT configs nest three or four levels (loftq_config, runtime_config); anything deeper is
# no config, and a bound keeps every later walk over the value (repr, ==, json.dumps) far
# from the interpreter's recursion limit.
MAX_CONFIG_DEPTH: Final = 32
# Nothing in a PEFT config counts past 64 bits; a longer integer literal would only
# overflow float conversions later (math.isfinite(10**400) raises OverflowError).
MAX_INT_DIGITS: Final = 19
DIGEST_DOMAIN: Final = b"loraplex-adapter-v1\x00"
_CHUNK: Final = 1 << 20


def combine_digests(weights_sha256: bytes, config_sha256: bytes) -> str:
    """The content digest from the raw sha256 digests of the weights and config files."""
    if len(weights_sha256) != 32 or len(config_sha256) != 32:
        raise ValueError("combine_digests takes two raw 32-byte sha256 digests")
    return hashlib.sha256(DIGEST_DOMAIN + weights_sha256 + config_sha256).hexdigest()


def stored_folder(digest: str) -> str:
    """Where the content-addressed store keeps the adapter of ``digest``, relative to its
    root: ``<digest[:2]>/<digest>``. Every process resolving by digest (the registry, an
    engine replica on another host) uses this one layout. ValueError for anything but 64
    lowercase hex digits, so no request text ever becomes a path."""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"not a sha256 hex digest: {digest!r}")
    return f"{digest[:2]}/{digest}"


def file_sha256(path: str | os.PathLike[str]) -> bytes:
    """The raw sha256 digest of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.digest()


def folder_digest(path: str | os.PathLike[str]) -> str:
    """The content digest of the adapter folder ``path`` (see the module docstring)."""
    folder = Path(path)
    return combine_digests(file_sha256(folder / WEIGHTS_FILE), file_sha256(folder / CONFIG_FILE))


def _no_constant(name: str) -> Any:
    raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {name} is not a JSON number")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise AdapterError(f"{CONFIG_FILE}: the number {text[:24]}... is too large")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise AdapterError(f"{CONFIG_FILE}: the number {text[:24]} is out of range")
    return value


def _depth(value: Any) -> int:
    # Iterative: the point is to bound nesting before anything recurses over it.
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_CONFIG_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in
                         (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_adapter_config(raw: bytes) -> dict[str, Any]:
    """Parses the bytes of an ``adapter_config.json``: a JSON object, UTF-8, at most
    ``MAX_CONFIG_BYTES``, nested at most ``MAX_CONFIG_DEPTH`` deep, integers of at most
    ``MAX_INT_DIGITS`` digits, finite numbers only (no NaN/Infinity).

    Raises AdapterError naming the problem for any other input; never anything else.
    """
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AdapterError(f"{CONFIG_FILE} is not UTF-8: {exc.reason} at byte "
                           f"{exc.start}") from None
    try:
        data = json.loads(text, parse_int=_bounded_int, parse_float=_finite_float,
                          parse_constant=_no_constant)
    except RecursionError:
        raise AdapterError(f"{CONFIG_FILE} is nested too deeply (at most "
                           f"{MAX_CONFIG_DEPTH} levels)") from None
    except ValueError as exc:  # JSONDecodeError, and int()'s digit limit
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: "
                           f"{' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object, got "
                           f"{type(data).__name__}")
    if _depth(data) > MAX_CONFIG_DEPTH:
        raise AdapterError(f"{CONFIG_FILE} is nested too deeply (at most "
                           f"{MAX_CONFIG_DEPTH} levels)")
    return data


def read_adapter_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], bytes]:
    """Reads and parses a config file (capped read); returns the value and the raw bytes,
    so a caller can hash exactly the bytes it parsed."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise AdapterError(f"missing {CONFIG_FILE}") from None
    return parse_adapter_config(raw), raw
