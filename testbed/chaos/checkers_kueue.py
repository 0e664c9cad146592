"""Invariant 14: a Kueue eviction gives its quota back within the bound (the soak run with
Kueue, testbed/chaos/queued.py).

An eviction is a Workload of a soak job seen with `Evicted=True` (each distinct
lastTransitionTime is one eviction). Its quota is given back when the Workload is next seen
without `QuotaReserved=True` (that condition's lastTransitionTime when it is not older than
the eviction, else the poll's time), or gone (a deleted job's Workload goes with it). The
bound: the operator's `checkpointRequestTimeoutSeconds` (its checkpoint-first stop is bounded
whatever the store's state) plus SLACK for the gang's pods to go and the polls; plus, for
each fault that took the acting operator or the API server away while the eviction waited,
the time it lasted and a takeover's TAKEOVER seconds (nobody can act then).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from testbed.chaos.catalogue import Kind
from testbed.chaos.timeline import Timeline, Verdict, timestamp, verdict

SLACK = 60.0
TAKEOVER = 30.0
# Faults during which no operator replica may act (or the API server is away).
AWAY = {Kind.OPERATOR_KILL, Kind.OPERATOR_FAILOVER, Kind.NODES_GONE_OPERATOR_DOWN, Kind.APISERVER_RESTART,
        Kind.REPLICA_SLOW_API, Kind.REPLICA_CLOCK_SKEW, Kind.REPLICA_SLOW_JOB_WATCH}  # fmt: skip
NAME = "14 a Kueue eviction gives its quota back within the bound"


def _condition(workload: dict[str, Any], kind: str) -> tuple[str, float | None] | None:
    """(status, lastTransitionTime) of the Workload's condition `kind`, None when absent."""
    found = next((c for c in workload["conditions"] if c[0] == kind), None)
    return None if found is None else (str(found[1]), timestamp(found[3]))


def evictions(t: Timeline) -> list[tuple[str, float, float | None]]:
    """(job, evicted at, quota given back at or None) of every eviction of a soak job's Workload."""
    episodes: dict[tuple[str, float], float | None] = {}
    owner: dict[str, str] = {}
    open_: dict[str, list[float]] = defaultdict(list)  # workload -> evictions not released yet
    for record in t.api:
        if "workloads" not in record:
            continue
        seen = {w["name"]: w for w in record["workloads"] if w.get("job")}
        for name, workload in seen.items():
            owner[name] = workload["job"]
            evicted = _condition(workload, "Evicted")
            if evicted and evicted[0] == "True" and evicted[1] is not None and (name, evicted[1]) not in episodes:
                episodes[(name, evicted[1])] = None
                open_[name].append(evicted[1])
            reserved = _condition(workload, "QuotaReserved")
            if open_[name] and not (reserved and reserved[0] == "True"):
                for at in open_.pop(name):
                    changed = reserved[1] if reserved else None
                    episodes[(name, at)] = changed if changed is not None and changed >= at - 1 else float(record["t"])
        for name in [n for n in open_ if open_[n] and n not in seen]:  # the Workload is gone
            for at in open_.pop(name):
                episodes[(name, at)] = float(record["t"])
    return [(owner[name], at, released) for (name, at), released in sorted(episodes.items(), key=lambda e: e[0][1])]


def check_eviction_bound(t: Timeline, records: list[dict[str, Any]]) -> Verdict:
    start = next((r for r in records if r["type"] == "soak-start"), {})
    if not start.get("kueue"):
        return verdict(NAME, 0, [])
    base = float(start.get("checkpoint_request_timeout") or 120.0) + SLACK
    heals = {r["index"]: float(r["t"]) for r in t.heals}
    away = [(float(f["t"]), heals.get(f["index"], float(f["t"]))) for f in t.faults if f["kind"] in AWAY]
    end = float(t.api[-1]["t"]) if t.api else 0.0
    problems: list[str] = []
    notes: list[str] = []
    found = evictions(t)
    for job, at, released in found:
        allowed = base
        for begin, healed in away:  # faults that stopped the operator while this eviction waited
            if begin < at + allowed and healed > at:
                allowed += healed - max(begin, at) + TAKEOVER
        took = (released if released is not None else end) - at
        if took > allowed:
            what = f"gave its quota back after {took:.0f}s" if released is not None else f"still held its quota {took:.0f}s later"
            problems.append(f"{job}: evicted at t={at:.0f}, {what} (bound {allowed:.0f}s)")
    for r in t.heals:
        if r.get("kind") == Kind.KUEUE_PREEMPT and not r.get("evicted"):
            notes.append(f"kueue-preempt #{r['index']}: Kueue evicted no job (the preemptor fit in free quota)")
    if not found and any(f["kind"] == Kind.KUEUE_PREEMPT for f in t.faults):
        problems.append("kueue-preempt faults were injected and no eviction was seen: nothing was judged")
    return verdict(NAME, len(found), problems, notes)
