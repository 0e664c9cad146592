"""The reconciler's decisions: a pure function from observed state to actions.

`reconcile(observed)` is level-triggered: it recomputes what should exist from
the spec, the status it wrote last time, and what it sees now (pods, nodes,
checkpoints), and returns the actions for the Kubernetes edge plus the one
status to write. It never talks to an API and never reads a clock: `now` is an
input. Running it twice on the same input gives the same answer, so an
operator restart at any line converges without duplicating pods.

Attempts: `status.attempt` is the restart epoch of the current gang, whose pods
may not exist yet. A restart bumps it and deletes the older attempt's pods;
the pods' own labels also carry it, so if the operator dies after creating
pods but before writing status, the next pass still finds the current attempt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from topotrain import elastic, policy
from topotrain.api import TrainingJobSpec
from topotrain.planning import Planner, PlanOutcome
from topotrain.reconcile_status import CheckpointView, StatusBuilder, iso
from topotrain.status import ConditionType as C
from topotrain.status import Reason, TrainingJobStatus

CHECKPOINT_UNAVAILABLE = "CheckpointStoreUnavailable"
WAIT_SHORT = 2.0  # seconds: something in flight that no watch event announces


@dataclass(frozen=True)
class RankTable:
    """The placement of an earlier attempt, read back from the job's ConfigMap."""

    attempt: int
    data: int
    assignments: Mapping[int, str]


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile pass looks at."""

    name: str
    namespace: str
    generation: int
    spec: TrainingJobSpec
    status: TrainingJobStatus
    pods: tuple[policy.PodView, ...]
    nodes: Mapping[str, policy.NodeView]
    planner: Planner
    now: datetime
    checkpoint: CheckpointView | None = None  # None: the job has no spec.checkpoint
    rank_table: RankTable | None = None
    config_problem: tuple[str, str] | None = None  # (reason, message)
    strategy: str = "incremental"  # or "recreate" (the full-gang baseline)


@dataclass(frozen=True)
class Launch:
    """Create the pods of one attempt (gated), then release the gate on all of them."""

    attempt: int
    data: int
    pool: str | None
    assignments: Mapping[int, str]  # pod index -> node, every index of the gang
    resume_step: int | None
    mode: str
    only: tuple[int, ...] = ()  # create just these indices (finishing a half-created gang)
    release: bool = True  # False: older pods still hold the nodes; a later pass releases the gate


@dataclass
class Decision:
    """The actions of one pass and the status to write."""

    status: TrainingJobStatus
    delete: list[str] = field(default_factory=list)
    launch: Launch | None = None
    release: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    requeue_after: float | None = None
    restart_reason: str | None = None  # for the restarts metric
    recovered_seconds: float | None = None  # for the recovery histogram
    placement_cost: float | None = None


def selector(name: str) -> str:
    return f"topotrain.io/job={name}"


def reconcile(obs: Observed) -> Decision:
    """One level-triggered pass."""
    sb = StatusBuilder(obs.status, obs.generation, obs.now)
    sb.status.selector = selector(obs.name)
    sb.observe_checkpoint(obs.checkpoint)
    decision = Decision(status=sb.status)
    if sb.status.phase in ("Succeeded", "Failed"):
        decision.delete = [p.name for p in obs.pods if not p.terminating]
        return _finish(decision, sb)
    attempt = max([sb.status.attempt, *(p.attempt for p in obs.pods)])
    sb.status.attempt = attempt
    current = [p for p in obs.pods if p.attempt == attempt]
    decision.delete = [p.name for p in obs.pods if p.attempt < attempt and not p.terminating]
    if obs.config_problem is not None:
        sb.config_invalid(*obs.config_problem)
        decision.events.extend(sb.events)
        if not current:
            decision.requeue_after = None  # a Secret or node change wakes us
            return _finish(decision, sb)
    else:
        sb.config_ok()
    if not current:
        _launch(obs, sb, decision, attempt)
    else:
        _steady(obs, sb, decision, attempt, current)
    return _finish(decision, sb)


def _finish(decision: Decision, sb: StatusBuilder) -> Decision:
    decision.status = sb.status
    decision.events = list(dict.fromkeys([*decision.events, *sb.events]))
    return decision


def _lost_nodes(obs: Observed, nodes: Mapping[int, str]) -> frozenset[str]:
    return frozenset(
        n for n in nodes.values() if n not in obs.nodes or not obs.nodes[n].ready
    )


def _backoff_left(obs: Observed, sb: StatusBuilder) -> float:
    """Seconds left of the restart backoff after the last failure."""
    st = sb.status
    rec, failure = st.recovery, st.last_failure
    if rec is None or rec.started is None or failure is None or failure.time != rec.started:
        return 0.0  # no failure-triggered recovery in flight (a resize has no backoff)
    delay = policy.backoff_seconds(obs.spec.failure_policy, st.restarts)
    return max(0.0, delay - (obs.now - sb.parse(failure.time)).total_seconds())





def _launch(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    previous: Mapping[int, str] | None = None, outcome: PlanOutcome | None = None,
) -> None:
    """No pod of the current attempt exists: place the gang and create it."""
    if obs.config_problem is not None:
        return
    waiting = _backoff_left(obs, sb)
    if waiting > 0:
        failure = sb.status.last_failure
        since = sb.parse(failure.time) if failure else obs.now
        delay = policy.backoff_seconds(obs.spec.failure_policy, sb.status.restarts)
        sb.set(C.RECOVERING, True, Reason.BACKOFF,
               f"restart {sb.status.restarts} waits until {iso(since + timedelta(seconds=delay))}")
        decision.requeue_after = waiting
        return
    ckpt = obs.checkpoint
    if ckpt is not None and not ckpt.reachable:
        sb.set(C.RECOVERING if sb.status.attempt else C.SCHEDULABLE, False, CHECKPOINT_UNAVAILABLE,
               f"cannot read the checkpoint store, so the resume step is unknown: {ckpt.error}")
        decision.requeue_after = WAIT_SHORT
        return
    if obs.strategy == "recreate" and any(p.attempt < attempt for p in obs.pods):
        decision.requeue_after = WAIT_SHORT  # the baseline waits until the old gang is gone
        return
    if outcome is None:
        outcome = _plan(obs, sb, previous)
    if not outcome.feasible:
        sb.unschedulable(outcome.reason, outcome.message)
        decision.requeue_after = None  # node and pod events wake us when capacity changes
        return
    resume = None if ckpt is None else ckpt.step
    previous_data = sb.status.parallelism.data if sb.status.parallelism else outcome.data
    sb.placed(outcome, obs.spec.parallelism, previous_data, resume)
    # Gated pods are never tried by the scheduler, so holding the gate until the older attempt's
    # pods are gone avoids the scheduler's backoff on nodes they still occupy.
    decision.launch = Launch(
        attempt=attempt, data=outcome.data, pool=outcome.pool,
        assignments=dict(outcome.assignments), resume_step=resume, mode=outcome.mode,
        release=not _blocking(obs, attempt, set(outcome.assignments.values())),
    )
    decision.placement_cost = outcome.cost


def _plan(obs: Observed, sb: StatusBuilder, previous: Mapping[int, str] | None) -> PlanOutcome:
    low, high = elastic.bounds(obs.spec.parallelism)
    table = obs.rank_table
    if previous is None and table is not None and table.attempt < sb.status.attempt:
        previous = table.assignments
    recovering = sb.status.recovery is not None and sb.status.recovery.started is not None
    if obs.strategy == "incremental" and previous and recovering:
        current = sb.status.parallelism.data if sb.status.parallelism else high
        if low <= current <= high:
            return obs.planner.replan(previous, _lost_nodes(obs, previous), low, current)
    return obs.planner.plan(low, high)


def _steady(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView],
) -> None:
    """The current attempt has pods: finish creating it, watch it, restart it or resize it."""
    data = sb.status.parallelism.data if sb.status.parallelism else obs.spec.parallelism.data
    expected = elastic.pods_for(obs.spec.parallelism, data, obs.spec.worker.gpus_per_pod)
    live = [p for p in current if not p.terminating]
    if all(p.gated for p in live) and not any(p.terminating for p in current):
        _finish_creating(obs, decision, attempt, live, expected)
        return
    decision.release = [p.name for p in live if p.gated]  # a release cut short by a crash
    if len(current) == expected and all(p.phase == "Succeeded" for p in current):
        sb.succeeded()
        decision.delete += [p.name for p in current if not p.terminating]
        return
    failure = policy.detect_failure(
        current, expected, obs.nodes, obs.spec.failure_policy, started=True
    )
    running = len(live) == expected and all(p.phase in ("Running", "Succeeded") for p in live)
    if failure is None and running and obs.checkpoint is not None:
        # progress.json lives in the checkpoint prefix: no checkpoint store, no hang detection
        heartbeat = obs.checkpoint.progress_time
        if obs.checkpoint.progress_attempt != attempt:
            heartbeat = None  # an earlier attempt's: this trainer is still starting
        failure = policy.stalled_failure(
            heartbeat, sb.running_since(), obs.spec.failure_policy, obs.now,
        )
    if failure is not None:
        _on_failure(obs, sb, decision, attempt, current, failure)
        return
    if not running:
        sb.pods_pending(sum(p.phase == "Running" for p in live), expected)
        return
    decision.recovered_seconds = sb.running()
    _maybe_resize(obs, sb, decision, attempt, current, data)


def _finish_creating(
    obs: Observed, decision: Decision, attempt: int, live: list[policy.PodView], expected: int
) -> None:
    """Every pod is still gated: create the missing ones, or release them all together."""
    missing = tuple(i for i in range(expected) if i not in {p.index for p in live})
    if not missing:
        if _blocking(obs, attempt, {p.where for p in live}):
            decision.requeue_after = WAIT_SHORT  # their deletion events wake us sooner
            return
        decision.release = [p.name for p in live]
        return
    table = obs.rank_table
    if table is not None and table.attempt == attempt and all(i in table.assignments for i in missing):
        decision.launch = Launch(
            attempt=attempt, data=table.data, pool=obs.status.pool,
            assignments=dict(table.assignments), resume_step=_resume_of(obs), mode="resume",
            only=missing,
        )
        return
    decision.delete += [p.name for p in live]  # no record of the plan: start this attempt over
    decision.requeue_after = WAIT_SHORT


def _blocking(obs: Observed, attempt: int, nodes: set[str]) -> bool:
    """Older pods still on healthy nodes the new gang needs (pods on lost nodes never block)."""
    return any(
        p.attempt < attempt and p.where in nodes and p.where in obs.nodes and obs.nodes[p.where].ready
        for p in obs.pods
    )


def _resume_of(obs: Observed) -> int | None:
    rec = obs.status.recovery
    return rec.resume_step if rec is not None else None


def _on_failure(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], failure: policy.Failure,
) -> None:
    verdict = policy.decide(failure, sb.status.restarts, obs.spec.failure_policy)
    sb.record_failure(failure)
    decision.delete += [p.name for p in current if not p.terminating]
    if verdict.action == "fail":
        sb.failed(verdict.reason, verdict.message)
        return
    decision.restart_reason = failure.reason
    sb.restarting(verdict, attempt + 1)
    previous = {p.index: p.where for p in current if p.where}
    if verdict.delay_seconds > 0 or obs.strategy != "incremental":
        decision.requeue_after = verdict.delay_seconds or WAIT_SHORT
        return
    _launch(obs, sb, decision, attempt + 1, previous=previous)


def _maybe_resize(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], data: int,
) -> None:
    """Running: grow back toward spec.parallelism.data, or follow `kubectl scale` down."""
    request = elastic.resize_request(obs.spec.parallelism, data)
    if request is None or obs.config_problem is not None:
        return
    outcome = obs.planner.plan(request.low, request.high)
    if not outcome.feasible or not request.worth_it(outcome.data):
        return
    decision.delete += [p.name for p in current if not p.terminating]
    sb.resizing(request, outcome.data, attempt + 1)
    _launch(obs, sb, decision, attempt + 1, outcome=outcome)
