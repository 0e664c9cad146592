"""The fault catalogue and the seeded generator (the soak's "nemesis" schedule).

A schedule is a pure function of (seed, count, mean gap, classes): the same
seed replays the same faults at the same offsets. A fault names its class,
when it starts (seconds from the start of the soak), how long it lasts (0 for
an instant fault) and a few seeded choices (`pick`, a float in [0, 1) the
nemesis turns into a pod, node or job among those that exist at that moment,
and `size`, the fault's strength). Faults overlap: a long one (an outage, a
node down) keeps going while the next ones arrive. Faults that hit every job
at once (S3, the API server, the operator, a quota) come one at a time with
CALM seconds between them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    TRAINER_CRASH = "trainer-crash"  # a rank exits 1 (SIGUSR1 to the stand-in)
    POD_DELETED = "pod-deleted"
    NODE_NOT_READY = "node-not-ready"  # KWOK's NotReady stage, back after `duration`
    NODE_DELETED = "node-deleted"  # the Node object deleted, added back after `duration`
    NODE_FLAP = "node-flap"  # the node's lease goes silent, back within the grace period
    BAD_NODE = "bad-node"  # every pod placed on the node crashes, for `duration`
    TRAINER_HANG = "trainer-hang"  # SIGSTOP to one rank: the gang stalls
    S3_DOWN = "s3-down"  # versitygw stopped for `duration`
    S3_SLOW = "s3-slow"  # the proxy adds `size` seconds to each request
    S3_ERRORS = "s3-errors"  # the proxy answers 503 to a `size` share of requests
    APISERVER_RESTART = "apiserver-restart"
    OPERATOR_KILL = "operator-kill"  # SIGKILL, started again after `duration`
    OPERATOR_FAILOVER = "operator-failover"  # SIGKILL the acting replica; the standby takes over
    CAPACITY_LOSS = "capacity-loss"  # a pool loses several nodes; they return after `duration`
    SCALE = "scale"  # `kubectl scale` an elastic job right after hurting it
    QUOTA = "quota"  # a ResourceQuota refuses new pods for `duration`
    JOB_DELETED = "job-deleted"  # a job deleted right after one of its pods is
    # issue 37 (testbed/chaos/nemesis_more.py): not in the bounded soak's default set
    NODES_GONE_OPERATOR_DOWN = "nodes-gone-operator-down"  # every replica down while nodes go
    ROLL_CRASH = "roll-crash"  # a spec edit rolls a job; its new gang crashes before its first commit
    CREDENTIALS_DELETED = "credentials-deleted"  # the checkpoint Secret deleted for `duration`
    CHECKPOINT_TARPIT = "checkpoint-tarpit"  # one job's store requests trickle bytes for `duration`
    REPLICA_SLOW_API = "replica-slow-api"  # one replica's API connections delayed for `duration`
    REPLICA_CLOCK_SKEW = "replica-clock-skew"  # one replica restarted with its wall clock ahead
    REPLICA_SLOW_JOB_WATCH = "replica-slow-job-watch"  # one replica's TrainingJob watch late, pods on time
    TENANT_TARPIT = "tenant-tarpit"  # another namespace's jobs keep their store at a tarpit for `duration`
    KUEUE_PREEMPT = "kueue-preempt"  # a higher-priority Workload makes Kueue evict queued jobs (--kueue)


# (weight, (shortest, longest) duration in seconds)
CATALOGUE: dict[Kind, tuple[float, tuple[float, float]]] = {
    Kind.TRAINER_CRASH: (10, (0, 0)),
    Kind.POD_DELETED: (8, (0, 0)),
    Kind.NODE_NOT_READY: (6, (15, 45)),
    Kind.NODE_DELETED: (4, (20, 60)),
    Kind.NODE_FLAP: (5, (5, 20)),
    Kind.BAD_NODE: (3, (30, 60)),
    Kind.TRAINER_HANG: (4, (0, 0)),
    Kind.S3_DOWN: (3, (5, 20)),
    Kind.S3_SLOW: (4, (10, 30)),
    Kind.S3_ERRORS: (4, (10, 30)),
    Kind.APISERVER_RESTART: (2, (0, 0)),
    Kind.OPERATOR_KILL: (3, (1, 5)),
    Kind.OPERATOR_FAILOVER: (2, (0, 0)),
    Kind.CAPACITY_LOSS: (2, (30, 60)),
    Kind.SCALE: (4, (0, 0)),
    Kind.QUOTA: (3, (5, 15)),
    Kind.JOB_DELETED: (2, (0, 0)),
    Kind.NODES_GONE_OPERATOR_DOWN: (2, (20, 50)),
    Kind.ROLL_CRASH: (3, (0, 0)),
    Kind.CREDENTIALS_DELETED: (2, (10, 30)),
    Kind.CHECKPOINT_TARPIT: (2, (15, 40)),
    Kind.REPLICA_SLOW_API: (2, (10, 30)),
    Kind.REPLICA_CLOCK_SKEW: (2, (20, 60)),
    Kind.REPLICA_SLOW_JOB_WATCH: (2, (20, 60)),
    Kind.TENANT_TARPIT: (2, (30, 60)),
    Kind.KUEUE_PREEMPT: (3, (20, 60)),
}
# The bounded soak draws only the classes from before issue 37, so its seed keeps its schedule
# (a class added to the draw changes every seed's schedule); the bench draws them all.
ISSUE_37 = frozenset({Kind.NODES_GONE_OPERATOR_DOWN, Kind.ROLL_CRASH, Kind.CREDENTIALS_DELETED,
                      Kind.CHECKPOINT_TARPIT, Kind.REPLICA_SLOW_API, Kind.REPLICA_CLOCK_SKEW,
                      Kind.REPLICA_SLOW_JOB_WATCH, Kind.TENANT_TARPIT, Kind.KUEUE_PREEMPT})  # fmt: skip
# Drawn only when the soak runs Kueue (SoakConfig.kueue, bench/chaos.py --kueue).
NEEDS_KUEUE = frozenset({Kind.KUEUE_PREEMPT})
CLASSIC = frozenset(Kind) - ISSUE_37
# Faults that hit every job at once: one at a time, each followed by CALM seconds without
# another, so their rate does not grow with the fleet and jobs get windows to make progress.
GLOBAL = {Kind.S3_DOWN, Kind.S3_SLOW, Kind.S3_ERRORS, Kind.APISERVER_RESTART,
          Kind.OPERATOR_KILL, Kind.OPERATOR_FAILOVER, Kind.QUOTA,
          Kind.NODES_GONE_OPERATOR_DOWN, Kind.CREDENTIALS_DELETED, Kind.REPLICA_SLOW_API,
          Kind.REPLICA_CLOCK_SKEW, Kind.REPLICA_SLOW_JOB_WATCH}  # fmt: skip
CALM = 30.0
# A tarpit hits its job's namespace (the operator's store reads are bounded per namespace, and
# the soak's jobs share one), so one at a time; it may overlap other faults. The tenant's tarpit
# hits another namespace only: it overlaps the soak's faults (that is what invariant 13 judges).
EXCLUSIVE = GLOBAL | {Kind.CAPACITY_LOSS, Kind.CHECKPOINT_TARPIT, Kind.TENANT_TARPIT,
                      Kind.KUEUE_PREEMPT}  # never two of the class at once


@dataclass(frozen=True)
class Fault:
    index: int
    kind: Kind
    at: float  # seconds after the soak starts
    duration: float
    pick: float  # which target, among those present when it fires
    size: float  # strength: latency seconds, error share, nodes lost

    def describe(self) -> str:
        span = f" for {self.duration:.0f}s" if self.duration else ""
        return f"#{self.index} {self.kind.value} at +{self.at:.1f}s{span}"


def schedule(
    seed: int, count: int, mean_gap: float, kinds: set[Kind] | None = None, calm: float = CALM
) -> list[Fault]:
    """`count` faults with exponential gaps of mean `mean_gap` seconds, drawn from `seed`."""
    rng = random.Random(seed)
    allowed = [k for k in CATALOGUE if kinds is None or k in kinds]
    if not allowed:
        raise ValueError("no fault class selected")
    weights = [CATALOGUE[k][0] for k in allowed]
    faults: list[Fault] = []
    busy_until: dict[Kind | None, float] = {}  # None: any global fault
    at = 0.0
    while len(faults) < count:
        at += rng.expovariate(1.0 / mean_gap)
        kind = rng.choices(allowed, weights)[0]
        low, high = CATALOGUE[kind][1]
        duration = round(rng.uniform(low, high), 1)
        pick, size = rng.random(), rng.random()
        if kind in EXCLUSIVE and busy_until.get(kind, -1.0) > at:
            continue  # still draws the same numbers, so the schedule stays a function of the seed
        if kind in GLOBAL and busy_until.get(None, -1.0) > at:
            continue
        busy_until[kind] = at + duration
        if kind in GLOBAL:
            busy_until[None] = at + duration + calm
        faults.append(Fault(len(faults), kind, round(at, 2), duration, pick, size))
    return faults


def choose(items: list[str], pick: float) -> str | None:
    """The item a fault's `pick` names (the list sorted first, so a replay chooses the same)."""
    ordered = sorted(items)
    return ordered[min(int(pick * len(ordered)), len(ordered) - 1)] if ordered else None
