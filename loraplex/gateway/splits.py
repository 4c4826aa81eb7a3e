"""Which side of a canary split a request takes, decided in the gateway so that every
request reaches the engine as one concrete ``id@digest``.

A request that names a ``user`` is sticky: its side is a hash of the split (owner, name,
canary version) and of the caller's tenant and user, so the same user of the same tenant
sees the same version for as long as that split lasts, and raising the percentage only
moves users onto the canary. A request without ``user`` draws its side at random.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Final

from loraplex.registry.models import Adapter
from loraplex.registry.versions import Resolution

_UNIT: Final = float(2**64)


def user_point(canary: Adapter, caller_tenant_id: int, user: str) -> float:
    """Where ``user`` of the caller's tenant falls in [0, 1) for the split onto
    ``canary`` (the same point for every request of the split)."""
    # Length-prefixed fields: no user string can pose as another tenant's.
    key = f"{canary.tenant_id}\0{canary.name}\0{canary.id}\0{caller_tenant_id}\0{len(user)}\0"
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass") +
                            user.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / _UNIT


def choose_version(resolution: Resolution, caller_tenant_id: int,
                   user: str | None) -> Adapter:
    """The version this request gets: the canary for ``canary_percent`` of requests
    (of users, when ``user`` is given), else the current version."""
    canary = resolution.canary
    if canary is None:
        return resolution.current
    point = (user_point(canary, caller_tenant_id, user) if user
             else secrets.randbits(53) / float(2**53))
    return canary if point * 100 < resolution.canary_percent else resolution.current
