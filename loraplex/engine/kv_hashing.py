"""A KV block's identity: the tagged extra keys of a request's blocks and the chained hash
of a full block. The prefix cache, the request, every tier outside the pool and the
routers all key blocks by these, so none of them needs the cache manager to compute one.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

ExtraKey = tuple[str, ...]
"""A tagged field of a block's cache key, e.g. ``("adapter", id, digest)``, ``("salt", s)``."""

_HASH_DOMAIN = b"loraplex.kv.block.v1"


def extra_keys_for(adapter: tuple[str, str] | None, cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """The extra keys of a request's blocks: its adapter identity and its cache salt.

    ``adapter`` is ``(adapter_id, content_digest)``; ``None`` means the base model. Every
    field carries a tag, so an adapter id can never collide with a salt, and a re-upload
    under the same id (new digest) is a separate cache domain.
    """
    keys: list[ExtraKey] = []
    if adapter is not None:
        adapter_id, digest = adapter
        if not adapter_id or not digest:
            raise ValueError(f"adapter needs a non-empty id and digest, got {adapter!r}")
        keys.append(("adapter", adapter_id, digest))
    if cache_salt is not None:
        keys.append(("salt", cache_salt))
    return tuple(keys)


def _encode_field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def hash_block(
    parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...]
) -> bytes:
    """The chained prefix-cache hash of one full block (sha256, 32 bytes).

    The encoding is unambiguous: every variable-length part is length- or count-prefixed,
    so no choice of tokens, adapter ids or salts can make two different keys encode alike.
    """
    digest = hashlib.sha256(_HASH_DOMAIN)
    if parent is None:
        digest.update(b"\x00")
    else:
        digest.update(b"\x01" + _encode_field(parent))
    digest.update(struct.pack("<Q", len(token_ids)))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(struct.pack("<Q", len(extra_keys)))
    for key in extra_keys:
        digest.update(struct.pack("<Q", len(key)))
        for part in key:
            if not isinstance(part, str):
                raise TypeError(f"extra key fields must be str, got {part!r} in {key!r}")
            digest.update(_encode_field(part.encode("utf-8")))
    return digest.digest()


def normalize_extra_keys(extra_keys: Sequence[Sequence[str]]) -> tuple[ExtraKey, ...]:
    return tuple(tuple(key) for key in extra_keys)


# What a registered block's hash stands for; compared on every hit so that a hash
# collision can never serve another prompt's (or another tenant's) KV.
BlockKey = tuple[bytes | None, tuple[int, ...], tuple[ExtraKey, ...]]


def prefix_chain(token_ids: Sequence[int], block_size: int, extra_keys: tuple[ExtraKey, ...],
                 max_blocks: int | None = None) -> Iterator[tuple[bytes, BlockKey]]:
    """``(hash, key)`` of each full block of a prompt that a cache hit can cover, chained
    from the first (never the block of the last token: at least one token is always
    computed), at most ``max_blocks``. Lazy: a caller that stops early hashes no more."""
    num_blocks = max(0, (len(token_ids) - 1) // block_size)
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    parent: bytes | None = None
    for start in range(0, num_blocks * block_size, block_size):
        block_tokens = tuple(token_ids[start:start + block_size])
        block_hash = hash_block(parent, block_tokens, extra_keys)
        yield block_hash, (parent, block_tokens, extra_keys)
        parent = block_hash
