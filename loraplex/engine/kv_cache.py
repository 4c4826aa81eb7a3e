"""Paged KV block manager: block pool, per-request block tables, prefix cache, swap space.

Pure Python (no torch): the model runner owns the KV tensors and applies the block copies
this module asks for. Every physical block is in exactly one place at any time:

- pure free: no content anyone can reuse (``_free_ids``);
- used: ref count > 0, held by the block tables of live requests;
- cached free: ref count 0 but registered in the prefix cache, waiting in an LRU queue
  (``_cached_free_ids``) from which it is either reclaimed by a prefix hit or evicted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.engine.kv_hashing import (
    BlockKey,
    ExtraKey,
    hash_block,
    normalize_extra_keys,
    prefix_chain,
)

RegisteredBlock = tuple[bytes, bytes | None, tuple[ExtraKey, ...]]
"""(block hash, parent hash, extra keys) of one block in the prefix cache."""


class CacheEvents(Protocol):
    """Told of every block the prefix cache registers or drops (``kv_events.KVEventLog``)."""

    def stored(self, block_hash: bytes, parent: bytes | None,
               extra_keys: tuple[ExtraKey, ...]) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...


@dataclass(frozen=True)
class CachedPrefix:
    """Full cached blocks that already hold a prompt's first ``num_tokens`` tokens: pool
    blocks, then (with a lower tier) blocks found there, loaded into fresh pool blocks when
    ``allocate_slots`` claims the prefix."""

    block_ids: tuple[int, ...]
    num_tokens: int  # (len(block_ids) + len(lower_hashes)) * block_size
    lower_hashes: tuple[bytes, ...] = ()  # the chained hashes of the lower tier's blocks


class LowerTier(Protocol):
    """Where evicted prefix-cache blocks may still be found (the disk tier)."""

    def lookup(self, block_hash: bytes,
               key: tuple[bytes | None, tuple[int, ...], tuple[ExtraKey, ...]]) -> bool:
        """Whether the block is there under exactly this key (parent hash, token ids,
        extra keys), verified and held ready to load until the step ends."""
        ...


@dataclass(frozen=True)
class EvictedBlock:
    """A hashed block whose slot was just reused: its KV is still in the pool until the
    step's transfers and forward, and may be saved to the lower tier before them."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...]


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the block pool.

    ``num_blocks_total == num_blocks_used + num_blocks_free + num_blocks_cached_free``:
    used blocks have ref count > 0; free blocks hold nothing reusable; cached-free blocks
    have ref count 0 but still serve prefix hits until evicted. Allocatable blocks are
    ``num_blocks_free + num_blocks_cached_free`` (see ``KVCacheManager.num_free_blocks``).
    ``kv_utilization`` is tokens stored / token slots held, summed over live requests
    (0.0 when none): 1 minus the internal fragmentation of their last blocks.
    """

    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached_free: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    kv_utilization: float
    num_host_blocks_total: int
    num_host_blocks_used: int
    lower_tier_hit_tokens: int = 0  # prefix tokens loaded from the lower tier

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens (0.0 before any query)."""
        if self.prefix_cache_queried_tokens == 0:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens


# A table entry whose block was released behind the request's sliding window.
RELEASED = -1


def _num_held(block_ids: Sequence[int]) -> int:
    # released entries lead the table (check_invariants): count only those, so a table
    # with none (every model without a sliding window) costs O(1), as len() did
    for index, block_id in enumerate(block_ids):
        if block_id != RELEASED:
            return len(block_ids) - index
    return 0


@dataclass
class _RequestBlocks:
    block_ids: list[int]
    num_tokens: int
    extra_keys: tuple[ExtraKey, ...]
    # chained hashes of the request's leading full blocks (whether or not registered)
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class _SwappedRequest:
    host_block_ids: list[int]
    num_tokens: int
    extra_keys: tuple[ExtraKey, ...]
    block_hashes: list[bytes]


class KVCacheManager:
    """Allocates KV blocks to requests; shares them through forks and the prefix cache.

    Block transfers are returned to the caller, who must apply them to the KV tensors
    before the next forward, in this order: swap-outs (device → host), then
    ``take_pending_copies()`` (device → device, in list order), then swap-ins
    (host → device). A block released during a step may be handed out again in the same
    step; that order makes every read happen before the block is overwritten.

    Blocks are registered in the prefix cache when ``allocate_slots`` makes them full,
    i.e. before the forward that computes them (a hit in the same step is fine: KV is
    written before attention reads it). So a request given slots in a step must not be
    freed or swapped out before that step's forward; aborts and preemptions of requests
    not scheduled in the step are fine.

    With a ``sliding_window`` (a model whose every layer attends to at most that many
    positions), the blocks of a request that lie wholly before the window of its next
    query are released as its computed tokens advance: a long request holds about
    ``window / block_size + 1`` blocks plus its current chunk's. A released block stays
    in the table as ``RELEASED`` (``block_table`` shows block 0 there; the attention
    kernels never read before a window) and, when hashed, stays in the prefix cache.

    With a ``lower_tier`` (the disk tier), a hashed ref-0 block evicted from the cached
    queue is reported by ``take_evictions`` (its slot still holds its KV until the step's
    transfers), and a prefix that misses the pool continues into the lower tier: those
    blocks get fresh pool blocks, registered at once, whose KV ``take_pending_loads`` asks
    the caller to write. The whole order of a step's block movement is then: read the
    evictions' KV, swap-outs, copies, swap-ins, pending loads, forward (reads before any
    write; a loaded block may reuse an evicted slot). A block with a pending load that is
    taken again in the same step (only possible behind a sliding window) loses its load
    and is neither reported evicted.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        sliding_window: int = 0,
        lower_tier: LowerTier | None = None,
        events: CacheEvents | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks

        self._ref_counts = [0] * num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))
        # front = least recently used = evicted first
        self._cached_free_ids: OrderedDict[int, None] = OrderedDict()
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}

        self._requests: dict[str, _RequestBlocks] = {}
        self._swapped: dict[str, _SwappedRequest] = {}
        self._free_host_ids: deque[int] = deque(range(num_host_blocks))
        self._pending_copies: list[tuple[int, int]] = []
        self.lower_tier = lower_tier if enable_prefix_caching else None
        self._evictions: list[EvictedBlock] = []
        self._pending_loads: dict[int, bytes] = {}  # block id -> hash whose KV is due
        self._num_lower_hit_tokens = 0
        self.events = events  # what routers follow: every block registered or dropped

        # running sums over live requests, so stats() is O(1)
        self._num_live_tokens = 0
        self._num_live_blocks = 0

        self._num_queried_tokens = 0
        self._num_hit_tokens = 0
        self._num_preemptions = 0

    # ---- queries -------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        """Allocatable blocks: pure free plus cached with ref count 0."""
        return len(self._free_ids) + len(self._cached_free_ids)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens could fit the whole pool at all."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def has_request(self, request_id: str) -> bool:
        """Whether the request holds device blocks (live) or host blocks (swapped)."""
        return request_id in self._requests or request_id in self._swapped

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def num_blocks_held(self, request_id: str) -> int:
        """Device blocks the request holds (0 when it holds none): its table's, less
        those released behind its sliding window."""
        request = self._requests.get(request_id)
        return 0 if request is None else _num_held(request.block_ids)

    def blocks_held_after(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """The blocks a request holds once ``allocate_slots`` gave it these counts."""
        end = num_computed_tokens + num_new_tokens
        return self.blocks_for(end) - min(self.blocks_for(end),
                                          self._num_behind_window(num_computed_tokens))

    def block_table(self, request_id: str) -> list[int]:
        """The request's device block ids, in token order (a copy); block 0 stands where
        a block behind its sliding window was released."""
        block_ids = self._live(request_id).block_ids
        if not block_ids or block_ids[0] != RELEASED:
            return list(block_ids)
        return [0 if b == RELEASED else b for b in block_ids]

    def num_tokens(self, request_id: str) -> int:
        """Token positions the request's blocks hold (from its last ``allocate_slots``)."""
        if request_id in self._swapped:
            return self._swapped[request_id].num_tokens
        return self._live(request_id).num_tokens

    def get_computed_blocks(
        self, token_ids: Sequence[int], extra_keys: Sequence[Sequence[str]] = ()
    ) -> CachedPrefix:
        """The longest run of cached full blocks holding a prefix of ``token_ids``.

        Each hit is verified by comparing the stored token ids, parent hash and extra keys.
        Never covers the last token (at most ``len(token_ids) - 1`` tokens, rounded down to
        full blocks), so at least one token is always computed. Changes nothing: stats
        are counted when ``allocate_slots`` claims the prefix.
        """
        if not self.enable_prefix_caching:
            return CachedPrefix((), 0)
        block_ids: list[int] = []
        lower: list[bytes] = []
        for block_hash, key in self._prefix_chain(token_ids, extra_keys):
            if not lower:
                block_id = self._hash_to_block.get(block_hash)
                if block_id is not None and self._block_keys[block_id] == key:
                    block_ids.append(block_id)
                    continue
            # past the pool's run, only the lower tier (its blocks need fresh slots)
            if self.lower_tier is None or block_hash in self._hash_to_block \
                    or not self.lower_tier.lookup(block_hash, key):
                break
            lower.append(block_hash)
        return CachedPrefix(tuple(block_ids), (len(block_ids) + len(lower)) * self.block_size,
                            tuple(lower))

    def cached_run(self, token_ids: Sequence[int],
                   extra_keys: Sequence[Sequence[str]] = ()) -> list[tuple[int, bytes]]:
        """``(block id, block hash)`` of the pool's cached blocks that hold the longest
        prefix of ``token_ids`` under ``extra_keys``, verified as ``get_computed_blocks``
        verifies them, never covering the last token. Changes nothing."""
        run: list[tuple[int, bytes]] = []
        for block_hash, key in self._prefix_chain(token_ids, extra_keys):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None or self._block_keys[block_id] != key:
                break
            run.append((block_id, block_hash))
        return run

    def uncached_chain(self, token_ids: Sequence[int],
                       extra_keys: Sequence[Sequence[str]] = ()) -> list[tuple[bytes, BlockKey]]:
        """``(hash, key)`` of the prompt's full blocks past the pool's cached run (those a
        lower tier may hold), never covering the last token."""
        chain = self._prefix_chain(token_ids, extra_keys)
        for block_hash, key in chain:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None or self._block_keys[block_id] != key:
                return [(block_hash, key), *chain]
        return []

    def _prefix_chain(self, token_ids: Sequence[int], extra_keys: Sequence[Sequence[str]],
                      ) -> Iterator[tuple[bytes, BlockKey]]:
        if not self.enable_prefix_caching:
            return iter(())
        return prefix_chain(token_ids, self.block_size, normalize_extra_keys(extra_keys))

    def block_key(self, block_id: int) -> BlockKey:
        """The key a cached block is registered under: (parent hash, token ids, extra keys)."""
        key = self._block_keys[block_id]
        if key is None:
            raise KeyError(f"block {block_id} is not in the prefix cache")
        return key

    def import_cached(self, blocks: Sequence[tuple[bytes, BlockKey]]) -> list[tuple[int, int]]:
        """Registers a chain of blocks computed elsewhere (``(hash, key)`` in prefix
        order, each verified by the caller) as cached blocks of ref count 0, the first the
        most recently used: ``(block id, index)`` of those that took a slot, whose KV the
        caller must write before the next forward (after saving ``take_evictions``').
        Blocks already cached are kept; the chain stops where the pool has no block to
        give (only ref-0 blocks are taken, so no request is ever preempted for it)."""
        if not self.enable_prefix_caching:
            return []
        placed: list[tuple[int, int]] = []
        for index, (block_hash, key) in enumerate(blocks):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is not None:
                if self._block_keys[block_id] != key:
                    break
                continue
            if self.num_free_blocks() == 0:
                break
            block_id = self._take_free_block()
            self._register(block_id, block_hash, key)
            placed.append((block_id, index))
        self._release([block_id for block_id, _ in placed])
        return placed

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        extra_keys: Sequence[Sequence[str]] = (),
        cached: CachedPrefix | None = None,
    ) -> list[int] | None:
        """Grows the request's block table to cover ``num_computed + num_new`` positions.

        ``token_ids`` are all tokens known for the request (prompt + generated so far).
        On the first call for a request, ``cached`` (fresh from ``get_computed_blocks``)
        is claimed and prefix-cache stats are counted; ``num_computed_tokens`` must then
        be at least ``cached.num_tokens``. A write into a block shared with a fork copies
        it first (see ``take_pending_copies``). Blocks that become full are hashed and
        registered in the prefix cache.

        Returns the newly allocated block ids (copies included), or None when there are not
        enough free blocks, in which case nothing changed.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got {num_computed_tokens=}, {num_new_tokens=}"
            )
        if request_id in self._swapped:
            raise ValueError(f"request {request_id!r} is swapped out; swap it in first")
        keys = normalize_extra_keys(extra_keys)
        request = self._requests.get(request_id)
        is_first_call = request is None
        claimed_ids: tuple[int, ...] = ()
        claimed_hashes: list[bytes] = []
        num_lower = 0
        if request is None:
            if cached is not None and cached.num_tokens:
                claimed_hashes = self._verify_cached(token_ids, keys, cached)
                num_lower = len(cached.lower_hashes)
                if num_computed_tokens < cached.num_tokens:
                    raise ValueError(
                        f"num_computed_tokens={num_computed_tokens} is below the cached "
                        f"prefix ({cached.num_tokens} tokens)"
                    )
                claimed_ids = cached.block_ids
            current_ids: list[int] = list(claimed_ids)
        else:
            if cached is not None and cached.num_tokens:
                raise ValueError(
                    f"request {request_id!r} already has blocks; cached is "
                    "only accepted on the first call"
                )
            if keys and keys != request.extra_keys:
                raise ValueError(
                    f"extra keys of request {request_id!r} changed: "
                    f"{request.extra_keys!r} -> {keys!r}"
                )
            current_ids = request.block_ids

        end = num_computed_tokens + num_new_tokens
        if num_computed_tokens > (len(current_ids) + num_lower) * self.block_size:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} exceeds the "
                f"{len(current_ids)} blocks request {request_id!r} holds"
            )
        num_new_blocks = max(0, self.blocks_for(end) - len(current_ids))
        cow_indices: list[int] = []
        if num_new_tokens > 0:
            first = num_computed_tokens // self.block_size
            last = min(len(current_ids), self.blocks_for(end))
            cow_indices = [i for i in range(first, last) if self._ref_counts[current_ids[i]] > 1]
        # claimed ref-0 blocks leave the allocatable pool too
        num_claimed_idle = sum(1 for b in claimed_ids if self._ref_counts[b] == 0)
        if num_new_blocks + len(cow_indices) + num_claimed_idle > self.num_free_blocks():
            return None

        # ---- from here on, nothing can fail ----
        if request is None:
            for block_id in claimed_ids:
                self._incref(block_id)
            # the lower tier's blocks: fresh slots, registered now, their KV loaded
            # before the forward (take_pending_loads)
            parent = claimed_hashes[len(claimed_ids) - 1] if claimed_ids else None
            for index in range(len(claimed_ids), len(claimed_ids) + num_lower):
                block_hash = claimed_hashes[index]
                block_id = self._take_free_block()
                current_ids.append(block_id)
                start = index * self.block_size
                self._register(block_id, block_hash,
                               (parent, tuple(token_ids[start:start + self.block_size]), keys))
                self._pending_loads[block_id] = block_hash
                parent = block_hash
            request = _RequestBlocks(
                block_ids=current_ids,
                num_tokens=0,
                extra_keys=keys,
                block_hashes=claimed_hashes,
            )
            self._requests[request_id] = request
            if self.enable_prefix_caching:
                self._num_queried_tokens += len(token_ids)
                self._num_hit_tokens += len(claimed_ids) * self.block_size
                self._num_lower_hit_tokens += num_lower * self.block_size

        new_ids: list[int] = []
        for index in cow_indices:
            src = request.block_ids[index]
            dst = self._take_free_block()
            request.block_ids[index] = dst
            # src stays referenced by the other holders, so it never reaches a free queue
            self._ref_counts[src] -= 1
            self._pending_copies.append((src, dst))
            new_ids.append(dst)
        for _ in range(num_new_blocks - num_lower):
            block_id = self._take_free_block()
            request.block_ids.append(block_id)
            new_ids.append(block_id)

        # num_new_blocks counts the lower tier's blocks: they were new to the pool
        self._num_live_blocks += num_new_blocks + (len(claimed_ids) if is_first_call else 0)
        num_tokens = max(end, request.num_tokens)
        self._num_live_tokens += num_tokens - request.num_tokens
        request.num_tokens = num_tokens

        if self.enable_prefix_caching:
            self._hash_full_blocks(request, token_ids, min(end, len(token_ids)))
        self._release_behind_window(request, num_computed_tokens)
        return new_ids

    def _num_behind_window(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at or after position ``num_computed_tokens`` reads."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _release_behind_window(self, request: _RequestBlocks, num_computed_tokens: int) -> None:
        behind = min(self._num_behind_window(num_computed_tokens), len(request.block_ids))
        gone = [b for b in request.block_ids[:behind] if b != RELEASED]
        if not gone:
            return
        request.block_ids[:behind] = [RELEASED] * behind
        self._release(gone)
        self._num_live_blocks -= len(gone)
        self._num_live_tokens -= len(gone) * self.block_size  # released blocks are full

    def fork(self, parent_id: str, child_id: str) -> None:
        """Makes ``child_id`` share every block of ``parent_id`` (parallel sampling)."""
        if self.has_request(child_id):
            raise ValueError(f"request {child_id!r} already holds blocks")
        parent = self._live(parent_id)
        for block_id in parent.block_ids:
            if block_id != RELEASED:
                self._incref(block_id)
        self._requests[child_id] = _RequestBlocks(
            block_ids=list(parent.block_ids),
            num_tokens=parent.num_tokens,
            extra_keys=parent.extra_keys,
            block_hashes=list(parent.block_hashes),
        )
        self._num_live_blocks += _num_held(parent.block_ids)
        self._num_live_tokens += self._tokens_held(parent)

    def free(self, request_id: str) -> None:
        """Releases the request's device or host blocks; unknown requests are a no-op.

        Blocks are released tail first, so within one request the tail goes to the LRU
        queue first and is evicted first, while the (likely shared) prefix survives longest.
        """
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            # entries released behind a sliding window hold no host block
            self._free_host_ids.extend(h for h in swapped.host_block_ids if h != RELEASED)
            return
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._release_device_blocks(request)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrinks the request to its first ``num_tokens`` positions: the slots of rejected
        speculative tokens, allocated like any append, go back to the pool at once.

        Only positions past the tokens ``allocate_slots`` was told of should go; the blocks
        those fill may be registered in the prefix cache, and dropping one is refused.
        """
        request = self._live(request_id)
        if not 0 <= num_tokens <= request.num_tokens:
            raise ValueError(f"cannot trim request {request_id!r} of {request.num_tokens} "
                             f"tokens to {num_tokens}")
        keep = self.blocks_for(num_tokens)
        if keep < len(request.block_hashes):
            raise ValueError(f"trimming request {request_id!r} to {num_tokens} tokens would "
                             "drop blocks of known tokens (hashed for the prefix cache)")
        tail = [b for b in request.block_ids[keep:] if b != RELEASED]
        del request.block_ids[keep:]
        self._release(tail)
        self._num_live_blocks -= len(tail)
        self._num_live_tokens -= request.num_tokens - num_tokens
        request.num_tokens = num_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write copies ``(src, dst)`` to apply, in order, before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_evictions(self) -> list[EvictedBlock]:
        """Hashed blocks evicted from the cached queue since the last call (only with a
        lower tier), whose KV the caller may save before any transfer or forward."""
        evictions, self._evictions = self._evictions, []
        return evictions

    def take_pending_loads(self) -> list[tuple[int, bytes]]:
        """``(block id, block hash)`` of lower-tier blocks claimed since the last call,
        whose KV the caller must write, after swap-ins and before the next forward."""
        loads = list(self._pending_loads.items())
        self._pending_loads.clear()
        return loads

    # ---- swap (KV offloading) ------------------------------------------------------------

    def can_swap_out(self, request_id: str) -> bool:
        """Whether the host pool has room for all of the request's blocks."""
        return self.num_blocks_held(request_id) <= len(self._free_host_ids)

    def can_swap_in(self, request_id: str) -> bool:
        """Whether enough device blocks are allocatable to bring the request back."""
        return _num_held(self._swapped[request_id].host_block_ids) <= self.num_free_blocks()

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Moves the request's blocks to the host pool; returns ``(device, host)`` pairs.

        The device blocks are released as by ``free`` (hashed ones stay cached). Returns
        None, changing nothing, when the host pool is too small: preempt by recompute then.
        """
        request = self._live(request_id)
        if _num_held(request.block_ids) > len(self._free_host_ids):
            return None
        host_ids = [RELEASED if b == RELEASED else self._free_host_ids.popleft()
                    for b in request.block_ids]
        pairs = [(b, h) for b, h in zip(request.block_ids, host_ids, strict=True)
                 if b != RELEASED]
        del self._requests[request_id]
        self._release_device_blocks(request)
        self._swapped[request_id] = _SwappedRequest(
            host_block_ids=host_ids,
            num_tokens=request.num_tokens,
            extra_keys=request.extra_keys,
            block_hashes=request.block_hashes,
        )
        return pairs

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Brings a swapped request back; returns ``(host, device)`` pairs.

        Returns None, changing nothing, when too few device blocks are allocatable.
        """
        swapped = self._swapped.get(request_id)
        if swapped is None:
            raise KeyError(f"request {request_id!r} is not swapped out")
        if _num_held(swapped.host_block_ids) > self.num_free_blocks():
            return None
        del self._swapped[request_id]
        device_ids = [RELEASED if h == RELEASED else self._take_free_block()
                      for h in swapped.host_block_ids]
        pairs = [(h, d) for h, d in zip(swapped.host_block_ids, device_ids, strict=True)
                 if h != RELEASED]
        self._free_host_ids.extend(h for h, _ in pairs)
        # the fresh blocks are not registered: their hashes most likely still point at the
        # device blocks swap_out released into the cached queue
        self._requests[request_id] = _RequestBlocks(
            block_ids=device_ids,
            num_tokens=swapped.num_tokens,
            extra_keys=swapped.extra_keys,
            block_hashes=swapped.block_hashes,
        )
        self._num_live_blocks += len(pairs)
        self._num_live_tokens += self._tokens_held(self._requests[request_id])
        return pairs

    # ---- prefix-cache maintenance --------------------------------------------------------

    def drop_cached(self, predicate: Callable[[tuple[ExtraKey, ...]], bool]) -> int:
        """Unregisters every cached block whose extra keys match ``predicate``.

        Used when an adapter is deleted. Ref-0 blocks become pure free; blocks in use keep
        their content for their requests but are never hit again. Returns the number of
        blocks unregistered.
        """
        matched_ids = []
        for block_id in self._hash_to_block.values():
            key = self._block_keys[block_id]
            assert key is not None
            if predicate(key[2]):
                matched_ids.append(block_id)
        for block_id in matched_ids:
            self._unregister(block_id)
        return len(matched_ids)

    # ---- stats ---------------------------------------------------------------------------

    def record_preemption(self) -> None:
        """Counts one preemption (the scheduler decides; swap or recompute alike)."""
        self._num_preemptions += 1

    def stats(self) -> KVCacheStats:
        """The current figures, in O(1)."""
        num_free = len(self._free_ids)
        num_cached_free = len(self._cached_free_ids)
        num_slots = self._num_live_blocks * self.block_size
        return KVCacheStats(
            num_blocks_total=self.num_blocks,
            num_blocks_used=self.num_blocks - num_free - num_cached_free,
            num_blocks_free=num_free,
            num_blocks_cached_free=num_cached_free,
            prefix_cache_queried_tokens=self._num_queried_tokens,
            prefix_cache_hit_tokens=self._num_hit_tokens,
            num_preemptions=self._num_preemptions,
            kv_utilization=self._num_live_tokens / num_slots if num_slots else 0.0,
            num_host_blocks_total=self.num_host_blocks,
            num_host_blocks_used=self.num_host_blocks - len(self._free_host_ids),
            lower_tier_hit_tokens=self._num_lower_hit_tokens,
        )

    def registered_blocks(self) -> Iterator[RegisteredBlock]:
        """Every block in the prefix cache: (hash, parent hash, extra keys)."""
        for block_hash, block_id in self._hash_to_block.items():
            key = self._block_keys[block_id]
            assert key is not None
            yield block_hash, key[0], key[2]

    def cached_blocks(self) -> list[EvictedBlock]:
        """Every block in the prefix cache with its key and slot (what a clean stop saves
        to the lower tier), least recently used first among the ref-0 ones."""
        order = [*self._cached_free_ids,
                 *(b for b in self._hash_to_block.values() if self._ref_counts[b] > 0)]
        out = []
        for block_id in order:
            block_hash, key = self._block_hashes[block_id], self._block_keys[block_id]
            assert block_hash is not None and key is not None
            out.append(EvictedBlock(block_id, block_hash, *key))
        return out

    def all_free_or_cached(self) -> bool:
        """Whether no request holds any device or host block."""
        return (
            not self._requests
            and not self._swapped
            and self.num_free_blocks() == self.num_blocks
            and len(self._free_host_ids) == self.num_host_blocks
        )

    def check_invariants(self) -> None:
        """Raises AssertionError (with detail) if the bookkeeping is inconsistent. O(n)."""
        expected_refs = [0] * self.num_blocks
        for request_id, request in self._requests.items():
            held = [b for b in request.block_ids if b != RELEASED]
            assert len(set(held)) == len(held), (
                f"request {request_id!r} holds a block twice: {request.block_ids}"
            )
            for block_id in held:
                expected_refs[block_id] += 1
            behind = self._num_behind_window(request.num_tokens)
            assert RELEASED not in request.block_ids[len(request.block_ids) - len(held):], (
                f"request {request_id!r}: a released block after a held one"
            )
            assert len(request.block_ids) - len(held) <= behind, (
                f"request {request_id!r}: a block released inside its window"
            )
            assert request.num_tokens <= len(request.block_ids) * self.block_size, (
                f"request {request_id!r}: {request.num_tokens} tokens in "
                f"{len(request.block_ids)} blocks"
            )
            assert len(request.block_hashes) <= len(request.block_ids), (
                f"request {request_id!r}: more hashes than blocks"
            )
            for index, request_hash in enumerate(request.block_hashes):
                if request.block_ids[index] == RELEASED:
                    continue
                registered = self._block_hashes[request.block_ids[index]]
                assert registered is None or registered == request_hash, (
                    f"request {request_id!r} block {index}: registered hash differs"
                )
        assert self._requests.keys().isdisjoint(self._swapped.keys()), (
            "a request is both live and swapped"
        )

        free_ids = set(self._free_ids)
        assert len(free_ids) == len(self._free_ids), "a block is twice in the free queue"
        cached_ids = set(self._cached_free_ids)
        assert free_ids.isdisjoint(cached_ids), (
            f"blocks both free and cached: {sorted(free_ids & cached_ids)}"
        )
        for block_id in range(self.num_blocks):
            ref = self._ref_counts[block_id]
            assert ref == expected_refs[block_id], (
                f"block {block_id}: ref count {ref}, held by {expected_refs[block_id]} tables"
            )
            places = (ref > 0) + (block_id in free_ids) + (block_id in cached_ids)
            assert places == 1, (
                f"block {block_id} is in {places} places (ref={ref}, "
                f"free={block_id in free_ids}, cached={block_id in cached_ids})"
            )
            block_hash = self._block_hashes[block_id]
            assert (block_hash is None) == (self._block_keys[block_id] is None), (
                f"block {block_id}: hash and key disagree"
            )
            if block_hash is not None:
                assert self._hash_to_block.get(block_hash) == block_id, (
                    f"block {block_id}: its hash maps elsewhere"
                )
            if block_id in free_ids:
                assert block_hash is None, f"free block {block_id} still has a hash"
            if block_id in cached_ids:
                assert block_hash is not None, f"cached block {block_id} has no hash"
        for block_hash, block_id in self._hash_to_block.items():
            assert self._block_hashes[block_id] == block_hash, (
                f"hash map points at block {block_id}, which has another hash"
            )
        assert not self._hash_to_block or self.enable_prefix_caching, (
            "blocks registered while prefix caching is off"
        )

        num_live_blocks = sum(_num_held(r.block_ids) for r in self._requests.values())
        num_live_tokens = sum(self._tokens_held(r) for r in self._requests.values())
        assert self._num_live_blocks == num_live_blocks, (
            f"live block sum {self._num_live_blocks} != {num_live_blocks}"
        )
        assert self._num_live_tokens == num_live_tokens, (
            f"live token sum {self._num_live_tokens} != {num_live_tokens}"
        )

        host_ids = list(self._free_host_ids)
        for swapped in self._swapped.values():
            host_ids.extend(h for h in swapped.host_block_ids if h != RELEASED)
            assert swapped.num_tokens <= len(swapped.host_block_ids) * self.block_size
        assert sorted(host_ids) == list(range(self.num_host_blocks)), (
            "host blocks leaked or held twice"
        )

    # ---- internals -----------------------------------------------------------------------

    def _live(self, request_id: str) -> _RequestBlocks:
        request = self._requests.get(request_id)
        if request is None:
            state = "swapped out" if request_id in self._swapped else "unknown"
            raise KeyError(f"request {request_id!r} is {state}")
        return request

    def _incref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            # a ref-0 block held by a request can only come from the cached queue
            del self._cached_free_ids[block_id]
        self._ref_counts[block_id] += 1

    def _take_free_block(self) -> int:
        if self._free_ids:
            block_id = self._free_ids.popleft()
            self._pending_loads.pop(block_id, None)
        else:
            block_id, _ = self._cached_free_ids.popitem(last=False)
            key = self._block_keys[block_id]
            block_hash = self._block_hashes[block_id]
            # a block whose KV is still to be loaded holds nothing to save
            if self._pending_loads.pop(block_id, None) is None \
                    and self.lower_tier is not None:
                assert key is not None and block_hash is not None
                self._evictions.append(EvictedBlock(block_id, block_hash, *key))
            self._drop_hash(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _register(self, block_id: int, block_hash: bytes, key: BlockKey) -> None:
        # a duplicate (same prefix computed twice concurrently) stays unregistered and goes
        # back to the pure free queue when released
        if block_hash not in self._hash_to_block and self._block_hashes[block_id] is None:
            self._hash_to_block[block_hash] = block_id
            self._block_hashes[block_id] = block_hash
            self._block_keys[block_id] = key
            if self.events is not None:
                self.events.stored(block_hash, key[0], key[2])

    def _release_device_blocks(self, request: _RequestBlocks) -> None:
        held = [b for b in request.block_ids if b != RELEASED]
        self._release(held)
        self._num_live_blocks -= len(held)
        self._num_live_tokens -= self._tokens_held(request)

    def _tokens_held(self, request: _RequestBlocks) -> int:
        """The request's tokens in blocks it holds (not those released behind its window)."""
        released = len(request.block_ids) - _num_held(request.block_ids)
        return request.num_tokens - released * self.block_size

    def _release(self, block_ids: Sequence[int]) -> None:
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._block_hashes[block_id] is not None:
                    self._cached_free_ids[block_id] = None  # most recently used end
                else:
                    self._free_ids.append(block_id)

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        assert block_hash is not None
        del self._hash_to_block[block_hash]
        self._block_hashes[block_id] = None
        self._block_keys[block_id] = None
        if self.events is not None:
            self.events.removed(block_hash)

    def _unregister(self, block_id: int) -> None:
        self._drop_hash(block_id)
        if self._ref_counts[block_id] == 0:
            del self._cached_free_ids[block_id]
            self._free_ids.append(block_id)

    def _verify_cached(
        self, token_ids: Sequence[int], keys: tuple[ExtraKey, ...], cached: CachedPrefix
    ) -> list[bytes]:
        # The prefix may have gone stale if blocks were evicted since get_computed_blocks;
        # claiming a reused block would serve someone else's KV, so refuse loudly.
        if cached.num_tokens >= max(1, len(token_ids)):
            raise ValueError("a cached prefix must leave the last prompt token to compute")
        if cached.num_tokens != (len(cached.block_ids) + len(cached.lower_hashes)) \
                * self.block_size:
            raise ValueError(f"cached prefix is inconsistent: {cached!r}")
        hashes: list[bytes] = []
        parent: bytes | None = None
        for index, block_id in enumerate(cached.block_ids):
            start = index * self.block_size
            block_tokens = tuple(token_ids[start : start + self.block_size])
            block_hash = self._block_hashes[block_id]
            if block_hash is None or self._block_keys[block_id] != (parent, block_tokens, keys):
                raise ValueError(
                    f"cached block {block_id} no longer holds this prefix; call "
                    "get_computed_blocks right before allocate_slots"
                )
            hashes.append(block_hash)
            parent = block_hash
        for index, block_hash in enumerate(cached.lower_hashes, start=len(cached.block_ids)):
            start = index * self.block_size
            if self.lower_tier is None or block_hash in self._hash_to_block or hash_block(
                    parent, tuple(token_ids[start:start + self.block_size]), keys) != block_hash:
                raise ValueError(
                    f"lower-tier block {index} no longer matches this prefix; call "
                    "get_computed_blocks right before allocate_slots")
            hashes.append(block_hash)
            parent = block_hash
        return hashes

    def _hash_full_blocks(
        self, request: _RequestBlocks, token_ids: Sequence[int], num_known_tokens: int
    ) -> None:
        num_full_blocks = min(num_known_tokens // self.block_size, len(request.block_ids))
        parent: bytes | None = request.block_hashes[-1] if request.block_hashes else None
        for index in range(len(request.block_hashes), num_full_blocks):
            start = index * self.block_size
            block_tokens = tuple(token_ids[start : start + self.block_size])
            block_hash = hash_block(parent, block_tokens, request.extra_keys)
            request.block_hashes.append(block_hash)
            block_id = request.block_ids[index]
            if block_id != RELEASED:
                self._register(block_id, block_hash,
                               (parent, block_tokens, request.extra_keys))
            parent = block_hash
