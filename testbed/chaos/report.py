"""What a soak measured, per fault class: faults injected, the restarts they
caused, time until the hurt jobs stepped again, steps lost; and the fleet's
goodput. From the history and the stand-in trainers' events only."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from testbed.chaos.timeline import Timeline, percentile

AFTERMATH = 240.0  # a job that steps again later than this after a fault is not its recovery


@dataclass
class ClassRow:
    injected: int = 0
    skipped: int = 0
    recoveries: int = 0
    seconds: list[float] = field(default_factory=list)
    lost: int = 0


def recovery(t: Timeline, job: str, at: float, healed: float) -> tuple[float, bool, int] | None:
    """(seconds until the job stepped again, whether a new attempt did, steps lost) for a fault at `at`."""
    steps = t.steps(job)
    before = [s for s in steps if s["time"] <= at]
    old = before[-1]["attempt"] if before else -1
    for step in steps:
        if step["time"] <= at or step["time"] > at + AFTERMATH:
            continue
        if step["attempt"] > old:
            reached = max((s["step"] for s in steps if s["time"] <= step["time"] and s["attempt"] <= old), default=0)
            start = next((e for e in t.starts(job) if e["attempt"] == step["attempt"]), {})
            return step["time"] - at, True, max(0, reached - (start.get("resume") or 0))
        if step["time"] >= healed:
            return step["time"] - at, False, 0
    return None


def class_rows(t: Timeline, records: list[dict[str, Any]]) -> dict[str, ClassRow]:
    rows: dict[str, ClassRow] = defaultdict(ClassRow)
    heals = {r["index"]: r["t"] for r in records if r["type"] == "heal"}
    for r in records:
        if r["type"] == "fault-skipped":
            rows[r["kind"]].skipped += 1
    for fault in t.faults:
        row = rows[fault["kind"]]
        row.injected += 1
        healed = heals.get(fault["index"], fault["t"])
        for job in fault["jobs"]:
            if job in t.deleted and fault["kind"] == "job-deleted":
                continue
            found = recovery(t, job, fault["t"], healed)
            if found is None:
                continue
            seconds, restarted, lost = found
            row.seconds.append(seconds)
            row.recoveries += restarted
            row.lost += lost
    return dict(rows)


def goodput(t: Timeline, step_seconds: float) -> float:
    """Useful step time of finished jobs over their wall time from creation to the last step."""
    useful = wall = 0.0
    for job, plan in t.created.items():
        steps = t.steps(job)
        final = t.final_job(job) or {}
        if job in t.deleted or final.get("phase") != "Succeeded" or not steps:
            continue
        useful += plan["steps"] * step_seconds
        wall += steps[-1]["time"] - plan["t"]
    return useful / wall if wall else 0.0


def table(rows: dict[str, ClassRow]) -> str:
    head = "| fault class | injected | skipped | recoveries | recovery p50 s | p95 s | max s | lost steps |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    total = ClassRow()
    for kind in sorted(rows):
        row = rows[kind]
        total.injected += row.injected
        total.skipped += row.skipped
        total.recoveries += row.recoveries
        total.seconds += row.seconds
        total.lost += row.lost
        lines.append(_line(kind, row))
    lines.append(_line("**all**", total))
    return "\n".join(lines)


def _line(name: str, row: ClassRow) -> str:
    p50, p95 = percentile(row.seconds, 0.5), percentile(row.seconds, 0.95)
    top = max(row.seconds) if row.seconds else float("nan")
    return (f"| {name} | {row.injected} | {row.skipped} | {row.recoveries} | {p50:.1f} | {p95:.1f} "
            f"| {top:.1f} | {row.lost} |")  # fmt: skip
