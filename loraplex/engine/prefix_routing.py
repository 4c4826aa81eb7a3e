"""Prefix-aware routing: which replica caches the longest prefix of a request.

Every gateway follows the replicas' KV events (``kv_events.py``, through Redis) into a
``PrefixIndex``: per replica, the block hashes its prefix cache holds. A request's own
hashes come from its prompt, adapter identity and tenant salt exactly as its engine will
compute them (``kv_hashing.prefix_chain``), so a replica only ever matches blocks of the same
adapter version for the same tenant: a tenant's prompt never draws it to a replica that
caches another tenant's blocks of the same text.

How the router weighs it (``ray_router.PrefixAwareRouter``): first the replicas that cache
the longest prefix (one full block at least), while one of them has fewer than
``max_num_seqs`` requests in flight (room in its running batch); after them, and for every
request that matches nothing, the routing without it: replicas that hold the request's
adapter, then the less loaded of two at random. An index with no events routes as today.

Pure Python: the Serve router that uses it lives in ``ray_router.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from loraplex.engine.kv_hashing import extra_keys_for, prefix_chain

MAX_ROUTED_BLOCKS: Final = 1024  # a prompt's first 1024 blocks count (16k tokens at 16)
# A replica whose events claim more blocks than this is dropped from the index (no pool is
# that large; a bad publisher must not grow a gateway's memory without bound).
MAX_REPLICA_BLOCKS: Final = 1 << 21
FORGET_SILENT_S: Final = 120.0  # a replica Serve no longer lists, silent this long, goes


def request_hashes(prompt_token_ids: Sequence[int], block_size: int, adapter_key: str | None,
                   cache_salt: str | None) -> list[bytes]:
    """The prefix-cache hashes of the prompt's full blocks that a cache hit can cover (the
    last prompt token is always computed), for ``adapter_key`` (``id@digest``, or None for
    the base model) and the tenant's salt."""
    adapter: tuple[str, str] | None = None
    if adapter_key:
        adapter_id, _, digest = adapter_key.partition("@")
        adapter = (adapter_id, digest)
    keys = extra_keys_for(adapter, cache_salt)
    return [block_hash for block_hash, _ in prefix_chain(prompt_token_ids, block_size, keys,
                                                          MAX_ROUTED_BLOCKS)]


def matched_blocks(blocks: set[bytes], hashes: Sequence[bytes]) -> int:
    """How many of ``hashes`` are in ``blocks``, from the first on."""
    count = 0
    for block_hash in hashes:
        if block_hash not in blocks:
            break
        count += 1
    return count


class PrefixIndex:
    """Which blocks each replica caches, from its KV events. Written by the gateway's
    event follower, read by Serve's router in another thread: each change to a replica's
    set is one step for a reader (a set replaced, or updated by one C call)."""

    def __init__(self) -> None:
        self._blocks: dict[str, set[bytes]] = {}
        self._heard: dict[str, float] = {}  # replica -> when its last batch came
        self._lock = threading.Lock()  # writers only; readers look up one set at a time
        self.num_refused = 0  # batches that were not KV events (never applied)

    def apply(self, message: bytes | str) -> bool:
        """Applies one published batch (JSON); False, and counted, for anything else."""
        try:
            parsed = json.loads(message)
            replica = parsed["replica"]
            events = parsed["events"]
            if not isinstance(replica, str) or not isinstance(events, list):
                raise TypeError("replica or events")
            changes = [_change(event) for event in events]
        except (ValueError, TypeError, KeyError, IndexError):
            self.num_refused += 1
            return False
        with self._lock:
            blocks = self._blocks.setdefault(replica, set())
            for kind, hashes in changes:
                if kind == "clear":
                    blocks = self._blocks[replica] = set()
                elif kind == "store":
                    blocks.update(hashes)  # one step each (bytes hash in C, under the GIL)
                else:
                    blocks.difference_update(hashes)
            if len(blocks) > MAX_REPLICA_BLOCKS:
                self._blocks[replica] = set()
                self.num_refused += 1
            self._heard[replica] = time.monotonic()
        return True

    def longest_prefixes(self, hashes: Sequence[bytes],
                         replicas: Iterable[str]) -> dict[str, int]:
        """For each replica, how many of ``hashes`` it caches from the first on."""
        return {replica: matched_blocks(self._blocks.get(replica, set()), hashes)
                for replica in replicas}

    def retain(self, live: Iterable[str]) -> None:
        """Drops replicas not in ``live`` that have been silent for FORGET_SILENT_S (a
        replica Serve replaced; one just started may publish before Serve lists it)."""
        keep = set(live)
        now = time.monotonic()
        with self._lock:
            for replica in [r for r in self._heard if r not in keep
                            and now - self._heard[r] > FORGET_SILENT_S]:
                self._blocks.pop(replica, None)
                del self._heard[replica]


def preferred(matched: Mapping[str, int], in_flight: Mapping[str, int | None],
              room: int) -> list[str]:
    """The replicas to try first: those with the longest match (one block at least) that
    have fewer than ``room`` requests in flight (unknown counts as room; Serve's own probe
    still refuses a full replica). Empty: route as without prefixes."""
    best = max(matched.values(), default=0)
    if best == 0:
        return []
    return [replica for replica, count in matched.items()
            if count == best and (in_flight.get(replica) or 0) < room]


# Serve constructs its router itself, in the gateway's process: the gateway's backend puts
# the index its event follower fills here, under the application's name, for it to find.
_INDEXES: dict[str, PrefixIndex] = {}


def register_index(app_name: str, index: PrefixIndex) -> None:
    _INDEXES[app_name] = index


def unregister_index(app_name: str, index: PrefixIndex) -> None:
    if _INDEXES.get(app_name) is index:
        del _INDEXES[app_name]


def index_for(app_name: str) -> PrefixIndex | None:
    return _INDEXES.get(app_name)


def _change(event: Any) -> tuple[str, list[bytes]]:
    """("clear" | "store" | "remove", hashes) of one event; ValueError/TypeError if it is
    not one."""
    if not isinstance(event, list) or not event:
        raise TypeError("an event is a non-empty list")
    kind = event[0]
    if kind == "AllBlocksCleared":
        return "clear", []
    if kind not in ("BlockStored", "BlockRemoved"):
        raise ValueError(f"unknown event {kind!r}")
    if not isinstance(event[1], list):
        raise TypeError("block_hashes")
    hashes = [bytes.fromhex(h) for h in event[1]]  # TypeError/ValueError on anything else
    if any(len(h) != 32 for h in hashes):
        raise ValueError("a block hash is 32 bytes")
    return ("store" if kind == "BlockStored" else "remove"), hashes
