"""Adapter stores for tests of the store alone (no registry database): owned by a made-up
registry id, as ``registry.ownership.open_store`` leaves a real registry's store."""

from __future__ import annotations

from pathlib import Path

from loraplex.registry.store import AdapterStore, StoreOwner

TEST_REGISTRY_ID = "0" * 32


def owned_store(root: Path, registry_id: str = TEST_REGISTRY_ID) -> AdapterStore:
    """The store at ``root``, claimed for ``registry_id`` and opened for it."""
    store = AdapterStore(root, registry_id)
    store.write_owner(StoreOwner(registry_id, "test"), replacing=None)
    return store
