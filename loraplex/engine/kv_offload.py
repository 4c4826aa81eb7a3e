"""The KV that leaves the pool: the engine's glue between its block pool (``kv_cache.py``),
the model runner's KV tensors, the disk tier (``kv_disk.py``) and prefill/decode transfers
(``kv_transfer.py``). Called on the engine's step thread, at the points of a step that
``KVCacheManager``'s docstring orders: evicted blocks saved before any transfer or forward
writes their slots, disk loads written after the swap-ins and before the forward."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from loraplex.config import EngineConfig
from loraplex.engine.kv_blocks import BlockIdentity, KVLayout, model_fingerprint
from loraplex.engine.kv_cache import EvictedBlock, KVCacheManager
from loraplex.engine.kv_disk import DiskTier
from loraplex.engine.kv_hashing import ExtraKey
from loraplex.engine.kv_transfer import KVTransfer
from loraplex.errors import ConfigError


class BlockIO(Protocol):
    """What the model runner offers: blocks' K/V in the portable form's data layout."""

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]: ...

    def write_blocks(self, blocks: Sequence[tuple[int, bytes]]) -> None: ...


def kv_identity(config: EngineConfig, num_layers: int, num_kv_heads: int,
                head_dim: int) -> tuple[KVLayout, str]:
    """The pool's block layout and the model fingerprint every block outside the pool
    carries (``kv_blocks.py``)."""
    layout = KVLayout(num_layers, num_kv_heads, head_dim, config.cache.block_size,
                      config.model.dtype)
    return layout, model_fingerprint(config.model.model, layout)


def make_disk_tier(config: EngineConfig,
                   identity: Callable[[], tuple[KVLayout, str]]) -> DiskTier | None:
    """The prefix cache's disk tier, when ``kv_disk_dir`` asks for one (ConfigError in one
    line when the folder cannot be used)."""
    cache = config.cache
    if cache.kv_disk_dir is None:
        return None
    layout, fingerprint = identity()
    try:
        return DiskTier(cache.kv_disk_dir, int(cache.kv_disk_gib * 2**30), fingerprint, layout)
    except OSError as exc:
        raise ConfigError(f"--kv-disk-dir {cache.kv_disk_dir}: cannot use it as a "
                          f"folder ({exc.strerror or exc})") from None


class KVOffload:
    def __init__(self, kv: KVCacheManager, io: BlockIO, disk: DiskTier | None,
                 identity: Callable[[], tuple[KVLayout, str]]) -> None:
        self.kv = kv
        self.io = io
        self.disk = disk
        self._identity = identity

    @functools.cached_property
    def transfer(self) -> KVTransfer:
        """This engine's side of prefill/decode transfers (made on first use: the
        fingerprint reads the weights' files, once per engine)."""
        return KVTransfer(self.kv, *self._identity())

    def save_evicted(self) -> None:
        """Hands the KV of the blocks the step's allocations evicted to the disk tier."""
        if self.disk is not None:
            self._save(self.kv.take_evictions())

    def save_cached(self) -> None:
        """Hands every block of the prefix cache to the disk tier (a clean stop)."""
        if self.disk is not None:
            self._save(self.kv.cached_blocks())

    def _save(self, blocks: list[EvictedBlock]) -> None:
        disk = self.disk
        assert disk is not None
        blocks = [b for b in blocks if not disk.has(b.block_hash)]
        for start in range(0, len(blocks), 64):  # bounded memory for the copies
            batch = blocks[start:start + 64]
            for b, data in zip(batch, self.io.read_blocks([b.block_id for b in batch]),
                               strict=True):
                disk.put(BlockIdentity(b.block_hash, b.parent_hash, b.token_ids,
                                       b.extra_keys), data)

    def load_pending(self) -> None:
        """Writes the KV of the disk blocks the step's prefixes claimed into their fresh
        slots, and ends the tier's step."""
        if self.disk is None:
            return
        loads = self.kv.take_pending_loads()
        self.io.write_blocks([(block_id, self.disk.take(block_hash).data)
                              for block_id, block_hash in loads])
        self.disk.end_step()

    def read_ahead(self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...]) -> None:
        """Starts reading the prompt's disk blocks (a request that will wait a step)."""
        if self.disk is not None:
            self.disk.read_ahead(self.kv.uncached_chain(token_ids, extra_keys))

    def export_prompt(self, token_ids: Sequence[int],
                      extra_keys: tuple[ExtraKey, ...]) -> list[bytes]:
        return self.transfer.export_prompt(token_ids, extra_keys, self.io.read_blocks)

    def import_prompt(self, raws: Sequence[bytes], token_ids: Sequence[int],
                      extra_keys: tuple[ExtraKey, ...]) -> int:
        """Places the usable leading blocks; how many were usable."""
        blocks = self.transfer.verified(raws, token_ids, extra_keys)
        writes = self.transfer.place(blocks)
        self.save_evicted()  # the slots they took may have held a block for the disk
        self.io.write_blocks(writes)
        return len(blocks)

    def close(self, save_cache: bool) -> None:
        if self.disk is not None:
            if save_cache:
                self.save_cached()
            self.disk.close()

    def stats(self) -> dict[str, Any]:
        """The ``EngineStats`` fields of the disk tier and the transfers (none: zeros)."""
        out: dict[str, Any] = {}
        if self.disk is not None:
            d = self.disk.stats()
            out |= {"kv_disk_max_bytes": d.max_bytes, "kv_disk_blocks": d.num_blocks,
                    "kv_disk_bytes_used": d.bytes_used, "kv_disk_writes": d.num_writes,
                    "kv_disk_evictions": d.num_evictions, "kv_disk_refused": d.num_refused,
                    "kv_disk_read_ahead": d.num_read_ahead}
        if "transfer" in self.__dict__:  # made by a first transfer
            t = self.transfer.stats()
            out |= {"kv_transfer_exported": t.num_exported,
                    "kv_transfer_imported": t.num_imported,
                    "kv_transfer_refused": t.num_refused}
        return out
