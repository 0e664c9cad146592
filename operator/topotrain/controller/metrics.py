"""Prometheus metrics of the operator (served on :9090/metrics by default).

| metric | type | labels | meaning |
|---|---|---|---|
| topotrain_jobs | gauge | phase | TrainingJobs by phase |
| topotrain_restarts_total | counter | reason | gang restarts by failure reason |
| topotrain_resizes_total | counter | direction | elastic shrinks and grows |
| topotrain_recovery_seconds | histogram | | failure detected -> all replacement pods Running |
| topotrain_placement_cost | gauge | namespace, job | communication cost of the current placement |
| topotrain_reconcile_seconds | histogram | | duration of one reconcile pass |
| topotrain_checkpoint_age_seconds | gauge | namespace, job | age of the latest committed checkpoint |
| topotrain_progress_percent | gauge | namespace, job | status.progress.percentComplete |
| topotrain_steps_per_second | gauge | namespace, job | status.progress.stepsPerSecond |
| topotrain_eta_seconds | gauge | namespace, job | seconds until status.progress.estimatedCompletionTime |
| topotrain_watch_events_total | counter | resource | watch events handled (nodes, GPU pods, TrainingJobs) |
| topotrain_leader | gauge | | 1 while this replica holds the Lease and acts (standalone: always 1), else 0 |
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from topotrain.api.status import PHASES, ProgressStatus

if TYPE_CHECKING:
    from topotrain.core.decision import Decision

RECOVERY_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 30, 60, 120, 300, 600)
FIRST_STEP_BUCKETS = (1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200, 1800)
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """All of the operator's metrics, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs = Gauge("topotrain_jobs", "TrainingJobs by phase", ["phase"], registry=r)
        self.restarts = Counter(
            "topotrain_restarts", "Gang restarts by failure reason", ["reason"], registry=r
        )
        self.resizes = Counter(
            "topotrain_resizes", "Elastic resizes of the data degree", ["direction"], registry=r
        )
        self.recovery = Histogram(
            "topotrain_recovery_seconds",
            "Failure detected -> all replacement pods Running", buckets=RECOVERY_BUCKETS, registry=r,
        )
        self.first_step = Histogram(
            "topotrain_time_to_first_step_seconds",
            "Failure (or planned change) detected -> the new attempt's first training step",
            ["cause"], buckets=FIRST_STEP_BUCKETS, registry=r,
        )
        self.placement_cost = Gauge(
            "topotrain_placement_cost", "Communication cost of the current placement",
            ["namespace", "job"], registry=r,
        )
        self.reconcile = Histogram(
            "topotrain_reconcile_seconds", "Duration of one reconcile pass",
            buckets=RECONCILE_BUCKETS, registry=r,
        )
        self.checkpoint_age = Gauge(
            "topotrain_checkpoint_age_seconds", "Age of the latest committed checkpoint",
            ["namespace", "job"], registry=r,
        )
        self.progress = Gauge("topotrain_progress_percent", "Percent of spec.training.steps done",
                              ["namespace", "job"], registry=r)
        self.rate = Gauge("topotrain_steps_per_second", "Training steps per second (recent window)",
                          ["namespace", "job"], registry=r)
        self.eta = Gauge("topotrain_eta_seconds", "Seconds until the estimated completion",
                         ["namespace", "job"], registry=r)
        self.ghost_pods = Counter(
            "topotrain_ghost_pods", "Pods the watch cache showed that the API server said were gone "
            "(a 404 to a call of ours, mostly a deletion the watch had not delivered yet; or missing "
            "from two LISTs, a deletion it missed); left out of planning from then on", registry=r,
        )
        self.ghost_nodes = Counter(
            "topotrain_ghost_nodes", "Nodes the watch cache showed that two LISTs did not (a deletion "
            "the watch missed while it was away); left out of the fleet from then on", registry=r,
        )
        self.watch_events = Counter(
            "topotrain_watch_events", "Watch events handled, by resource (nodes, GPU pods, TrainingJobs)",
            ["resource"], registry=r,
        )
        self.leader = Gauge(
            "topotrain_leader", "1 while this replica holds the leader Lease and acts, else 0", registry=r)
        self._phases: dict[tuple[str, str], str] = {}
        for phase in PHASES:
            self.jobs.labels(phase).set(0)

    def job_phase(self, namespace: str, job: str, phase: str | None) -> None:
        """Record a job's phase (None: the job is gone)."""
        key = (namespace, job)
        if phase is None:
            self._phases.pop(key, None)
            for gauge in (self.placement_cost, self.checkpoint_age, self.progress, self.rate, self.eta):
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, job)
        else:
            self._phases[key] = phase
        counts: dict[str, int] = dict.fromkeys(PHASES, 0)
        for value in self._phases.values():
            counts[value] = counts.get(value, 0) + 1
        for name, count in counts.items():
            self.jobs.labels(name).set(count)

    def job_progress(self, namespace: str, job: str, progress: ProgressStatus | None,
                     now: datetime) -> None:
        """The progress gauges of a job from its status.progress (unset values: not exported)."""
        if progress is None:
            return
        if progress.percent_complete is not None:
            self.progress.labels(namespace, job).set(progress.percent_complete)
        if progress.steps_per_second is not None:
            self.rate.labels(namespace, job).set(progress.steps_per_second)
        if progress.estimated_completion_time is not None:
            ends = datetime.fromisoformat(progress.estimated_completion_time.replace("Z", "+00:00"))
            self.eta.labels(namespace, job).set(max(0.0, (ends - now).total_seconds()))

    def pass_done(self, namespace: str, name: str, decision: Decision, checkpoint_time: datetime | None) -> None:
        """What a reconcile pass's decision says of its job: phase, progress, restarts, recovery,
        first step, resizes, placement cost, and the newest checkpoint's age."""
        st = decision.status
        now = datetime.now(UTC)
        self.job_phase(namespace, name, st.phase)
        self.job_progress(namespace, name, st.progress, now)
        if decision.restart_reason:
            self.restarts.labels(decision.restart_reason).inc()
        if decision.recovered_seconds is not None:
            self.recovery.observe(decision.recovered_seconds)
        if decision.first_step is not None:
            self.first_step.labels(decision.first_step[1]).observe(decision.first_step[0])
        if decision.launch is not None and st.recovery is not None and st.recovery.mode in ("shrink", "grow"):
            self.resizes.labels(st.recovery.mode).inc()
        if st.placement is not None:
            self.placement_cost.labels(namespace, name).set(st.placement.cost)
        if checkpoint_time is not None:
            self.checkpoint_age.labels(namespace, name).set(max(0.0, (now - checkpoint_time).total_seconds()))

    def serve(self, port: int) -> None:
        if port:
            start_http_server(port, registry=self.registry)


METRICS = Metrics()
