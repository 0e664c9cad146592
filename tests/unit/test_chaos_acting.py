"""The soak's notion of an acting operator replica (kopf peering's rule), used to end an
operator fault only once a replica acts again."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from testbed.chaos.rig import acting_priority

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def peer(priority: int, seen_ago: float, lifetime: float = 30) -> dict[str, object]:
    return {"priority": priority, "lifetime": lifetime,
            "lastseen": (NOW - timedelta(seconds=seen_ago)).isoformat()}  # fmt: skip


def test_a_killed_replicas_unexpired_keepalive_still_outranks_the_standby() -> None:
    peers = {"killed": peer(1000, seen_ago=5), "standby": peer(999, seen_ago=2)}
    assert acting_priority(peers, NOW) == 1000  # the standby waits: nobody acts


def test_once_the_keepalive_expires_the_standby_acts() -> None:
    peers = {"killed": peer(1000, seen_ago=31), "standby": peer(999, seen_ago=2)}
    assert acting_priority(peers, NOW) == 999


def test_no_live_peer_and_junk_entries() -> None:
    assert acting_priority({}, NOW) is None
    assert acting_priority({"gone": None, "x": {"priority": 3}}, NOW) is None  # type: ignore[dict-item]
