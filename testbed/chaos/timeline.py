"""Views of a soak's history that the checkers and the report share: the
attempts seen on the API server, the commits seen in S3, the stand-in
trainers' events. Pure functions of the recorded data."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Verdict:
    invariant: str
    ok: bool
    checked: int
    details: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # findings that break no invariant but are worth reading

    def line(self) -> str:
        head = f"{'ok  ' if self.ok else 'FAIL'} {self.invariant} ({self.checked} checked)"
        lines = [f"     {d}" for d in self.details[:8]]
        if self.notes:
            lines += [f"     note ({len(self.notes)}): {n}" for n in self.notes[:3]]
        return "\n".join([head, *lines])


def verdict(invariant: str, checked: int, problems: list[str], notes: list[str] | None = None) -> Verdict:
    return Verdict(invariant, not problems, checked, tuple(problems), tuple(notes or ()))


def timestamp(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass
class Attempt:
    job: str
    number: int
    created: float
    resumes: set[str | None] = field(default_factory=set)
    pods: set[str] = field(default_factory=set)
    size: int = 0  # pods in the gang: the highest index seen + 1
    templates: set[str] = field(default_factory=set)  # the spec hashes its pods run


@dataclass
class Timeline:
    namespace: str
    api: list[dict[str, Any]]
    s3: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    created: dict[str, dict[str, Any]]  # job -> its job-created record
    deleted: dict[str, float]  # job -> when the soak deleted it
    events: dict[str, list[dict[str, Any]]]  # job -> the stand-in's events (node rank 0)
    heals: list[dict[str, Any]] = field(default_factory=list)
    crashes: list[dict[str, Any]] = field(default_factory=list)  # bad-node crashes
    replicas: list[dict[str, Any]] = field(default_factory=list)  # operator replicas started
    audit: list[dict[str, Any]] = field(default_factory=list)  # the API server's pod/Lease writes

    @classmethod
    def of(cls, records: list[dict[str, Any]], namespace: str) -> Timeline:
        events: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            if r["type"] == "trainer-events":
                # The trainer's own events carry a time; the pod supervisor's lines do not.
                events[r["job"]] = sorted((e for e in r["events"] if "time" in e),
                                          key=lambda e: float(e["time"]))  # fmt: skip
        return cls(
            namespace,
            [r for r in records if r["type"] == "api"],
            [r for r in records if r["type"] == "s3"],
            [r for r in records if r["type"] == "fault"],
            {r["job"]: r for r in records if r["type"] == "job-created"},
            {r["job"]: r["t"] for r in records if r["type"] == "job-deleted"},
            dict(events),
            [r for r in records if r["type"] == "heal"],
            [r for r in records if r["type"] == "bad-node-crash"],
            [r for r in records if r["type"] == "replica"],
            [e for r in records if r["type"] == "audit" for e in r["events"]],
        )

    def job_pods(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        return [p for p in record["pods"] if p["ns"] == self.namespace and p["job"]]

    def attempts(self) -> dict[tuple[str, int], Attempt]:
        found: dict[tuple[str, int], Attempt] = {}
        first_attempt: dict[str, int] = {}  # uid -> the attempt the pod was created for
        for record in self.api:
            for pod in self.job_pods(record):
                if pod["attempt"] is None:
                    continue
                key = (pod["job"], pod["attempt"])
                created = timestamp(pod["created"]) or record["t"]
                if first_attempt.setdefault(pod["uid"], pod["attempt"]) != pod["attempt"]:
                    created = record["t"]  # restarted in place: it joined this attempt by now
                attempt = found.setdefault(key, Attempt(pod["job"], pod["attempt"], created))
                if pod["uid"] not in attempt.pods:
                    attempt.pods.add(pod["uid"])
                    attempt.resumes.add(pod["resume"] or None)
                    attempt.created = min(attempt.created, created)
                attempt.size = max(attempt.size, (pod["index"] or 0) + 1)
                if pod.get("template"):
                    attempt.templates.add(pod["template"])
        return found

    def retargeted(self, job: str) -> set[int]:
        """The job's attempts that the API server showed retargeted: an in-place attempt moved on,
        before its replacement pods were created, to a step committed after it was told one (the
        operator's _retarget; not a restart of its own)."""
        return {int(seen["attempt"]) for record in self.api for seen in record["jobs"]
                if seen["name"] == job and seen.get("retargeted") and seen.get("attempt") is not None}  # fmt: skip

    def planned(self, job: str) -> set[int]:
        """The job's attempts that began a planned change (a resize, a drain, a rollout: the
        operator's status.plannedRestore named them), after which the replaced gang's later
        commits are not resumable."""
        return {int(seen["planned"]) for record in self.api for seen in record["jobs"]
                if seen["name"] == job and seen.get("planned") is not None}  # fmt: skip

    def attempt_status(self, job: str, attempt: int) -> str:
        """What the first poll that showed the job at `attempt` said of it (for a report):
        status.restarts, lastFailure's reason and pod, the data degree and the Recovering and
        Ready reasons, or '?' when no poll caught that attempt."""
        for record in self.api:
            for seen in record["jobs"]:
                if seen["name"] == job and seen.get("attempt") == attempt:
                    why = ", ".join(f"{c[0]} {c[2]}" for c in seen.get("conditions") or []
                                    if c[0] in ("Recovering", "Ready"))  # fmt: skip
                    return (f"restarts {seen.get('restarts')}, lastFailure {seen.get('lastFailure')} "
                            f"of {seen.get('lastFailurePod')}, data {seen.get('data')}, {why}")
        return "?"

    def commits(self) -> dict[str, dict[int, float]]:
        """job -> step -> the COMMITTED marker's LastModified, over every listing."""
        seen: dict[str, dict[int, float]] = defaultdict(dict)
        for record in self.s3:
            for job, steps in record["committed"].items():
                for step, modified in steps:
                    seen[job].setdefault(int(step), float(modified))
        return dict(seen)

    def saves(self, job: str) -> list[tuple[float, int, int | None]]:
        """(when, step, the attempt that saved it) of every save of the job's COMMITTED markers
        seen: the markers' own record (read by the observer) and the trainer's commit events (a
        marker overwritten within a poll is seen only there). Ordered by time."""
        found = [(float(m), int(step), who) for r in self.s3
                 for step, m, who in (r.get("saved") or {}).get(job, [])]  # fmt: skip
        found += [(float(e["time"]), int(e["step"]), e.get("attempt"))
                  for e in self.events.get(job, []) if e.get("event") == "commit"]  # fmt: skip
        return sorted(found, key=lambda s: s[0])

    def steps(self, job: str) -> list[dict[str, Any]]:
        return [e for e in self.events.get(job, []) if e.get("event") == "step"]

    def starts(self, job: str) -> list[dict[str, Any]]:
        return [e for e in self.events.get(job, []) if e.get("event") == "start"]

    def final_job(self, job: str) -> dict[str, Any] | None:
        for record in reversed(self.api):
            for seen in record["jobs"]:
                if seen["name"] == job:
                    return dict(seen)
        return None

    def end_of(self, job: str) -> float:
        """When the job stopped needing to run: finished, deleted, or the end of the history."""
        if job in self.deleted:
            return self.deleted[job]
        for record in self.api:
            for seen in record["jobs"]:
                if seen["name"] == job and seen["phase"] in TERMINAL:
                    return float(record["t"])
        return float(self.api[-1]["t"]) if self.api else 0.0


def percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))]
