"""A KV block's portable form (engine/kv_blocks.py) and the block manager's side of a lower
tier (evictions reported with their identity, prefixes continued into the tier, loads
claimed into fresh blocks): pure Python, no model."""

from __future__ import annotations

import dataclasses

import pytest

from loraplex.engine.kv_blocks import (
    BlockIdentity,
    BlockRefused,
    KVLayout,
    PortableBlock,
    decode_block,
    encode_block,
    encoded_size,
    read_header,
)
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_hashing import extra_keys_for, hash_block

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
FP = "ab" * 32
KEYS = extra_keys_for(("r4", "d" * 64), "salt-a")


def _block(tokens: tuple[int, ...] = (1, 2, 3, 4), parent: bytes | None = None,
           keys: tuple[tuple[str, ...], ...] = KEYS) -> PortableBlock:
    ident = BlockIdentity(hash_block(parent, tokens, keys), parent, tokens, keys)
    return PortableBlock(ident, FP, LAYOUT, bytes(range(256)) * (LAYOUT.data_bytes // 256))


def test_round_trip_keeps_the_whole_identity() -> None:
    block = _block(parent=b"\x07" * 32)
    raw = encode_block(block)
    assert len(raw) == encoded_size(block)
    assert decode_block(raw, FP, LAYOUT) == block
    header = read_header(raw)
    assert header.identity.extra_keys == KEYS  # adapter id@digest and the salt's value
    assert header.total_bytes == len(raw)


@pytest.mark.parametrize("damage, reason", [
    (lambda raw: raw[:-1], "truncated"),
    (lambda raw: raw[:100], "truncated"),
    (lambda raw: raw[:5], "truncated"),
    (lambda raw: raw[:-40] + bytes([raw[-40] ^ 1]) + raw[-39:], "checksum"),
    (lambda raw: raw + b"\x00", "malformed"),
    (lambda raw: b"NOTABLOCK" + raw[9:], "malformed"),
])
def test_damaged_bytes_are_refused(damage: object, reason: str) -> None:
    raw = encode_block(_block())
    with pytest.raises(BlockRefused) as info:
        decode_block(damage(raw), FP, LAYOUT)  # type: ignore[operator]
    assert info.value.reason == reason


def test_another_model_dtype_or_layout_is_refused() -> None:
    raw = encode_block(_block())
    with pytest.raises(BlockRefused) as info:
        decode_block(raw, "cd" * 32, LAYOUT)
    assert info.value.reason == "fingerprint"
    bf16 = dataclasses.replace(LAYOUT, dtype="bfloat16")
    with pytest.raises(BlockRefused) as info:
        decode_block(raw, FP, bf16)
    assert info.value.reason == "layout"


def test_a_hash_its_key_does_not_make_is_refused() -> None:
    block = _block()
    # the same data claimed under another tenant's salt, checksum recomputed
    forged = dataclasses.replace(block, identity=dataclasses.replace(
        block.identity, extra_keys=extra_keys_for(("r4", "d" * 64), "salt-b")))
    with pytest.raises(BlockRefused) as info:
        decode_block(encode_block(forged), FP, LAYOUT)
    assert info.value.reason == "identity"


class _FakeTier:
    """A lower tier holding whatever blocks the test puts in it."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, tuple[bytes | None, tuple[int, ...], tuple[object, ...]]] = {}

    def lookup(self, block_hash: bytes, key: tuple[object, ...]) -> bool:
        return self.blocks.get(block_hash) == key


def test_evictions_are_reported_and_prefixes_continue_into_the_lower_tier() -> None:
    tier = _FakeTier()
    kv = KVCacheManager(num_blocks=4, block_size=4, lower_tier=tier)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    assert kv.allocate_slots("a", prompt, 0, len(prompt), KEYS) is not None
    kv.free("a")
    assert kv.take_evictions() == []
    other = list(range(100, 113))
    assert kv.allocate_slots("b", other, 0, len(other), KEYS) is not None
    evicted = kv.take_evictions()
    # a's 3 hashed blocks were evicted (its partial fourth was pure free)
    assert len(evicted) == 3
    for e in evicted:
        assert hash_block(e.parent_hash, e.token_ids, e.extra_keys) == e.block_hash
        assert e.extra_keys == KEYS
        tier.blocks[e.block_hash] = (e.parent_hash, e.token_ids, e.extra_keys)
    kv.free("b")
    cached = kv.get_computed_blocks(prompt, KEYS)
    assert cached.block_ids == () and len(cached.lower_hashes) == 3 and cached.num_tokens == 12
    # another salt never finds them
    assert kv.get_computed_blocks(prompt, extra_keys_for(None, "salt-b")).num_tokens == 0
    assert kv.allocate_slots("a2", prompt, 12, 1, KEYS, cached) is not None
    loads = kv.take_pending_loads()
    assert [h for _, h in loads] == list(cached.lower_hashes)
    assert kv.stats().lower_tier_hit_tokens == 12
    assert kv.stats().prefix_cache_hit_tokens == 0
    # registered at once: a second request hits them in the pool
    assert kv.get_computed_blocks(prompt, KEYS).block_ids == tuple(b for b, _ in loads)
    kv.free("a2")
    kv.check_invariants()
    assert kv.all_free_or_cached()


def test_a_block_taken_again_before_its_load_loses_the_load() -> None:
    tier = _FakeTier()
    kv = KVCacheManager(num_blocks=2, block_size=4, lower_tier=tier)
    prompt = [1, 2, 3, 4, 5]
    h = hash_block(None, (1, 2, 3, 4), ())
    tier.blocks[h] = (None, (1, 2, 3, 4), ())
    cached = kv.get_computed_blocks(prompt)
    assert kv.allocate_slots("a", prompt, 4, 1, (), cached) is not None
    kv.free("a")  # its loaded block goes to the cached queue, its KV still due
    assert kv.allocate_slots("b", [9] * 8, 0, 8, ()) is not None  # takes both blocks
    assert kv.take_pending_loads() == []  # the slot is b's now: nothing may be written
    assert kv.take_evictions() == []  # and it held nothing to save
    kv.free("b")
    kv.check_invariants()
