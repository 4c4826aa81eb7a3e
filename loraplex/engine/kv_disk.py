"""The disk tier of the prefix cache: evicted blocks in their portable form, in one
directory, LRU within a byte budget.

Files live in ``DIR/<model fingerprint, 16 hex>/<block hash, 64 hex>.kvb``: engines of
different models (or dtypes, or block sizes) can share ``DIR`` without ever seeing each
other's blocks, and each tier's budget counts only its own folder. Writes go through one
writer thread (encode, temporary name, fsync, rename), so the step loop only hands over
bytes; until a block's file is written, lookups are served from memory. Lookups verify a
file on the step loop (checksum, fingerprint, layout, hash chain, and the key the pool
asked for) and hold the verified block until the step ends, so a refused file is refused
before the scheduler counts its tokens: the request recomputes them.

Reading overlaps the steps where it can: a request that arrives while others run has its
blocks read and verified ahead (``read_ahead``, one reader thread, one task a block) while
their steps run. A lookup takes a block read ahead from memory, waits for one being read,
and reads one still queued itself (so no file is read twice). What is read ahead is
bounded (``max_staged_bytes``, the oldest dropped first) and only used while the index
still lists the block under the same key; a file the reader refused is counted and
deleted at its lookup, as if read there.

Pure Python (no torch): the model runner turns block data into tensors.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplex.engine.kv_blocks import (
    BlockIdentity,
    BlockRefused,
    KVLayout,
    PortableBlock,
    decode_block,
    encode_block,
    encoded_size,
    read_header,
    write_atomic,
)
from loraplex.engine.kv_hashing import ExtraKey

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"
_HEADER_READ = 64 * 1024
# What one step's lookups may hold in memory, verified, before they count as misses.
DEFAULT_MAX_STAGED_BYTES = 256 << 20

_Key = tuple[bytes | None, tuple[int, ...], tuple[ExtraKey, ...]]


@dataclass(frozen=True)
class DiskTierStats:
    num_blocks: int
    bytes_used: int
    max_bytes: int
    num_writes: int  # files written
    num_evictions: int  # files deleted to stay within the budget
    num_refused: int  # files refused (corrupt, truncated, another model's, bad identity)
    num_loads: int  # blocks handed to the pool
    num_read_ahead: int  # of those, read and verified off the step loop beforehand


@dataclass
class _Entry:
    key: _Key
    num_bytes: int


class DiskTier:
    """Evicted prefix-cache blocks of one model on disk (see the module docstring).

    Thread use: every public method is called from the engine's step thread; the writer
    thread only writes and deletes files. ``flush`` waits for it."""

    def __init__(self, root: str | Path, max_bytes: int, fingerprint: str, layout: KVLayout,
                 max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.dir = Path(root) / fingerprint[:16]
        self.dir.mkdir(parents=True, exist_ok=True)  # OSError: the caller says which flag
        self.fingerprint = fingerprint
        self.layout = layout
        self.max_bytes = max_bytes
        self.max_staged_bytes = max_staged_bytes
        self._lock = threading.Lock()  # guards _pending against the writer thread
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # front: evicted first
        self._pending: dict[bytes, PortableBlock] = {}  # handed over, file not yet written
        self._staged: dict[bytes, PortableBlock] = {}  # verified this step
        self._staged_bytes = 0
        self._bytes_used = 0
        self.num_writes = 0
        self.num_evictions = 0
        self.num_refused = 0
        self.num_loads = 0
        self._writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="loraplex-kv-disk")
        # Reads ahead for queued requests, by hash, oldest first (step thread only).
        self._reader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="loraplex-kv-disk-read")
        self._ahead: OrderedDict[bytes, concurrent.futures.Future[PortableBlock | Exception]] \
            = OrderedDict()
        self.num_read_ahead = 0
        self._rebuild()

    # ---- start ----------------------------------------------------------------------

    def _rebuild(self) -> None:
        """The index from the folder: leftovers of a crash (temporary files) deleted, every
        block file's header read; files another model wrote, malformed or cut short are
        refused, counted and deleted (the folder is this fingerprint's alone). Least
        recently written first."""
        found: list[tuple[float, bytes, _Entry]] = []
        for path in self.dir.iterdir():
            if path.name.endswith(_TMP_SUFFIX):
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                with open(path, "rb") as f:
                    header = read_header(f.read(_HEADER_READ))
                    size = os.fstat(f.fileno()).st_size
                    mtime = os.fstat(f.fileno()).st_mtime
                ident = header.identity
                if header.fingerprint != self.fingerprint:
                    raise BlockRefused("fingerprint", "another model's block")
                if header.layout != self.layout:
                    raise BlockRefused("layout", f"{header.layout}")
                if path.name != ident.block_hash.hex() + SUFFIX:
                    raise BlockRefused("identity", "file name is not its block hash")
                if size != header.total_bytes:
                    raise BlockRefused("truncated", f"{size} of {header.total_bytes} bytes")
            except (BlockRefused, OSError) as exc:
                self._refuse(path, exc)
                continue
            found.append((mtime, ident.block_hash,
                          _Entry(ident.key, size)))
        for _, block_hash, entry in sorted(found, key=lambda f: f[0]):
            self._index[block_hash] = entry
            self._bytes_used += entry.num_bytes
        self._evict_over_budget()

    # ---- the pool's side --------------------------------------------------------------

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def put(self, identity: BlockIdentity, data: bytes) -> None:
        """Takes an evicted block's KV (``layout.data_bytes`` bytes); its file is written
        on the writer thread. A block already here is only marked recently used."""
        block_hash = identity.block_hash
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return
        block = PortableBlock(identity, self.fingerprint, self.layout, data)
        size = encoded_size(block)
        with self._lock:
            self._pending[block_hash] = block
        self._index[block_hash] = _Entry(
            (identity.parent_hash, identity.token_ids, identity.extra_keys), size)
        self._bytes_used += size
        self._writer.submit(self._write, block_hash)
        self._evict_over_budget()

    def read_ahead(self, blocks: list[tuple[bytes, _Key]]) -> None:
        """Reads and verifies, on the reader thread, the blocks of a prefix (in order) that
        a request will look up, up to the first that is not here."""
        max_ahead = max(1, self.max_staged_bytes // self.layout.data_bytes)
        for block_hash, key in blocks:
            entry = self._index.get(block_hash)
            if entry is None or entry.key != key:
                break
            if block_hash in self._ahead or block_hash in self._staged:
                continue
            with self._lock:
                if block_hash in self._pending:  # not on disk yet: in memory anyway
                    continue
            self._ahead[block_hash] = self._reader.submit(self._read, block_hash, key)
            while len(self._ahead) > max_ahead:
                self._drop_ahead(next(iter(self._ahead)))

    def lookup(self, block_hash: bytes, key: _Key) -> bool:
        """Whether the block is here under exactly ``key``, verified (read, checksum,
        fingerprint, layout, hash chain) and held for ``take`` until ``end_step``. A file
        that fails is refused: counted, deleted, and a miss."""
        if block_hash in self._staged:
            return True
        entry = self._index.get(block_hash)
        if entry is None or entry.key != key:
            return False
        if self._staged_bytes + self.layout.data_bytes > self.max_staged_bytes:
            return False  # this step holds enough: the rest is recomputed
        with self._lock:
            block: PortableBlock | Exception | None = self._pending.get(block_hash)
        future = self._ahead.pop(block_hash, None)
        if block is None and future is not None and not future.cancel():
            ready = future.done()
            block = future.result()  # being read: as soon as reading it here
            if ready and isinstance(block, PortableBlock):
                self.num_read_ahead += 1
        if block is None:
            block = self._read(block_hash, key)
        if isinstance(block, Exception):
            self._forget(block_hash)
            self._refuse(self._path(block_hash), block)
            return False
        self._index.move_to_end(block_hash)
        self._staged[block_hash] = block
        self._staged_bytes += len(block.data)
        return True

    def take(self, block_hash: bytes) -> PortableBlock:
        """A block ``lookup`` verified this step, for the pool to load."""
        block = self._staged[block_hash]
        self.num_loads += 1
        return block

    def end_step(self) -> None:
        """Lets go of the blocks this step's lookups held."""
        self._staged.clear()
        self._staged_bytes = 0

    def drop(self, predicate: Callable[[tuple[ExtraKey, ...]], bool]) -> int:
        """Deletes every block whose extra keys match (a deleted adapter's); the files are
        gone when ``flush`` returns. Returns the number of blocks dropped."""
        matched = [h for h, e in self._index.items() if predicate(e.key[2])]
        for block_hash in matched:
            self._forget(block_hash)
            self._staged.pop(block_hash, None)
        return len(matched)

    def flush(self) -> None:
        """Waits for every file write and delete handed over so far."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)

    def stats(self) -> DiskTierStats:
        return DiskTierStats(len(self._index), self._bytes_used, self.max_bytes,
                             self.num_writes, self.num_evictions, self.num_refused,
                             self.num_loads, self.num_read_ahead)

    # ---- internals --------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _read(self, block_hash: bytes, key: _Key) -> PortableBlock | Exception:
        """The block's file, verified against its hash and ``key``, or why it is refused."""
        try:
            block = decode_block(self._path(block_hash).read_bytes(), self.fingerprint,
                                 self.layout)
            ident = block.identity
            if ident.block_hash != block_hash \
                    or ident.key != key:
                raise BlockRefused("identity", "the file holds another block")
        except (BlockRefused, OSError) as exc:
            return exc
        return block

    def _drop_ahead(self, block_hash: bytes) -> None:
        future = self._ahead.pop(block_hash, None)
        if future is not None:
            future.cancel()  # one being read finishes unread

    def _forget(self, block_hash: bytes) -> None:
        """Out of the index now; its file deleted on the writer thread, after any write
        of it handed over before."""
        entry = self._index.pop(block_hash, None)
        if entry is None:
            return
        self._bytes_used -= entry.num_bytes
        with self._lock:
            self._pending.pop(block_hash, None)
        self._drop_ahead(block_hash)
        self._writer.submit(self._path(block_hash).unlink, True)

    def _evict_over_budget(self) -> None:
        while self._bytes_used > self.max_bytes and self._index:
            block_hash = next(iter(self._index))
            self._forget(block_hash)
            self._staged.pop(block_hash, None)
            self.num_evictions += 1

    def _refuse(self, path: Path, exc: Exception) -> None:
        self.num_refused += 1
        logger.warning("KV disk tier: refused %s (%s)", path.name, exc)
        self._writer.submit(path.unlink, True)

    def _write(self, block_hash: bytes) -> None:
        with self._lock:
            block = self._pending.get(block_hash)
        if block is None:
            return  # dropped or evicted before its turn
        try:
            write_atomic(self._path(block_hash), encode_block(block))
        except OSError as exc:
            logger.warning("KV disk tier: cannot write %s: %s", block_hash.hex()[:16], exc)
        with self._lock:
            if self._pending.get(block_hash) is block:
                del self._pending[block_hash]
                self.num_writes += 1
