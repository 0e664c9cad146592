"""Restarts and the faults that may explain them, for invariants 9 and 12 (pure functions of
the history).

A restart is a new attempt at the same data degree (a resize changes it), except an attempt
the API server showed retargeted (an in-place restart told a newer commit: one restart). A fault may explain
a restart of a job it touched when it began at most 2 s before the restart and either ended at
most `window` s before it or began after the previous attempt did (that attempt's restart may
have waited for capacity for minutes). A node fault touches every job with a pod bound or
planned onto its node(s) while it lasts; each bad-node crash is a cause of its own.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from testbed.chaos.timeline import Timeline


@dataclass(frozen=True)
class Cause:
    start: float
    healed: float
    jobs: frozenset[str]
    kind: str
    index: int | None  # the fault's index (None: a bad-node crash)


def causes(t: Timeline) -> list[Cause]:
    heals = {r["index"]: r["t"] for r in t.heals}
    found = [Cause(f["t"], heals.get(f["index"], f["t"]), frozenset(set(f["jobs"]) | _placed_during(t, f, heals)),
                   f["kind"], f["index"]) for f in t.faults]  # fmt: skip
    return found + [Cause(r["t"], r["t"], frozenset({r["job"]}), "bad-node", None) for r in t.crashes]


def candidates(found: list[Cause], job: str, began: float, at: float, window: float = 120.0) -> list[int]:
    """Indices into `found` of the causes that may explain `job`'s restart at `at` (the previous
    attempt began at `began`)."""
    return [i for i, c in enumerate(found) if job in c.jobs and c.start - 2 <= at
            and (c.healed + window >= at or c.start >= began - 2)]  # fmt: skip


def restarts(t: Timeline, job: str) -> list[tuple[float, int, float]]:
    """(when the previous attempt began, the new attempt's number, when it began) of each restart.
    A retargeted attempt (Timeline.retargeted) continues its predecessor's restart."""
    ordered, moved = _attempt_sizes(t, job), t.retargeted(job)
    return [(began, number, at) for (_, size_a, began), (number, size_b, at) in itertools.pairwise(ordered)
            if size_a == size_b and number not in moved]  # fmt: skip


def _placed_during(t: Timeline, fault: dict[str, Any], heals: dict[object, float]) -> set[str]:
    """Jobs with a pod on the fault's node(s) while it lasted: a pod placed there after the fault
    began (before the operator saw the node fail) is hit too, though not in the fault's `jobs`."""
    nodes = set(fault.get("nodes") or ([fault["node"]] if fault.get("node") else []))
    if not nodes:
        return set()
    start, end = float(fault["t"]), float(heals.get(fault["index"], fault["t"]))
    return {p["job"] for r in t.api if start <= float(r["t"]) <= end
            for p in t.job_pods(r) if (p.get("node") or p.get("planned")) in nodes}  # fmt: skip


def _attempt_sizes(t: Timeline, job: str) -> list[tuple[int, int, float]]:
    """(attempt, pods, first seen) of every attempt the API server or the trainer showed.

    A gang restarted again within a second may never reach a poll, but its trainer's start
    event does (and the reverse: pods killed before their process started)."""
    seen: dict[int, tuple[int, float]] = {}
    for (name, number), attempt in t.attempts().items():
        if name == job:
            seen[number] = (attempt.size, attempt.created)
    for start in t.starts(job):
        size, at = seen.get(start["attempt"], (0, start["time"]))
        seen[start["attempt"]] = (size or int(start.get("pods") or 0), min(at, start["time"]))
    return [(n, size, at) for n, (size, at) in sorted(seen.items())]
