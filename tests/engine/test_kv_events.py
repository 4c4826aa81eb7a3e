"""KV events and the prefix index a router builds from them (engine/kv_events.py,
engine/prefix_routing.py), held to the cache manager itself: after any run of admissions,
frees and evictions, the index built from the published events names exactly the blocks
the manager has registered, and the router's match for any prompt and identity is exactly
the prefix the engine would hit."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_events import KVEventLog, batch
from loraplex.engine.kv_hashing import extra_keys_for
from loraplex.engine.prefix_routing import (
    PrefixIndex,
    matched_blocks,
    preferred,
    request_hashes,
)

BS = 4
REPLICA = "replica-a"
ADAPTERS = [None, "sql@" + "a" * 64, "sql@" + "b" * 64]  # a re-upload: same id, new digest
SALTS = [None, "salt-tenant-1", "salt-tenant-2"]


def identity(adapter: str | None, salt: str | None) -> tuple[tuple[str, ...], ...]:
    pair = tuple(adapter.split("@")) if adapter else None
    return extra_keys_for(pair, salt)  # type: ignore[arg-type]


def publish(log: KVEventLog, manager: KVCacheManager, index: PrefixIndex) -> None:
    """One drain, sent as the replica sends it (JSON) into the index."""
    events = log.drain(manager.registered_blocks)
    if events:
        assert index.apply(json.dumps(batch(REPLICA, events)))


def indexed(index: PrefixIndex, replica: str = REPLICA) -> set[bytes]:
    """What the index holds for ``replica`` (its own state: the router only asks it for
    prefix lengths)."""
    return set(index._blocks.get(replica, ()))


def cached_hashes(manager: KVCacheManager) -> set[bytes]:
    return {block_hash for block_hash, _, _ in manager.registered_blocks()}


def admit(manager: KVCacheManager, request_id: str, prompt: list[int],
          keys: tuple[tuple[str, ...], ...]) -> bool:
    cached = manager.get_computed_blocks(prompt, keys)
    return manager.allocate_slots(request_id, prompt, cached.num_tokens,
                                  len(prompt) - cached.num_tokens, keys, cached) is not None


prompts = st.lists(st.integers(0, 3), min_size=1, max_size=14)  # few tokens: prefixes repeat
operations = st.lists(st.tuples(st.sampled_from(["admit", "free", "publish"]), prompts,
                                st.sampled_from(ADAPTERS), st.sampled_from(SALTS)),
                      max_size=40)


@settings(max_examples=150, deadline=None)
@given(operations, st.sampled_from([3, 8, 1000]), st.lists(
    st.tuples(prompts, st.sampled_from(ADAPTERS), st.sampled_from(SALTS)), max_size=8))
def test_the_index_mirrors_the_cache_and_matches_what_the_engine_hits(
        ops: list[tuple[str, list[int], str | None, str | None]], max_pending: int,
        probes: list[tuple[list[int], str | None, str | None]]) -> None:
    log = KVEventLog(BS, max_pending=max_pending)  # 3: overflows, then snapshots
    manager = KVCacheManager(num_blocks=6, block_size=BS, events=log)
    index = PrefixIndex()
    live: list[str] = []
    for number, (op, prompt, adapter, salt) in enumerate(ops):
        if op == "admit":
            if admit(manager, f"r{number}", prompt, identity(adapter, salt)):
                live.append(f"r{number}")
        elif op == "free" and live:
            manager.free(live.pop(0))
        else:
            publish(log, manager, index)
    publish(log, manager, index)
    assert index.longest_prefixes([], [REPLICA]) == {REPLICA: 0}
    held = indexed(index)
    assert held == cached_hashes(manager)
    for prompt, adapter, salt in probes:
        hit = manager.get_computed_blocks(prompt, identity(adapter, salt)).num_tokens
        hashes = request_hashes(prompt, BS, adapter, salt)
        assert matched_blocks(held, hashes) * BS == hit


def test_a_prompt_matches_only_its_own_adapter_version_and_tenant() -> None:
    log = KVEventLog(BS)
    manager = KVCacheManager(num_blocks=16, block_size=BS, events=log)
    index = PrefixIndex()
    prompt = list(range(100, 113))  # 3 full blocks + 1
    assert admit(manager, "a", prompt, identity(ADAPTERS[1], SALTS[1]))
    publish(log, manager, index)
    for adapter, salt, blocks in [(ADAPTERS[1], SALTS[1], 3), (ADAPTERS[1], SALTS[2], 0),
                                  (ADAPTERS[2], SALTS[1], 0), (None, SALTS[1], 0),
                                  (ADAPTERS[1], None, 0)]:
        hashes = request_hashes(prompt, BS, adapter, salt)
        assert index.longest_prefixes(hashes, [REPLICA, "other"]) == {REPLICA: blocks,
                                                                      "other": 0}


def test_events_carry_the_adapter_but_never_the_salt_or_tokens() -> None:
    log = KVEventLog(BS)
    manager = KVCacheManager(num_blocks=16, block_size=BS, events=log)
    prompt = list(range(100, 113))
    assert admit(manager, "a", prompt, identity(ADAPTERS[1], "secret-derived-salt"))
    text = json.dumps(log.drain(manager.registered_blocks))
    events = json.loads(text)
    assert events[0] == ["AllBlocksCleared"]
    stored = events[1]
    assert stored[0] == "BlockStored" and len(stored[1]) == 3 and stored[2] is None
    assert stored[3:] == [[], BS, ADAPTERS[1], "pool"]
    assert "secret-derived-salt" not in text and "100" not in text
    manager.free("a")
    assert log.drain(manager.registered_blocks) == []  # still cached: nothing removed
    assert manager.drop_cached(lambda keys: True) == 3
    [removed] = log.drain(manager.registered_blocks)
    assert removed[0] == "BlockRemoved" and sorted(removed[1]) == sorted(stored[1])


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=70),
                    lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.sampled_from(["replica", "events", "ts"]), inner,
                                      max_size=3), max_leaves=20)
       | st.binary(max_size=40))
def test_the_index_refuses_anything_but_kv_events(message: Any) -> None:
    index = PrefixIndex()
    raw = message if isinstance(message, bytes) else json.dumps(message)
    applied = index.apply(raw)
    assert index.num_refused == (0 if applied else 1)
    if applied:  # only a well-formed batch: hashes are 32 bytes of hex
        assert all(len(h) == 32 for h in indexed(index, message["replica"]))


def test_an_index_starts_over_when_a_replica_says_so_and_bounds_a_replica() -> None:
    index = PrefixIndex()
    a, b = "aa" * 32, "bb" * 32
    assert index.apply(json.dumps(batch(REPLICA, [["BlockStored", [a, b], None, [], 4, None,
                                                    "pool"]])))
    assert indexed(index) == {bytes.fromhex(a), bytes.fromhex(b)}
    assert index.apply(json.dumps(batch(REPLICA, [["AllBlocksCleared"], ["BlockStored", [b],
                                                   None, [], 4, None, "pool"]])))
    assert indexed(index) == {bytes.fromhex(b)}
    assert not index.apply(json.dumps(batch(REPLICA, [["BlockStored", ["ab"], None]])))
    assert indexed(index) == {bytes.fromhex(b)}  # a refused batch changes nothing


@pytest.mark.parametrize(("matched", "in_flight", "expected"), [
    ({"r0": 0, "r1": 0}, {}, []),  # nothing cached anywhere: route as without prefixes
    ({"r0": 3, "r1": 1}, {"r0": 2, "r1": 0}, ["r0"]),  # longest wins while it has room
    ({"r0": 3, "r1": 1}, {"r0": 4, "r1": 0}, []),  # full: load wins
    ({"r0": 2, "r1": 2}, {"r0": None, "r1": 9}, ["r0"]),  # unknown load counts as room
    ({"r0": 2, "r1": 2}, {"r0": 1, "r1": 1}, ["r0", "r1"]),
])
def test_the_longest_prefix_goes_first_while_its_replica_has_room(
        matched: dict[str, int], in_flight: dict[str, int | None], expected: list[str]) -> None:
    assert preferred(matched, in_flight, room=4) == expected
