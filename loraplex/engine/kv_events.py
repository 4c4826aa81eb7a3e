"""KV events: what an engine's prefix cache stores and evicts, for a router to follow.

The shape is that of vLLM's KV events, which llm-d's router consumes: a batch
``{"ts", "replica", "events"}`` whose events are tagged lists,

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium]``: full blocks now in the cache, each the child of the one before it (the first
  of ``parent_block_hash``);
- ``["BlockRemoved", block_hashes, medium]``;
- ``["AllBlocksCleared"]``: forget everything this replica published before.

The hashes are the prefix cache's own (hex): a chain over the block's tokens *and* its
extra keys (adapter ``id@digest``, tenant salt), so one hash names one identity and a router
that matches hashes never matches a block across adapters or tenants. ``lora_id`` is
``id@digest`` or None; ``token_ids`` is always empty (prompts stay out of Redis: the hash
carries them) and the salt is never published. ``medium`` is ``"pool"``.

Bounded: the log holds at most ``max_pending`` events between drains; past that it keeps
none and the next drain sends ``AllBlocksCleared`` and a snapshot of the cache instead (so
a batch holds at most max(max_pending, pool blocks) hashes). Pure Python.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from loraplex.engine.kv_cache import RegisteredBlock
from loraplex.engine.kv_hashing import ExtraKey

MEDIUM: Final = "pool"
MAX_PENDING: Final = 8192


def lora_id(extra_keys: tuple[ExtraKey, ...]) -> str | None:
    """``id@digest`` of the adapter among a block's extra keys, None for the base model."""
    for key in extra_keys:
        if key[0] == "adapter":
            return f"{key[1]}@{key[2]}"
    return None


@dataclass
class KVEventLog:
    """The prefix cache's stores and removals since the last ``drain`` (engine thread)."""

    block_size: int
    max_pending: int = MAX_PENDING
    _events: list[list[Any]] = field(default_factory=list)
    _pending: int = 0
    _resync: bool = True  # the first batch tells routers to drop what they had

    def stored(self, block_hash: bytes, parent: bytes | None,
               extra_keys: tuple[ExtraKey, ...]) -> None:
        if self._room():
            self._append_stored(block_hash, parent, extra_keys)

    def removed(self, block_hash: bytes) -> None:
        if not self._room():
            return
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockRemoved":
            last[1].append(block_hash.hex())
        else:
            self._events.append(["BlockRemoved", [block_hash.hex()], MEDIUM])

    def drain(self, registered: Callable[[], Iterable[RegisteredBlock]]) -> list[list[Any]]:
        """The events since the last drain, oldest first. After an overflow (or on the
        first drain), ``AllBlocksCleared`` and every block ``registered()`` lists."""
        if self._resync:
            self._events, self._pending, self._resync = [], 0, False
            self._events.append(["AllBlocksCleared"])
            for block in registered():  # as many as the pool holds
                self._append_stored(*block)
        events, self._events, self._pending = self._events, [], 0
        return events

    def resync(self) -> None:
        """The events since the last drain were lost on the way: the next drain sends
        ``AllBlocksCleared`` and a snapshot."""
        self._resync = True
        self._events, self._pending = [], 0

    def _append_stored(self, block_hash: bytes, parent: bytes | None,
                       extra_keys: tuple[ExtraKey, ...]) -> None:
        lora = lora_id(extra_keys)
        last = self._events[-1] if self._events else None
        # A block that continues the last stored run (same chain, same adapter) joins it.
        if last is not None and last[0] == "BlockStored" and last[5] == lora \
                and parent is not None and last[1][-1] == parent.hex():
            last[1].append(block_hash.hex())
        else:
            self._events.append(["BlockStored", [block_hash.hex()],
                                 parent.hex() if parent is not None else None, [],
                                 self.block_size, lora, MEDIUM])

    def _room(self) -> bool:
        if self._resync:
            return False  # the snapshot the next drain sends covers it
        if self._pending >= self.max_pending:
            self._resync = True
            self._events = []
            return False
        self._pending += 1
        return True


def batch(replica: str, events: list[list[Any]]) -> dict[str, Any]:
    """One message of events from ``replica`` (its Serve replica id)."""
    return {"ts": time.time(), "replica": replica, "events": events}
