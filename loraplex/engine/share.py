"""Whose request it is, as the scheduler weighs it (engine/fairness.py): the tenant, its
weight, its class and its KV cap, with their bounds. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from loraplex.errors import InvalidRequestError

Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[str, ...] = ("interactive", "batch")
MIN_WEIGHT = 0.01  # the registry's bounds (registry/models.py)
MAX_WEIGHT = 1000.0


def check_share(weight: object, priority: object, max_kv_fraction: object) -> None:
    """Refuses a weight, class or KV fraction that the scheduler cannot use, naming it."""
    if (isinstance(weight, bool) or not isinstance(weight, int | float)
            or not math.isfinite(weight) or not MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise InvalidRequestError(f"weight must be a number >= {MIN_WEIGHT:g} and <= "
                                  f"{MAX_WEIGHT:g}, got {weight!r}", param="weight")
    if priority not in PRIORITIES:
        raise InvalidRequestError(f"priority class must be one of {', '.join(PRIORITIES)}, "
                                  f"got {priority!r}", param="priority_class")
    if max_kv_fraction is not None and (
            isinstance(max_kv_fraction, bool) or not isinstance(max_kv_fraction, int | float)
            or not math.isfinite(max_kv_fraction) or not 0 < max_kv_fraction <= 1):
        raise InvalidRequestError("max_kv_fraction must be a number > 0 and <= 1, got "
                                  f"{max_kv_fraction!r}", param="max_kv_fraction")


@dataclass(frozen=True)
class Share:
    """Whose request this is, as the scheduler weighs it: the tenant (an opaque id the
    gateway sets; None for the offline ``LLM`` unless given), its weight, its class, and
    the fraction of the KV pool its running requests may hold (None: the server's)."""

    tenant: str | None = None
    weight: float = 1.0
    priority: Priority = "interactive"
    max_kv_fraction: float | None = None

    def __post_init__(self) -> None:
        check_share(self.weight, self.priority, self.max_kv_fraction)


NO_SHARE = Share()
