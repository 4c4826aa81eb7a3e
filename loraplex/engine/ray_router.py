"""The Serve request router of the engine replicas: prefix-aware, then as Serve routes.

Serve builds it in each gateway's process from the deployment's ``request_router_config``
(``ray_replica.make_deployment``) and calls ``choose_replicas`` for every request; the
index it reads is the one that gateway's backend fills from the replicas' KV events
(``prefix_routing.index_for``). How prefixes, adapter affinity and load are weighed is
``prefix_routing``'s docstring. Imported only in Ray mode.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from loraplex.engine.prefix_routing import index_for, preferred, request_hashes


class PrefixAwareRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Replicas caching the request's longest prefix first; then Serve's own policy
    (adapter affinity through multiplexed model ids, else two random replicas, the less
    loaded of which Serve takes)."""

    def initialize_state(self, block_size: int = 16, room: int = 1, **_: Any) -> None:
        self._block_size = block_size
        self._room = room

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        today = self._as_without_prefixes(pending_request)
        first = self._longest_prefix(candidate_replicas, pending_request)
        return [first, *today] if first else today

    def _longest_prefix(self, candidates: list[RunningReplica],
                        pending: PendingRequest | None) -> list[RunningReplica]:
        index = index_for(self.app_name)
        if index is None or pending is None or len(pending.args) < 3:
            return []
        index.retain(r.replica_id.unique_id for r in self.curr_replicas.values())
        prompt, _, cache_salt = pending.args[:3]
        key = pending.metadata.multiplexed_model_id or (
            pending.args[4] if len(pending.args) > 4 else "")
        hashes = request_hashes(prompt, self._block_size, key or None, cache_salt)
        if not hashes:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidates}
        in_flight = {rid: self._replica_queue_len_cache.get(r.replica_id)
                     for rid, r in by_id.items()}
        return [by_id[rid] for rid in preferred(index.longest_prefixes(hashes, by_id),
                                                in_flight, self._room)]

    def _as_without_prefixes(self, pending: PendingRequest | None,
                             ) -> list[list[RunningReplica]]:
        """Serve's default policy (its power-of-two router): replicas holding the
        multiplexed model id when there is one, else by locality; two of them at random."""
        if pending is not None and pending.metadata.multiplexed_model_id:
            ids = self.apply_multiplex_routing(pending_request=pending)
        else:
            ids = self.apply_locality_routing(pending_request=pending)
        chosen = random.sample(sorted(ids, key=str), k=min(2, len(ids)))
        return [[self._replicas[rid] for rid in chosen]] if chosen else []
