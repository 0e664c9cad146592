"""Leader election on a Lease (controller/leader.py): who may act, and when.

The unit-test boundary: `FakeLeases` is a fake of the Lease API (a compare-and-swap on a
resourceVersion, as the API server does it), and each candidate's monotonic clock is a fake
(`Clock`) that the test moves. The real Lease API is exercised by
tests/integration/test_operator_leadership.py.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
from topotrain.controller.kube import Kube
from topotrain.controller.leader import (
    Elector,
    KubeLeases,
    LeaderTiming,
    LeaseConflict,
    LeaseRecord,
)

TIMING = LeaderTiming(lease_duration=15.0, renew_deadline=10.0, retry_period=2.0)


class Clock:
    """A fake monotonic clock: a replica's own, starting anywhere."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class FakeLeases:
    """A fake Lease API: writes are compare-and-swap on the resourceVersion; `down` fails calls."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0
        self.down = False

    def read(self) -> LeaseRecord | None:
        self._check()
        return self.record

    def create(self, record: LeaseRecord) -> LeaseRecord:
        self._check()
        if self.record is not None:
            raise LeaseConflict("exists")
        return self._store(record)

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        self._check()
        if self.record is None or record.resource_version != self.record.resource_version:
            raise LeaseConflict("changed")
        return self._store(record)

    def _store(self, record: LeaseRecord) -> LeaseRecord:
        self.version += 1
        self.record = replace(record, resource_version=str(self.version))
        return self.record

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("the API server does not answer")


def candidate(store: FakeLeases, name: str, clock: Clock, wall: str = "2026-12-05T10:00:00Z") -> Elector:
    return Elector(store, name, TIMING, clock=clock, wall=lambda: wall)


def test_a_free_lease_is_taken_at_once_and_renewed() -> None:
    store, clock = FakeLeases(), Clock()
    a = candidate(store, "a", clock)
    a.try_once()
    assert a.acting() and store.record is not None and store.record.holder == "a"
    clock.now += 9.9
    assert a.acting()
    a.try_once()  # renewed: the deadline counts from this renewal
    clock.now += 9.9
    assert a.acting() and store.version == 2


def test_a_held_lease_is_taken_only_after_this_replica_saw_it_unrenewed_for_its_duration() -> None:
    """The holder's renewTime is years old by this replica's wall clock (clock skew): it is
    never compared; only the time this replica itself watched the record stay the same counts."""
    store, clock_a, clock_b = FakeLeases(), Clock(5.0), Clock(90_000.0)
    a = candidate(store, "a", clock_a, wall="2001-01-01T00:00:00Z")
    b = candidate(store, "b", clock_b, wall="2031-01-01T00:00:00Z")
    a.try_once()
    b.try_once()  # first sight of a's record: the count starts
    clock_b.now += 14.9
    b.try_once()
    assert not b.acting() and store.record is not None and store.record.holder == "a"
    clock_b.now += 0.1
    b.try_once()
    assert b.acting() and store.record.holder == "b" and store.record.transitions == 1


def test_a_renewal_restarts_the_standbys_count() -> None:
    store, clock_a, clock_b = FakeLeases(), Clock(), Clock()
    a, b = candidate(store, "a", clock_a), candidate(store, "b", clock_b)
    a.try_once()
    for _ in range(10):  # 10 x 2 s = 20 s, past the lease duration, renewed every 2 s
        b.try_once()
        clock_a.now += 2
        clock_b.now += 2
        a.try_once()
    b.try_once()
    assert a.acting() and not b.acting() and store.record is not None and store.record.holder == "a"


def test_a_leader_that_cannot_renew_stops_before_a_standby_may_take_over() -> None:
    store, clock_a, clock_b = FakeLeases(), Clock(), Clock(7.0)
    a, b = candidate(store, "a", clock_a), candidate(store, "b", clock_b)
    a.try_once()
    b.try_once()
    store.down = True  # a is cut off; b keeps counting from what it last read
    for step in range(20):
        clock_a.now += 1
        clock_b.now += 1
        with pytest.raises(ConnectionError):
            a.try_once()
        assert a.acting() == (step + 1 < TIMING.renew_deadline)
    assert not a.acting()
    store.down = False
    b.try_once()
    assert b.acting() and not a.acting()


def test_a_paused_leader_does_not_act_when_resumed_until_it_holds_the_lease_again() -> None:
    """SIGSTOP, then SIGCONT: the monotonic clock went on, so acting() is false at once,
    before any call; its next try finds the Lease taken and does not take it back."""
    store, clock_a, clock_b = FakeLeases(), Clock(), Clock()
    a, b = candidate(store, "a", clock_a), candidate(store, "b", clock_b)
    a.try_once()
    b.try_once()
    clock_a.now += 30  # paused
    clock_b.now += 15
    b.try_once()
    assert b.acting() and not a.acting()
    a.try_once()
    assert not a.acting() and store.record is not None and store.record.holder == "b"


def test_two_candidates_racing_for_an_expired_lease_only_one_wins() -> None:
    store, clocks = FakeLeases(), [Clock(), Clock(), Clock()]
    old, a, b = (candidate(store, n, c) for n, c in zip("oab", clocks, strict=True))
    old.try_once()
    a.try_once()
    b.try_once()
    for c in clocks[1:]:
        c.now += 16
    record = store.read()
    assert record is not None
    # Both read the same expired record before either writes: the second write is refused.
    store.read = lambda: record  # type: ignore[method-assign]
    a.try_once()
    b.try_once()
    assert (a.acting(), b.acting()) == (True, False)
    assert store.record is not None and store.record.holder == "a"


def test_a_leader_whose_lease_was_written_by_another_stops_at_once() -> None:
    store, clock = FakeLeases(), Clock()
    a = candidate(store, "a", clock)
    a.try_once()
    assert store.record is not None
    store._store(replace(store.record, holder="intruder"))  # e.g. an operator of an older release
    a.try_once()
    assert not a.acting()


def test_a_released_lease_is_taken_at_once() -> None:
    store, clock_a, clock_b = FakeLeases(), Clock(), Clock()
    a, b = candidate(store, "a", clock_a), candidate(store, "b", clock_b)
    a.try_once()
    b.try_once()
    a.release()
    assert not a.acting()
    b.try_once()
    assert b.acting() and store.record is not None and store.record.holder == "b"


@pytest.mark.parametrize("seed", range(12))
def test_never_two_replicas_acting_under_pauses_outages_and_clock_offsets(seed: int) -> None:
    """Three replicas, each with its own clock offset, try on their own schedules; replicas are
    paused (their clock runs on, they do nothing) and the Lease API goes down at random. On a
    common timeline sampled every 0.1 s, at most one replica may act; and someone acts most of
    the time."""
    rng = random.Random(seed)
    store = FakeLeases()
    clocks = [Clock(rng.uniform(0, 1e6)) for _ in range(3)]
    electors = [candidate(store, f"r{i}", c) for i, c in enumerate(clocks)]
    next_try = [rng.uniform(0, 2) for _ in electors]
    paused_until = [0.0] * 3
    acting_samples = 0
    t = 0.0
    for _ in range(30_000):  # 3000 s
        t += 0.1
        for c in clocks:
            c.now += 0.1
        if rng.random() < 0.0005:
            paused_until[rng.randrange(3)] = t + rng.uniform(1, 40)
        store.down = (int(t) // 50) % 7 == 3 and rng.random() < 0.8  # outages, partly answered
        for i, elector in enumerate(electors):
            if t >= next_try[i] and t >= paused_until[i]:
                with contextlib.suppress(ConnectionError):
                    elector.try_once()
                next_try[i] = t + TIMING.retry_period * rng.uniform(0.8, 1.2)
        acting = [e.identity for e in electors if e.acting()]
        assert len(acting) <= 1, f"t={t:.1f}: {acting} act at once"
        acting_samples += bool(acting)
    assert acting_samples > 0.7 * 30_000


def test_timing_must_let_the_leader_stop_before_its_lease_expires() -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        LeaderTiming(lease_duration=10, renew_deadline=10, retry_period=2)


class _CapturingCustom:
    """A CustomObjectsApi stand-in (unit-test boundary) that keeps the bodies written."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def create_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.bodies.append(args[4])
        return {**args[4], "metadata": {**args[4]["metadata"], "resourceVersion": "1"}}

    def replace_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.bodies.append(args[5])
        return {**args[5], "metadata": {**args[5]["metadata"], "resourceVersion": "2"}}


@pytest.mark.parametrize("owner", [None, {"apiVersion": "apps/v1", "kind": "Deployment",
                                           "name": "tt-topotrain", "uid": "u-1"}], ids=["none", "deployment"])
def test_every_write_of_the_lease_carries_its_owner(owner: dict[str, str] | None) -> None:
    """The chart's Deployment owns the Lease (TOPOTRAIN_LEASE_OWNER): `helm uninstall` deletes the
    Deployment and the garbage collector the Lease; a renewal (a full replace) must keep it."""
    custom = _CapturingCustom()
    kube = SimpleNamespace(custom=custom)
    store = KubeLeases(cast(Kube, kube), "ns", "tt-topotrain", 5.0, owner)
    record = LeaseRecord(holder="a", duration_seconds=15, transitions=0, acquire_time=None,
                         renew_time=None, resource_version="")
    written = store.create(record)
    store.replace(written)
    for body in custom.bodies:
        assert body["metadata"].get("ownerReferences") == ([owner] if owner else None)
    assert custom.bodies[1]["metadata"]["resourceVersion"] == "1"
