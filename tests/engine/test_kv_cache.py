from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from loraplex.engine import kv_cache, kv_hashing
from loraplex.engine.kv_cache import CachedPrefix, KVCacheManager
from loraplex.engine.kv_hashing import BlockKey, ExtraKey, extra_keys_for, hash_block

BS = 4
ADAPTER_A = extra_keys_for(("adapter-a", "digest-a1"), None)
ADAPTER_A_V2 = extra_keys_for(("adapter-a", "digest-a2"), None)
ADAPTER_B = extra_keys_for(("adapter-b", "digest-b1"), None)


def is_swapped(manager: KVCacheManager, request_id: str) -> bool:
    """Known to the manager, but with no device block table: its blocks are in the host pool."""
    if not manager.has_request(request_id):
        return False
    try:
        manager.block_table(request_id)
    except KeyError:
        return True
    return False


def prefill(
    manager: KVCacheManager,
    request_id: str,
    token_ids: Sequence[int],
    extra_keys: tuple[ExtraKey, ...] = (),
) -> CachedPrefix | None:
    """Admits a request the way the scheduler does; returns the prefix it got (None: no room)."""
    cached = manager.get_computed_blocks(token_ids, extra_keys)
    new_ids = manager.allocate_slots(
        request_id,
        token_ids,
        cached.num_tokens,
        len(token_ids) - cached.num_tokens,
        extra_keys,
        cached,
    )
    return None if new_ids is None else cached


def decode(manager: KVCacheManager, request_id: str, token_ids: list[int]) -> list[int] | None:
    """Appends one sampled token; ``token_ids`` already holds it."""
    return manager.allocate_slots(request_id, token_ids, len(token_ids) - 1, 1)


def hit_tokens(
    manager: KVCacheManager, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...] = ()
) -> int:
    return manager.get_computed_blocks(token_ids, extra_keys).num_tokens


PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks + 1


# ---- hashing and extra keys ----------------------------------------------------------------


def test_hash_block_is_sha256_and_depends_on_every_part() -> None:
    base = hash_block(None, [1, 2, 3, 4], ())
    assert len(base) == 32
    assert base == hash_block(None, (1, 2, 3, 4), ())
    variants = [
        hash_block(base, [1, 2, 3, 4], ()),
        hash_block(None, [1, 2, 3, 5], ()),
        hash_block(None, [1, 2, 3], ()),
        hash_block(None, [1, 2, 3, 4], (("salt", "s"),)),
        hash_block(None, [1, 2, 3, 4], (("salt", ""),)),
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_hash_encoding_is_unambiguous() -> None:
    tokens = [7, 7, 7, 7]
    keyings: list[tuple[ExtraKey, ...]] = [
        (("adapter", "ab", "c"),),
        (("adapter", "a", "bc"),),
        (("adapter", "a"), ("bc",)),
        (("adapter",), ("a", "bc")),
        (("salt", "x"),),
        (("adapter", "x", "d"),),
        (("salt", "x"), ("adapter", "x", "d")),
        (("adapter", "x", "d"), ("salt", "x")),
        (("salt", "adapter"),),
        (("salt", "x", "d"),),
        ((),),
        (),
    ]
    hashes = {hash_block(None, tokens, keys) for keys in keyings}
    assert len(hashes) == len(keyings)
    # the parent is length-prefixed too, so it cannot be confused with token bytes
    assert hash_block(b"\x00" * 32, [1], ()) != hash_block(b"\x00" * 31, [1], ())


def test_hash_block_refuses_non_string_fields() -> None:
    with pytest.raises(TypeError):
        hash_block(None, [1], (("adapter", 3),))  # type: ignore[arg-type]


def test_extra_keys_for_tags_every_field() -> None:
    assert extra_keys_for(None, None) == ()
    assert extra_keys_for(None, "s") == (("salt", "s"),)
    assert extra_keys_for(("a", "d"), None) == (("adapter", "a", "d"),)
    assert extra_keys_for(("a", "d"), "s") == (("adapter", "a", "d"), ("salt", "s"))
    with pytest.raises(ValueError):
        extra_keys_for(("a", ""), None)
    with pytest.raises(ValueError):
        extra_keys_for(("", "d"), None)


# ---- prefix cache domains -------------------------------------------------------------------


def test_hit_for_same_tokens_adapter_and_salt() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    keys = extra_keys_for(("adapter-a", "digest-a1"), "tenant-1")
    prefill(manager, "r1", PROMPT, keys)
    cached = manager.get_computed_blocks(PROMPT, keys)
    assert cached.num_tokens == 12
    assert list(cached.block_ids) == manager.block_table("r1")[:3]
    # still a hit after the first request finished: the blocks stay cached
    manager.free("r1")
    assert hit_tokens(manager, PROMPT, keys) == 12
    admitted = prefill(manager, "r2", PROMPT + [1, 2], keys)
    assert admitted is not None and admitted.num_tokens == 12
    manager.free("r2")
    manager.check_invariants()
    assert manager.all_free_or_cached()


@pytest.mark.parametrize(
    ("stored", "probed"),
    [
        pytest.param(ADAPTER_A, ADAPTER_B, id="across-adapters"),
        pytest.param(ADAPTER_A, ADAPTER_A_V2, id="across-adapter-versions"),
        pytest.param(
            extra_keys_for(None, "tenant-1"), extra_keys_for(None, "tenant-2"), id="across-salts"
        ),
        pytest.param((), ADAPTER_A, id="base-vs-adapter"),
        pytest.param(ADAPTER_A, (), id="adapter-vs-base"),
        pytest.param((), extra_keys_for(None, "tenant-1"), id="unsalted-vs-salted"),
        pytest.param(
            extra_keys_for(("adapter-a", "digest-a1"), "tenant-1"),
            extra_keys_for(("adapter-a", "digest-a1"), "tenant-2"),
            id="same-adapter-other-salt",
        ),
        pytest.param(
            extra_keys_for(("tenant-1", "digest"), None),
            extra_keys_for(None, "tenant-1"),
            id="adapter-id-equals-salt",
        ),
    ],
)
def test_miss_across_cache_domains(
    stored: tuple[ExtraKey, ...], probed: tuple[ExtraKey, ...]
) -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    prefill(manager, "r1", PROMPT, stored)
    assert hit_tokens(manager, PROMPT, stored) == 12
    assert hit_tokens(manager, PROMPT, probed) == 0
    cached = prefill(manager, "r2", PROMPT, probed)
    assert cached is not None and cached.num_tokens == 0
    assert set(manager.block_table("r1")).isdisjoint(manager.block_table("r2"))
    manager.free("r1")
    manager.free("r2")
    manager.check_invariants()


def test_hash_collision_is_refused_after_comparing_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def same(parent: bytes | None, token_ids: Sequence[int], extra_keys: object) -> bytes:
        return b"same"

    # where prompts are hashed (kv_hashing.prefix_chain) and where blocks are registered
    monkeypatch.setattr(kv_hashing, "hash_block", same)
    monkeypatch.setattr(kv_cache, "hash_block", same)
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    prefill(manager, "r1", [1, 2, 3, 4, 5])
    assert hit_tokens(manager, [1, 2, 3, 4, 5]) == 4  # the colliding hash still works as a key
    assert hit_tokens(manager, [9, 9, 9, 9, 5]) == 0  # other tokens, same hash: refused
    assert hit_tokens(manager, [1, 2, 3, 4, 5], ADAPTER_A) == 0  # other domain: refused
    cached = prefill(manager, "r2", [9, 9, 9, 9, 5])
    assert cached is not None and cached.num_tokens == 0
    manager.free("r1")
    manager.free("r2")
    manager.check_invariants()


def test_last_prompt_token_is_never_covered() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))  # exactly two full blocks
    prefill(manager, "r1", prompt)
    assert hit_tokens(manager, prompt) == 4
    assert hit_tokens(manager, prompt + [8]) == 8
    assert hit_tokens(manager, prompt[:5]) == 4
    assert hit_tokens(manager, prompt[:4]) == 0
    assert hit_tokens(manager, []) == 0
    manager.free("r1")
    # even a prompt that is entirely cached computes its last token
    cached = prefill(manager, "r2", prompt)
    assert cached is not None and cached.num_tokens == 4
    with pytest.raises(ValueError, match="last prompt token"):
        manager.allocate_slots("r3", prompt[:4], 4, 0, (), CachedPrefix(cached.block_ids, 4))


def test_stale_cached_prefix_is_refused() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    prefill(manager, "r1", PROMPT[:9])  # 3 blocks: 2 full + 1
    manager.free("r1")
    cached = manager.get_computed_blocks(PROMPT[:9], ())
    assert cached.num_tokens == 8
    prefill(manager, "other", [7] * 12)  # evicts every cached block
    manager.free("other")
    with pytest.raises(ValueError, match="no longer holds"):
        manager.allocate_slots("r2", PROMPT[:9], 8, 1, (), cached)
    manager.check_invariants()


def test_prefix_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prefill(manager, "r1", PROMPT)
    manager.free("r1")
    assert hit_tokens(manager, PROMPT) == 0
    stats = manager.stats()
    assert stats.prefix_cache_queried_tokens == 0
    assert stats.num_blocks_cached_free == 0
    assert stats.num_blocks_free == 8
    manager.check_invariants()


def test_same_prefix_computed_twice_registers_once() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    prefill(manager, "r1", PROMPT)
    # planned before r1 registered anything: both compute the prefix
    manager.allocate_slots("r2", PROMPT, 0, len(PROMPT))
    manager.check_invariants()
    manager.free("r2")
    manager.free("r1")
    stats = manager.stats()
    assert stats.num_blocks_cached_free == 3  # only r1's full blocks
    assert stats.num_blocks_free == 13
    assert hit_tokens(manager, PROMPT) == 12
    manager.check_invariants()


# ---- eviction and freeing order -------------------------------------------------------------


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    prompts = {name: [base] * 4 + [0] for name, base in (("a", 10), ("b", 20), ("c", 30))}
    for name, prompt in prompts.items():
        prefill(manager, name, prompt)
    for name in ("a", "b", "c"):
        manager.free(name)
    # a hit makes "a" the most recently used
    prefill(manager, "a2", prompts["a"])
    manager.free("a2")
    stats = manager.stats()
    assert (stats.num_blocks_free, stats.num_blocks_cached_free) == (3, 3)

    prefill(manager, "fill", [1] * 16)  # 4 blocks: 3 pure free, then evicts one (b's)
    assert [hit_tokens(manager, prompts[n]) for n in ("a", "b", "c")] == [4, 0, 4]
    manager.allocate_slots("fill", [1] * 20, 16, 4)  # evicts c's next
    assert [hit_tokens(manager, prompts[n]) for n in ("a", "b", "c")] == [4, 0, 0]
    manager.free("fill")
    manager.check_invariants()


def test_free_releases_tail_first_so_the_prefix_survives() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = list(range(17))  # 4 full blocks + 1 token: needs 5 blocks, too many
    assert prefill(manager, "r1", prompt) is None
    prompt = list(range(13))  # 3 full blocks + 1 token
    prefill(manager, "r1", prompt)
    manager.allocate_slots("r1", prompt + [99, 98, 97], 13, 3)  # block 4 becomes full
    table = manager.block_table("r1")
    manager.free("r1")
    assert manager.stats().num_blocks_cached_free == 4
    # tail goes first: each allocation of one block evicts the current tail of the prefix
    for num_evicted in range(1, 4):
        manager.allocate_slots(f"x{num_evicted}", [0], 0, 1)
        assert manager.block_table(f"x{num_evicted}") == [table[-num_evicted]]
        assert hit_tokens(manager, prompt + [99, 98, 97, 0]) == 16 - 4 * num_evicted
    for num_evicted in range(1, 4):
        manager.free(f"x{num_evicted}")
    manager.check_invariants()


def test_pure_free_blocks_are_used_before_evicting() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    prefill(manager, "r1", PROMPT[:5])  # 1 full block + 1
    manager.free("r1")
    prefill(manager, "r2", [5] * 12)  # the 3 blocks that hold nothing cached
    assert hit_tokens(manager, PROMPT[:5]) == 4
    manager.free("r2")
    manager.check_invariants()


# ---- copy-on-write --------------------------------------------------------------------------


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(6))  # one full block + a partial one
    prefill(manager, "p", prompt)
    manager.fork("p", "c")
    parent_table = manager.block_table("p")
    assert manager.block_table("c") == parent_table
    assert manager.stats().num_blocks_used == 2

    new_ids = decode(manager, "c", prompt + [42])
    assert new_ids is not None and len(new_ids) == 1
    child_table = manager.block_table("c")
    assert child_table[0] == parent_table[0]  # the full block stays shared
    assert child_table[1] == new_ids[0] != parent_table[1]
    assert manager.take_pending_copies() == [(parent_table[1], new_ids[0])]
    assert manager.take_pending_copies() == []

    # the parent is now the only holder: it writes in place
    assert decode(manager, "p", prompt + [7]) == []
    assert manager.block_table("p") == parent_table
    assert manager.take_pending_copies() == []
    manager.check_invariants()
    manager.free("p")
    manager.free("c")
    manager.check_invariants()
    assert manager.all_free_or_cached()


def test_fork_with_full_blocks_needs_no_copy() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(8))
    prefill(manager, "p", prompt)
    manager.fork("p", "c")
    new_ids = decode(manager, "c", prompt + [1])
    assert new_ids is not None and len(new_ids) == 1
    assert manager.take_pending_copies() == []
    with pytest.raises(ValueError):
        manager.fork("p", "c")
    manager.free("p")
    manager.free("c")
    manager.check_invariants()


def test_copy_on_write_fails_atomically_without_free_blocks() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=BS)
    prompt = list(range(6))
    prefill(manager, "p", prompt)
    manager.fork("p", "c")
    assert decode(manager, "c", prompt + [1]) is None
    assert manager.block_table("c") == manager.block_table("p")
    assert manager.take_pending_copies() == []
    manager.free("p")
    assert decode(manager, "c", prompt + [1]) == []  # sole holder now: no copy needed
    manager.free("c")
    manager.check_invariants()


# ---- swap -----------------------------------------------------------------------------------


def test_swap_out_and_in_round_trip() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    tokens = list(range(10))
    prefill(manager, "r", tokens)
    table = manager.block_table("r")
    pairs_out = manager.swap_out("r")
    assert pairs_out is not None
    assert [device for device, _ in pairs_out] == table
    assert is_swapped(manager, "r") and manager.has_request("r")
    assert manager.stats().num_host_blocks_used == 3
    assert manager.num_free_blocks() == 4
    with pytest.raises(KeyError):
        manager.block_table("r")
    with pytest.raises(ValueError):
        decode(manager, "r", tokens + [1])
    manager.check_invariants()

    prefill(manager, "other", [3] * 16)  # takes the whole device pool
    assert manager.swap_in("r") is None
    assert is_swapped(manager, "r")
    manager.free("other")

    pairs_in = manager.swap_in("r")
    assert pairs_in is not None
    assert [host for host, _ in pairs_in] == [host for _, host in pairs_out]
    assert manager.block_table("r") == [device for _, device in pairs_in]
    assert not is_swapped(manager, "r")
    assert manager.num_tokens("r") == 10
    assert manager.stats().num_host_blocks_used == 0
    assert decode(manager, "r", tokens + [1]) == []
    manager.free("r")
    manager.check_invariants()
    assert manager.all_free_or_cached()


def test_swap_out_falls_back_when_host_pool_is_full() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=2)
    prefill(manager, "r", list(range(10)))  # 3 blocks > 2 host blocks
    before = (manager.block_table("r"), manager.stats())
    assert not manager.can_swap_out("r")
    assert manager.swap_out("r") is None
    assert (manager.block_table("r"), manager.stats()) == before
    # the scheduler then preempts by recompute
    manager.free("r")
    manager.record_preemption()
    assert manager.stats().num_preemptions == 1
    no_swap = KVCacheManager(num_blocks=2, block_size=BS)
    prefill(no_swap, "r", [1])
    assert no_swap.swap_out("r") is None
    manager.check_invariants()


def test_free_of_a_swapped_request_releases_host_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    prefill(manager, "r", list(range(5)))
    assert manager.swap_out("r") is not None
    manager.free("r")
    manager.free("never-seen")  # a no-op
    assert not manager.has_request("r")
    assert manager.all_free_or_cached()
    manager.check_invariants()


# ---- atomicity, stats, maintenance ---------------------------------------------------------


def test_allocate_slots_is_atomic_when_out_of_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    prefill(manager, "r1", PROMPT[:9])  # 3 blocks, 2 of them cached-registered
    manager.free("r1")
    cached = manager.get_computed_blocks(PROMPT[:9] + list(range(8)), ())
    assert cached.num_tokens == 8
    before = manager.stats()
    # needs 2 claimed + 3 new blocks out of 4 allocatable
    assert manager.allocate_slots("r2", PROMPT[:9] + list(range(8)), 8, 9, (), cached) is None
    assert manager.stats() == before
    assert not manager.has_request("r2")
    manager.check_invariants()
    # claiming is counted against the pool: 2 claimed + 2 new fits
    assert manager.allocate_slots("r2", PROMPT[:9] + list(range(8)), 8, 8, (), cached) is not None
    assert manager.num_free_blocks() == 0
    manager.free("r2")
    manager.check_invariants()


def test_stats_figures() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS, num_host_blocks=3)
    prefill(manager, "r1", PROMPT)  # 13 tokens in 4 blocks
    stats = manager.stats()
    assert stats.num_blocks_total == 10
    assert (stats.num_blocks_used, stats.num_blocks_free, stats.num_blocks_cached_free) == (
        4,
        6,
        0,
    )
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (13, 0)
    assert stats.kv_utilization == pytest.approx(13 / 16)
    assert stats.prefix_cache_hit_rate == 0.0

    # planning is free of side effects
    manager.get_computed_blocks(PROMPT, ())
    assert manager.stats() == stats

    prefill(manager, "r2", PROMPT + [1, 2])  # 15 tokens, hits 12
    stats = manager.stats()
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (28, 12)
    assert stats.prefix_cache_hit_rate == pytest.approx(12 / 28)
    assert stats.num_blocks_used == 5  # 3 shared + 1 + 1
    assert stats.kv_utilization == pytest.approx((13 + 15) / (16 + 16))

    manager.free("r1")
    manager.free("r2")
    stats = manager.stats()
    assert (stats.num_blocks_used, stats.num_blocks_free, stats.num_blocks_cached_free) == (
        0,
        7,
        3,
    )
    assert stats.kv_utilization == 0.0
    assert (stats.num_host_blocks_total, stats.num_host_blocks_used) == (3, 0)
    assert manager.num_free_blocks() == 10
    assert manager.can_fit(40) and not manager.can_fit(41)


def test_drop_cached_removes_one_adapters_blocks() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    prefill(manager, "a", PROMPT, ADAPTER_A)
    prefill(manager, "b", PROMPT, ADAPTER_B)
    manager.free("a")

    def is_adapter_a(keys: tuple[ExtraKey, ...]) -> bool:
        return any(key[0] == "adapter" and key[1] == "adapter-a" for key in keys)

    prefill(manager, "a-live", PROMPT + [5], ADAPTER_A)  # in use while the adapter goes
    assert manager.drop_cached(is_adapter_a) == 3
    assert hit_tokens(manager, PROMPT, ADAPTER_A) == 0
    assert hit_tokens(manager, PROMPT, ADAPTER_B) == 12
    manager.check_invariants()
    manager.free("a-live")
    manager.free("b")
    assert manager.stats().num_blocks_cached_free == 3  # only b's
    manager.check_invariants()


def test_allocate_slots_validates_arguments() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    with pytest.raises(ValueError):
        manager.allocate_slots("r", [1, 2], 4, 1)  # computed tokens in blocks it lacks
    with pytest.raises(ValueError):
        manager.allocate_slots("r", [1, 2], -1, 1)
    prefill(manager, "r", [1, 2], ADAPTER_A)
    with pytest.raises(ValueError, match="extra keys"):
        manager.allocate_slots("r", [1, 2, 3], 2, 1, ADAPTER_B)
    assert manager.allocate_slots("r", [1, 2, 3], 2, 1, ADAPTER_A) == []
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=BS)
    manager.free("r")
    manager.check_invariants()


def test_check_invariants_detects_a_broken_ref_count() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    prefill(manager, "r", [1, 2, 3])
    manager._ref_counts[manager.block_table("r")[0]] += 1
    with pytest.raises(AssertionError, match="ref count"):
        manager.check_invariants()


def test_trim_releases_rejected_slots_and_keeps_known_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    prefill(manager, "r", list(range(BS + 1)))
    # Three proposals past the known tokens reach into a third block.
    assert manager.allocate_slots("r", list(range(BS + 1)), BS + 1, 2 * BS - 1) is not None
    assert len(manager.block_table("r")) == 3
    manager.trim("r", BS + 2)
    assert len(manager.block_table("r")) == 2 and manager.num_tokens("r") == BS + 2
    assert manager.stats().num_blocks_free == 6  # the released block was never registered
    with pytest.raises(ValueError, match="known tokens"):
        manager.trim("r", 0)
    with pytest.raises(ValueError, match="cannot trim"):
        manager.trim("r", BS + 3)
    manager.check_invariants()
    manager.free("r")
    assert manager.all_free_or_cached()


# ---- property tests -------------------------------------------------------------------------

# token prefixes that requests share, so the prefix cache actually hits
_BASES = [[3, 1, 0, 2, 2, 0, 1, 3, 3, 1, 0, 2], [0] * 12]
_DOMAINS: list[tuple[ExtraKey, ...]] = [
    (),
    ADAPTER_A,
    ADAPTER_A_V2,
    ADAPTER_B,
    extra_keys_for(None, "adapter-a"),
    extra_keys_for(("adapter-a", "digest-a1"), "tenant-1"),
]
# mostly the first two domains, so that requests meet each other's prefixes
_domain_indices = st.sampled_from([0, 0, 0, 0, 1, 1, 2, 3, 4, 5])
_tokens = st.lists(st.integers(0, 3), min_size=0, max_size=6)

# The KV a position holds depends on the adapter, the salt and the whole prefix; the model
# below writes exactly that into simulated block memory, so a wrong prefix hit, a missed
# copy-on-write or a bad swap shows up as wrong content.
_Slot = tuple[tuple[ExtraKey, ...], tuple[int, ...]] | None


def test_blocks_behind_a_sliding_window_are_released_and_stay_cached() -> None:
    """Window 3, blocks of 2: as the computed tokens advance, the blocks no later query can
    read go (hashed ones into the prefix cache); what the next query reads stays."""
    kv = KVCacheManager(num_blocks=8, block_size=2, sliding_window=3)
    tokens = list(range(9))
    assert kv.allocate_slots("a", tokens, 0, 9) is not None  # queries from position 0
    assert kv.num_blocks_held("a") == 5
    assert kv.blocks_held_after(9, 1) == 2  # the next query at 9 reads 7, 8, 9
    assert kv.allocate_slots("a", [*tokens, 9], 9, 1) is not None
    assert kv.num_blocks_held("a") == 2
    table = kv.block_table("a")
    assert table[:3] == [0, 0, 0] and len(table) == 5
    stats = kv.stats()
    assert stats.num_blocks_used == 2 and stats.num_blocks_cached_free == 3
    kv.check_invariants()
    # a new request with the same prefix hits the released (cached) blocks
    hit = kv.get_computed_blocks([*tokens, 9, 10])
    assert hit.num_tokens == 10
    kv.free("a")
    assert kv.all_free_or_cached()


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(num_blocks=1, block_size=1)
        self.device: list[list[_Slot]] = []
        self.host: list[list[_Slot]] = []
        self.live: dict[str, list[int]] = {}
        self.swapped: dict[str, list[int]] = {}
        self.keys: dict[str, tuple[ExtraKey, ...]] = {}
        self.num_created = 0
        self.num_queried = 0
        self.num_hit = 0

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 4]),
        num_blocks=st.sampled_from([2, 6, 16, 48]),
        num_host_blocks=st.sampled_from([0, 4, 48]),
        enable_prefix_caching=st.sampled_from([True, True, True, False]),
        sliding_window=st.sampled_from([0, 0, 1, 3, 6]),
    )
    def setup(
        self, block_size: int, num_blocks: int, num_host_blocks: int, enable_prefix_caching: bool,
        sliding_window: int,
    ) -> None:
        self.manager = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching, num_host_blocks, sliding_window
        )
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]

    # -- the simulated KV memory --

    def expected(self, request_id: str, tokens: Sequence[int], position: int) -> _Slot:
        return (self.keys[request_id], tuple(tokens[: position + 1]))

    def slot(self, block_ids: Sequence[int], position: int) -> _Slot:
        block_size = self.manager.block_size
        return self.device[block_ids[position // block_size]][position % block_size]

    def write(self, request_id: str, start: int) -> None:
        """Applies pending copies, then runs the 'forward' for positions start.. of the request."""
        for src, dst in self.manager.take_pending_copies():
            self.device[dst] = list(self.device[src])
        tokens = self.live[request_id]
        table = self.manager.block_table(request_id)
        block_size = self.manager.block_size
        for position in range(start, len(tokens)):
            block = self.device[table[position // block_size]]
            assert table[position // block_size] in self.held(request_id)
            block[position % block_size] = self.expected(request_id, tokens, position)

    def held(self, request_id: str) -> list[int]:
        """The blocks the request holds: its table past those released behind its window."""
        table = self.manager.block_table(request_id)
        return table[len(table) - self.manager.num_blocks_held(request_id):]

    def first_read(self, tokens: Sequence[int]) -> int:
        """The first position the request's next query reads (its window's start)."""
        window = self.manager.sliding_window
        return max(0, len(tokens) - window + 1) if window else 0

    def new_id(self) -> str:
        self.num_created += 1
        return f"r{self.num_created}"

    def snapshot(self) -> tuple[object, ...]:
        tables = {r: self.manager.block_table(r) for r in self.live}
        return (self.manager.stats(), tables, self.manager.num_free_blocks())

    # -- rules --

    @rule(
        base=st.integers(0, len(_BASES) - 1),
        prefix_len=st.sampled_from([12, 12, 9, 5, 2, 0]),
        tail=_tokens,
        domain=_domain_indices,
    )
    def admit(self, base: int, prefix_len: int, tail: list[int], domain: int) -> None:
        tokens = _BASES[base][:prefix_len] + tail
        if not tokens:
            tokens = [0]
        keys = _DOMAINS[domain]
        cached = self.manager.get_computed_blocks(tokens, keys)
        assert cached.num_tokens < len(tokens)
        assert cached.num_tokens == len(cached.block_ids) * self.manager.block_size
        for position in range(cached.num_tokens):
            assert self.slot(cached.block_ids, position) == (keys, tuple(tokens[: position + 1]))
        before = self.snapshot()
        request_id = self.new_id()
        new_ids = self.manager.allocate_slots(
            request_id, tokens, cached.num_tokens, len(tokens) - cached.num_tokens, keys, cached
        )
        if new_ids is None:
            assert self.snapshot() == before
            assert self.manager.take_pending_copies() == []
            return
        if self.manager.enable_prefix_caching:
            self.num_queried += len(tokens)
            self.num_hit += cached.num_tokens
        self.live[request_id] = list(tokens)
        self.keys[request_id] = keys
        self.write(request_id, cached.num_tokens)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99), new_tokens=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def append(self, index: int, new_tokens: list[int]) -> None:
        request_id = sorted(self.live)[index % len(self.live)]
        old_tokens = self.live[request_id]
        tokens = old_tokens + new_tokens
        before = self.snapshot()
        new_ids = self.manager.allocate_slots(request_id, tokens, len(old_tokens), len(new_tokens))
        if new_ids is None:
            assert self.snapshot() == before
            # what the scheduler does next: preempt the newest request by recompute
            victim_id = max(self.live, key=lambda r: int(r[1:]))
            self.manager.free(victim_id)
            self.manager.record_preemption()
            del self.live[victim_id]
            return
        assert len(set(new_ids)) == len(new_ids)
        self.live[request_id] = tokens
        self.write(request_id, len(old_tokens))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99), proposed=st.lists(st.integers(0, 3), min_size=1, max_size=5),
          num_accepted=st.integers(0, 5))
    def speculate(self, index: int, proposed: list[int], num_accepted: int) -> None:
        """A speculative append: slots for proposals the manager is not told the tokens of,
        a forward over them, then the rejected tail trimmed away."""
        request_id = sorted(self.live)[index % len(self.live)]
        tokens = self.live[request_id]
        before = self.snapshot()
        new_ids = self.manager.allocate_slots(request_id, tokens, len(tokens), len(proposed))
        if new_ids is None:
            assert self.snapshot() == before
            return
        self.live[request_id] = tokens + proposed
        self.write(request_id, len(tokens))
        kept = tokens + proposed[:num_accepted]
        self.manager.trim(request_id, len(kept))
        self.live[request_id] = kept

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99))
    def fork(self, index: int) -> None:
        parent_id = sorted(self.live)[index % len(self.live)]
        child_id = self.new_id()
        self.manager.fork(parent_id, child_id)
        self.live[child_id] = list(self.live[parent_id])
        self.keys[child_id] = self.keys[parent_id]

    @precondition(lambda self: self.live or self.swapped)
    @rule(index=st.integers(0, 99))
    def free(self, index: int) -> None:
        request_ids = sorted([*self.live, *self.swapped])
        request_id = request_ids[index % len(request_ids)]
        self.manager.free(request_id)
        self.live.pop(request_id, None)
        self.swapped.pop(request_id, None)
        assert not self.manager.has_request(request_id)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99))
    def swap_out(self, index: int) -> None:
        request_id = sorted(self.live)[index % len(self.live)]
        table = self.manager.block_table(request_id)
        can_swap = self.manager.can_swap_out(request_id)
        before = self.snapshot()
        pairs = self.manager.swap_out(request_id)
        if pairs is None:
            assert not can_swap
            assert self.snapshot() == before
            return
        assert can_swap
        assert [device for device, _ in pairs] == table[len(table) - len(pairs):]
        assert len(table) - len(pairs) <= self.first_read(self.live[request_id]) // (
            self.manager.block_size)
        for device, host in pairs:
            self.host[host] = list(self.device[device])
        self.swapped[request_id] = self.live.pop(request_id)
        self.manager.record_preemption()

    @precondition(lambda self: self.swapped)
    @rule(index=st.integers(0, 99))
    def swap_in(self, index: int) -> None:
        request_id = sorted(self.swapped)[index % len(self.swapped)]
        can_swap = self.manager.can_swap_in(request_id)
        before = self.snapshot()
        pairs = self.manager.swap_in(request_id)
        if pairs is None:
            assert not can_swap
            assert self.snapshot() == before
            return
        assert can_swap
        for host, device in pairs:
            self.device[device] = list(self.host[host])
        self.live[request_id] = self.swapped.pop(request_id)

    @rule(base=st.integers(0, len(_BASES) - 1), tail=_tokens, domain=_domain_indices)
    def probe(self, base: int, tail: list[int], domain: int) -> None:
        tokens = _BASES[base] + tail
        keys = _DOMAINS[domain]
        cached = self.manager.get_computed_blocks(tokens, keys)
        for position in range(cached.num_tokens):
            assert self.slot(cached.block_ids, position) == (keys, tuple(tokens[: position + 1]))

    @rule(victim=st.sampled_from(["adapter-a", "adapter-b"]))
    def drop_cached(self, victim: str) -> None:
        def matches(keys: tuple[ExtraKey, ...]) -> bool:
            return any(key[0] == "adapter" and key[1] == victim for key in keys)

        self.manager.drop_cached(matches)
        for domain in filter(matches, _DOMAINS):
            assert self.manager.get_computed_blocks(_BASES[0] * 2, domain).num_tokens == 0

    # -- checks --

    @invariant()
    def consistent(self) -> None:
        self.manager.check_invariants()
        block_size = self.manager.block_size
        num_tokens = num_slots = 0
        for request_id, tokens in self.live.items():
            table = self.manager.block_table(request_id)
            assert len(table) == math.ceil(len(tokens) / block_size)
            assert self.manager.num_tokens(request_id) == len(tokens)
            num_released = len(table) - self.manager.num_blocks_held(request_id)
            # everything the next query reads is kept, and only what it cannot read went
            assert num_released * block_size <= self.first_read(tokens)
            for position in range(num_released * block_size, len(tokens)):
                assert self.slot(table, position) == self.expected(request_id, tokens, position)
            num_tokens += len(tokens) - num_released * block_size
            num_slots += (len(table) - num_released) * block_size
        stats = self.manager.stats()
        assert stats.num_blocks_used + stats.num_blocks_free + stats.num_blocks_cached_free == (
            stats.num_blocks_total
        )
        assert stats.kv_utilization == pytest.approx(num_tokens / num_slots if num_slots else 0)
        assert stats.prefix_cache_queried_tokens == self.num_queried
        assert stats.prefix_cache_hit_tokens == self.num_hit
        for request_id in self.swapped:
            assert is_swapped(self.manager, request_id)

    def teardown(self) -> None:
        for request_id in [*self.live, *self.swapped]:
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self.manager.all_free_or_cached()
        stats = self.manager.stats()
        assert stats.num_blocks_used == 0 and stats.num_host_blocks_used == 0


KVCacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase


def _chain(token_ids: Sequence[int], keys: tuple[ExtraKey, ...],
           ) -> list[tuple[bytes, BlockKey]]:
    out: list[tuple[bytes, BlockKey]] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - BS + 1, BS):
        tokens = tuple(token_ids[start:start + BS])
        block_hash = hash_block(parent, tokens, keys)
        out.append((block_hash, (parent, tokens, keys)))
        parent = block_hash
    return out


def test_imported_blocks_are_cached_hits_and_never_preempt_a_request() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    assert prefill(manager, "held", list(range(100, 115))) is not None  # 4 blocks in use
    prompt = list(range(13))  # 3 full blocks before the last token
    placed = manager.import_cached(_chain(prompt[:12], ADAPTER_A))
    # two free blocks: the chain stops there, the request's blocks untouched
    assert [index for _, index in placed] == [0, 1]
    assert manager.num_blocks_held("held") == 4
    assert hit_tokens(manager, prompt, ADAPTER_A) == 8
    assert hit_tokens(manager, prompt, ADAPTER_A_V2) == 0  # another digest: not its blocks
    # ref count 0: allocatable, with the chain's first block evicted last
    assert manager.num_free_blocks() == 2
    assert [b for b, _ in manager.cached_run(prompt, ADAPTER_A)] == [b for b, _ in placed]
    # importing again keeps what is cached and places nothing twice
    manager.free("held")
    again = manager.import_cached(_chain(prompt[:12], ADAPTER_A))
    assert [index for _, index in again] == [2]
    assert hit_tokens(manager, prompt, ADAPTER_A) == 12
    assert manager.import_cached(_chain(prompt[:12], ADAPTER_A)) == []
    # a chain whose cached block has another key stops there
    first_hash, (parent, tokens, _) = _chain(prompt[:4], ADAPTER_A)[0]
    assert manager.import_cached([(first_hash, (parent, tokens, ADAPTER_B))]) == []
    manager.check_invariants()
    assert manager.all_free_or_cached()
