"""The soak's notion of an acting operator replica (the Lease's holder, when it is a live
replica), used to end an operator fault only once a replica acts again."""

from __future__ import annotations

from testbed.chaos.rig import acting_replica, replica_identity


def test_a_killed_holder_still_holds_the_lease_and_nobody_acts() -> None:
    # The standby takes over only once it has seen the Lease unrenewed for its duration.
    assert acting_replica(replica_identity(1000), alive={999}) is None


def test_once_the_standby_holds_the_lease_it_acts() -> None:
    assert acting_replica(replica_identity(999), alive={999}) == 999


def test_no_holder_or_a_stranger_is_nobody_acting() -> None:
    assert acting_replica(None, alive={999, 1000}) is None
    assert acting_replica("someone-else_42_abc", alive={999, 1000}) is None
