"""The gateway's split function over thousands of users: each side's share is within 2
percentage points of the split's percentage, a user's side never changes during a split,
raising the percentage only moves users onto the canary, and requests without a user are
drawn at random in the same proportion."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

import pytest

from loraplex.gateway.splits import choose_version, user_point
from loraplex.registry.models import Adapter, Tenant
from loraplex.registry.versions import Resolution

NUM_USERS = 5000


def _version(tenant_id: int, version: int, adapter_id: int) -> Adapter:
    row = Adapter(id=adapter_id, tenant_id=tenant_id, name="bot", version=version,
                  digest=f"{version:064d}", created_at=datetime.now(UTC))
    row.tenant = Tenant(id=tenant_id, name="acme", status="active")
    return row


CURRENT, CANARY = _version(1, 1, 11), _version(1, 2, 12)


def _split(percent: float) -> Resolution:
    return Resolution(CURRENT, CANARY, percent)


@pytest.mark.parametrize("percent", [0, 1, 10, 25, 50, 90, 100])
def test_sticky_shares_are_within_two_points(percent: float) -> None:
    users = [f"user-{i}" for i in range(NUM_USERS)]
    sides = [choose_version(_split(percent), 7, user).version for user in users]
    share = 100 * Counter(sides)[2] / NUM_USERS
    assert abs(share - percent) <= 2, share
    if percent in (0, 100):
        assert share == percent  # the ends are exact
    # The same user always gets the same side during the split.
    assert [choose_version(_split(percent), 7, user).version for user in users] == sides


def test_raising_the_percentage_only_moves_users_onto_the_canary() -> None:
    users = [f"u{i}" for i in range(NUM_USERS)]
    previous: set[str] = set()
    for percent in (5, 10, 30, 60, 100):
        on_canary = {u for u in users if choose_version(_split(percent), 3, u) is CANARY}
        assert previous <= on_canary
        previous = on_canary


def test_tenants_users_and_splits_are_independent() -> None:
    """The same user string of two tenants, or the same user under a new canary, falls at
    unrelated points: their agreement is the chance one (about p² + (1-p)²)."""
    users = [f"user-{i}" for i in range(NUM_USERS)]
    other_canary = _version(1, 3, 13)
    for a, b in (((CANARY, 1), (CANARY, 2)), ((CANARY, 1), (other_canary, 1))):
        same = sum((user_point(a[0], a[1], u) < 0.5) == (user_point(b[0], b[1], u) < 0.5)
                   for u in users)
        assert abs(100 * same / NUM_USERS - 50) <= 2.5


def test_requests_without_a_user_are_drawn_in_proportion() -> None:
    draws = 20000
    for user in (None, ""):
        sides = Counter(choose_version(_split(20), 7, user).version for _ in range(draws))
        assert abs(100 * sides[2] / draws - 20) <= 2, sides


def test_no_split_is_always_the_current_version() -> None:
    assert choose_version(Resolution(CURRENT), 1, "anyone") is CURRENT
    assert choose_version(Resolution(CURRENT), 1, None) is CURRENT
