"""What a soak measured, per fault class: faults injected, the restarts they
caused, time until the hurt jobs stepped again, steps lost; and the fleet's
goodput. From the history and the stand-in trainers' events only."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from testbed.chaos.timeline import Timeline, percentile

AFTERMATH = 240.0  # a job that steps again later than this after a fault is not its recovery
RESTART_WINDOW = 30.0  # an attempt started this long after a fault ended is the fault's restart


@dataclass
class ClassRow:
    injected: int = 0
    skipped: int = 0
    recoveries: int = 0
    seconds: list[float] = field(default_factory=list)
    lost: int = 0


def recovery(t: Timeline, job: str, at: float, healed: float) -> tuple[float, bool, int] | None:
    """(seconds, restarted, steps lost) for a fault at `at` that ended at `healed`.

    A new attempt that started between the fault and `RESTART_WINDOW` s after its end is its
    restart: seconds from the fault to that attempt's first step. Otherwise seconds from the
    fault's end to the job's next step."""
    steps = t.steps(job)
    before = [s for s in steps if s["time"] <= at]
    old = before[-1]["attempt"] if before else -1
    restart = next((e for e in t.starts(job)
                    if e["attempt"] > old and at <= e["time"] <= healed + RESTART_WINDOW), None)  # fmt: skip
    if restart is not None:
        first = next((s for s in steps if s["attempt"] == restart["attempt"]), None)
        if first is None or first["time"] > at + AFTERMATH:
            return None
        reached = max((s["step"] for s in steps if s["time"] <= restart["time"]), default=0)
        return first["time"] - at, True, max(0, reached - (restart.get("resume") or 0))
    after = next((s for s in steps if healed <= s["time"] <= healed + AFTERMATH), None)
    return None if after is None else (after["time"] - healed, False, 0)


def measured(t: Timeline) -> Iterator[tuple[dict[str, Any], str, float, tuple[float, bool, int]]]:
    """(fault, job, when the fault healed, `recovery`) of every job's recovery from a fault that
    hit it (a job the fault deleted has none)."""
    heals = {r["index"]: r["t"] for r in t.heals}
    for fault in t.faults:
        healed = heals.get(fault["index"], fault["t"])
        for job in fault["jobs"]:
            if job in t.deleted and fault["kind"] == "job-deleted":
                continue
            found = recovery(t, job, fault["t"], healed)
            if found is not None:
                yield fault, job, healed, found


def class_rows(t: Timeline, records: list[dict[str, Any]]) -> dict[str, ClassRow]:
    rows: dict[str, ClassRow] = defaultdict(ClassRow)
    for r in records:
        if r["type"] in ("fault-skipped", "fault-error"):
            rows[r["kind"]].skipped += 1
    for fault in t.faults:
        rows[fault["kind"]].injected += 1
    for fault, _, _, (seconds, restarted, lost) in measured(t):
        row = rows[fault["kind"]]
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
    head = ("| fault class | injected | not injected | jobs hit | restarts | recovery p50 s | p95 s "
            "| max s | lost steps |")  # fmt: skip
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
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
    return (f"| {name} | {row.injected} | {row.skipped} | {len(row.seconds)} | {row.recoveries} "
            f"| {p50:.1f} | {p95:.1f} "
            f"| {top:.1f} | {row.lost} |")  # fmt: skip


def not_injected(records: list[dict[str, Any]]) -> str:
    """Why faults were not injected, counted: no target at that moment, or the API refused."""
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        if r["type"] == "fault-skipped":
            counts[f"{r['kind']}: {r['why']}"] += 1
        elif r["type"] == "fault-error":
            counts[f"{r['kind']}: {r['error'].split(':', 1)[0]}"] += 1
    return "; ".join(f"{why} x{n}" for why, n in sorted(counts.items(), key=lambda i: -i[1]))
