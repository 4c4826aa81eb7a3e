"""A KV block's portable form: one full block of the prefix cache outside its pool.

Every tier a block can go to (the disk tier today; another replica later) stores and
reads this format and nothing else. It carries the block's whole identity, so a block is
only ever used where that identity is asked for:

- the identity key: the chained block hash, the parent hash and token ids it was made
  from, and the extra keys (``("adapter", id, digest)``, ``("salt", value)``: the salt the
  engine already has, a value derived by the gateway, never the gateway's secret);
- the model fingerprint (changes with the model's config and weights, the dtype and the
  KV layout) and the layout itself (dtype, layers, KV heads, head dim, block size);
- the K/V data of every layer of the target model;
- a sha256 over all of the above.

Byte layout (integers little-endian)::

    0        8   magic  b"LPXKVB01"
    8        4   H: length of the header
    12       H   header: UTF-8 JSON, sorted keys (block_hash, parent_hash, token_ids,
                 extra_keys, fingerprint, layout, data_len)
    12+H     N   data: [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim] in the
                 layout's dtype, C order, little-endian (N = data_len)
    12+H+N   32  sha256 of bytes [0, 12+H+N)

``decode_block`` refuses (``BlockRefused``, with a reason a stat can count) anything whose
magic, lengths, checksum, fingerprint, layout or hash chain does not match. Pure Python:
the model runner turns the data into tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from loraplex.engine.kv_hashing import BlockKey, ExtraKey, hash_block

MAGIC = b"LPXKVB01"
# Bumped whenever what the runner stores in a block changes (head order, rotary layout):
# part of every fingerprint, so blocks of an older layout are refused, never misread.
KV_LAYOUT_VERSION = 1
_PREAMBLE = struct.Struct("<8sI")
_CHECKSUM_BYTES = 32
_MAX_HEADER_BYTES = 1 << 24
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class BlockRefused(Exception):
    """A block that must not be used; ``reason`` is one of ``REFUSAL_REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


REFUSAL_REASONS = ("malformed", "truncated", "checksum", "fingerprint", "layout", "identity")


@dataclass(frozen=True)
class KVLayout:
    """How a block's K/V data is laid out: the pool's shape per block and its dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")

    @property
    def data_bytes(self) -> int:
        """Bytes of one block's K and V over every layer."""
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * _DTYPE_BYTES[self.dtype])


@dataclass(frozen=True)
class BlockIdentity:
    """What a block's KV stands for: the prefix-cache key the pool verifies on every hit."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...]

    @property
    def key(self) -> BlockKey:
        """What the pool compares on every hit: (parent hash, token ids, extra keys)."""
        return self.parent_hash, self.token_ids, self.extra_keys

    def is_consistent(self) -> bool:
        """Whether the hash is the one its parent, tokens and extra keys make."""
        return hash_block(self.parent_hash, self.token_ids, self.extra_keys) == self.block_hash


@dataclass(frozen=True)
class PortableBlock:
    identity: BlockIdentity
    fingerprint: str  # hex, see model_fingerprint
    layout: KVLayout
    data: bytes  # [num_layers, 2, block_size, num_kv_heads, head_dim], layout.dtype


def _header(block: PortableBlock) -> bytes:
    ident = block.identity
    return json.dumps({
        "block_hash": ident.block_hash.hex(),
        "parent_hash": None if ident.parent_hash is None else ident.parent_hash.hex(),
        "token_ids": list(ident.token_ids),
        "extra_keys": [list(k) for k in ident.extra_keys],
        "fingerprint": block.fingerprint,
        "layout": asdict(block.layout),
        "data_len": len(block.data),
    }, sort_keys=True, separators=(",", ":")).encode("utf-8")


def encoded_size(block: PortableBlock) -> int:
    """The length of ``encode_block(block)``, without hashing the data."""
    return _PREAMBLE.size + len(_header(block)) + len(block.data) + _CHECKSUM_BYTES


def encode_block(block: PortableBlock) -> bytes:
    """The block's bytes in the portable format (checksum included)."""
    if len(block.data) != block.layout.data_bytes:
        raise ValueError(f"block data is {len(block.data)} bytes, its layout needs "
                         f"{block.layout.data_bytes}")
    header = _header(block)
    body = _PREAMBLE.pack(MAGIC, len(header)) + header + block.data
    return body + hashlib.sha256(body).digest()


@dataclass(frozen=True)
class BlockHeader:
    """A block file's header alone: enough to index it without reading its data."""

    identity: BlockIdentity
    fingerprint: str
    layout: KVLayout
    data_len: int
    header_end: int  # where the data starts

    @property
    def total_bytes(self) -> int:
        return self.header_end + self.data_len + _CHECKSUM_BYTES


def read_header(prefix: bytes) -> BlockHeader:
    """Parses the header at the start of a block's bytes (``prefix`` may stop anywhere
    after it). Checks structure only: the checksum needs the whole block."""
    if len(prefix) < _PREAMBLE.size:
        raise BlockRefused("truncated", f"{len(prefix)} bytes, not even a preamble")
    magic, header_len = _PREAMBLE.unpack_from(prefix)
    if magic != MAGIC:
        raise BlockRefused("malformed", f"bad magic {magic!r}")
    if header_len > _MAX_HEADER_BYTES:
        raise BlockRefused("malformed", f"header of {header_len} bytes")
    end = _PREAMBLE.size + header_len
    if len(prefix) < end:
        raise BlockRefused("truncated", "the header is cut short")
    try:
        h = json.loads(prefix[_PREAMBLE.size:end].decode("utf-8"))
        identity = BlockIdentity(
            block_hash=bytes.fromhex(h["block_hash"]),
            parent_hash=None if h["parent_hash"] is None else bytes.fromhex(h["parent_hash"]),
            token_ids=tuple(int(t) for t in h["token_ids"]),
            extra_keys=tuple(tuple(str(p) for p in k) for k in h["extra_keys"]),
        )
        layout = KVLayout(**h["layout"])
        fingerprint = str(h["fingerprint"])
        data_len = int(h["data_len"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise BlockRefused("malformed", f"unreadable header: {exc}") from None
    return BlockHeader(identity, fingerprint, layout, data_len, end)


def decode_block(raw: bytes, fingerprint: str, layout: KVLayout) -> PortableBlock:
    """The block in ``raw``, or BlockRefused when it is not one this model may use: bad
    structure, a short read, a checksum, fingerprint or layout mismatch, or a hash that its
    own parent, tokens and extra keys do not make."""
    header = read_header(raw)
    total = header.total_bytes
    if len(raw) < total:
        raise BlockRefused("truncated", f"{len(raw)} of {total} bytes")
    if len(raw) > total:
        raise BlockRefused("malformed", f"{len(raw) - total} trailing bytes")
    body_end = total - _CHECKSUM_BYTES
    if hashlib.sha256(raw[:body_end]).digest() != raw[body_end:]:
        raise BlockRefused("checksum", "sha256 does not match")
    if header.fingerprint != fingerprint:
        raise BlockRefused("fingerprint", f"block of model {header.fingerprint[:12]}, "
                                          f"this is {fingerprint[:12]}")
    if header.layout != layout or header.data_len != layout.data_bytes:
        raise BlockRefused("layout", f"{header.layout} is not {layout}")
    if not header.identity.is_consistent():
        raise BlockRefused("identity", "the block hash does not match its key")
    return PortableBlock(header.identity, header.fingerprint, header.layout,
                         raw[body_end - header.data_len:body_end])


def model_fingerprint(model_dir: str | Path, layout: KVLayout) -> str:
    """A hex digest that changes with the model's config, its weights, the dtype and the KV
    layout: blocks are only exchanged between engines that agree on it.

    Weights are fingerprinted by every safetensors file's name, size, header (names,
    shapes, dtypes) and 64 KiB read at 8 evenly spaced offsets, so two checkpoints of one
    architecture (a fine-tune) differ without reading gigabytes at start."""
    digest = hashlib.sha256(b"loraplex.kv.model.v1")
    digest.update(json.dumps({"layout": asdict(layout), "kv_layout_version": KV_LAYOUT_VERSION},
                             sort_keys=True).encode())
    root = Path(model_dir)
    for name in ("config.json",):
        path = root / name
        digest.update(name.encode() + b"\x00")
        digest.update(path.read_bytes() if path.is_file() else b"<none>")
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(path.name.encode() + b"\x00" + struct.pack("<Q", size))
        with open(path, "rb") as f:
            head = f.read(8)
            digest.update(head)
            if len(head) == 8:
                digest.update(f.read(min(struct.unpack("<Q", head)[0], _MAX_HEADER_BYTES)))
            for i in range(8):
                f.seek(size * i // 8)
                digest.update(f.read(64 * 1024))
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that a crash leaves either nothing or the whole file:
    a temporary name in the same directory, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
