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
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason, TrainingJobStatus
from topotrain.core import elastic, inplace, planned, policy
from topotrain.core.kueue_admission import QueueGate
from topotrain.core.manifests import RankTable
from topotrain.core.planning import Planner, PlanOutcome
from topotrain.core.reconcile_status import (
    REFUSAL_REASONS,
    CheckpointView,
    StatusBuilder,
    iso,
    parse,
)

CHECKPOINT_UNAVAILABLE = Reason.STORE_UNAVAILABLE
WAIT_SHORT = 2.0  # seconds: something in flight that no watch event announces
OVERDUE_SECONDS = 30.0  # past a Terminating pod's grace period: deleted again (_overdue)
SAVING = "waiting for the stopping pods' SIGTERM checkpoint"  # Ready's message while it waits
CREATE_RETRY = 10.0  # seconds between tries to create a gang the API server refused
REFUSALS = REFUSAL_REASONS


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
    last_refusal: datetime | None = None  # when the API server last refused this job's pods
    template: str = ""  # hash of the pod template the spec asks for (manifests.template_hash)
    # The same cluster with the job's avoided nodes back in: used only when nothing else fits,
    # so avoiding nodes that failed the job never strands it (None: no node is avoided).
    unavoiding_planner: Planner | None = None
    # A cordoned node of the running gang moves the gang off it, checkpointing first (False: the
    # gang stays until an eviction, as any pod would).
    move_off_cordoned: bool = True
    # Seconds a planned change waits for the checkpoint it asks for (0: it asks none).
    checkpoint_request_timeout: float = planned.CHECKPOINT_REQUEST_TIMEOUT
    queue: QueueGate | None = None  # None: the job is not sent to a Kueue queue


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
    in_place: bool = False  # the other indices are kept pods of an in-place restart
    master_addr: str | None = None  # rank 0's address when pod 0 is a kept pod


@dataclass(frozen=True)
class Relabel:
    """Move kept pods to the attempt of an in-place restart (label and control annotations)."""

    pods: tuple[str, ...]
    attempt: int
    resume_step: int | None
    master_addr: str


@dataclass
class Decision:
    """The actions of one pass and the status to write."""

    status: TrainingJobStatus
    delete: list[str] = field(default_factory=list)
    launch: Launch | None = None
    relabel: Relabel | None = None
    release: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    requeue_after: float | None = None
    restart_reason: str | None = None  # for the restarts metric
    recovered_seconds: float | None = None  # for the recovery histogram
    first_step: tuple[float, str] | None = None  # (time to first step, cause) for its histogram
    checkpoint_request: planned.CheckpointAsk | None = None  # before a planned change (planned.py)
    placement_cost: float | None = None
    # Kueue evicted the job and none of its pods is left: give the quota back (handlers_queue.py
    # clears the Workload's admission, so Kueue requeues it).
    release_quota: bool = False


def selector(name: str) -> str:
    return f"topotrain.io/job={name}"


def reconcile(obs: Observed) -> Decision:
    """One level-triggered pass."""
    sb = StatusBuilder(obs.status, obs.generation, obs.now)
    sb.status.selector = selector(obs.name)
    sb.observe_checkpoint(obs.checkpoint)
    decision = Decision(status=sb.status)
    if sb.status.phase in ("Succeeded", "Failed"):
        # A Failed job keeps its crashed pods (they hold no GPUs) so their logs can be read.
        keep = ("Failed",) if sb.status.phase == "Failed" else ()
        decision.delete = [p.name for p in obs.pods if not p.terminating and p.phase not in keep]
        sb.status.observed_generation = obs.generation
        return _finish(decision, sb)
    attempt = max([sb.status.attempt, *(p.attempt for p in obs.pods)])
    sb.status.attempt = attempt
    pods, stale = inplace.effective(obs.pods, sb.status)
    obs = replace(obs, pods=pods)
    current = [p for p in obs.pods if p.attempt == attempt]
    decision.delete = [p.name for p in obs.pods if p.attempt < attempt and not p.terminating
                       and p.phase != "Failed"]
    decision.delete += _overdue(obs)
    _relabel(obs, sb, decision, attempt, stale)
    if obs.config_problem is not None:
        sb.config_invalid(*obs.config_problem)
        decision.events.extend(sb.events)
        if not current:
            decision.requeue_after = None  # a Secret or node change wakes us
            return _finish(decision, sb)
    else:
        sb.config_ok()
    queue = obs.queue
    if queue is not None and not obs.spec.suspend:
        _admission(obs, sb, queue)
    if not obs.spec.suspend and sb.status.phase == "Suspended" and not (queue and queue.holds):
        sb.resumed() if queue is None else sb.resumed(
            f"{queue.message}: the gang starts again from the newest committed step")
    if obs.spec.suspend:
        _suspend(obs, sb, decision, attempt, current)
    elif queue is not None and queue.holds:
        _hold_for_queue(obs, sb, decision, attempt, current)
    elif not current and sb.status.phase == "Running":
        # The Running gang vanished whole before a pass saw a pod go (a one-pod gang's pod
        # deleted, a lost node's pods collected): a failure, never a relaunch of the same attempt.
        data = sb.status.parallelism.data if sb.status.parallelism else obs.spec.parallelism.data
        expected = elastic.pods_for(obs.spec.parallelism, data, obs.spec.worker.gpus_per_pod)
        gone = policy.detect_failure([], expected, obs.nodes, obs.spec.failure_policy, started=True)
        if gone is not None:
            _on_failure(obs, sb, decision, attempt, [], gone)
    elif not current:
        _launch(obs, sb, decision, attempt)
    elif inplace.in_flight(sb.status) and _missing_replaced(sb, current):
        _replace_in_place(obs, sb, decision, attempt, current, settled=not stale)
    else:
        _steady(obs, sb, decision, attempt, current)
    if queue is not None and queue.evicted:
        # (spec.suspend too: it deactivates the Workload, which Kueue evicts)
        decision.release_quota = not any(p.phase not in ("Failed", "Succeeded") for p in obs.pods)
    if sb.status.phase == "Running":
        decision.first_step = sb.first_step(obs.checkpoint)
    if sb.status.phase in ("Running", "Succeeded", "Failed"):
        # The crashed pods of earlier attempts were kept for their logs until now.
        decision.delete += [p.name for p in obs.pods if p.attempt < attempt and p.phase == "Failed"
                            and not p.terminating]
    # observedGeneration moves only once the pods that stay run this generation's template.
    staying = [p for p in obs.pods if not p.terminating and p.name not in set(decision.delete)
               and p.phase not in ("Failed", "Succeeded")]
    if not any(p.template and obs.template and p.template != obs.template for p in staying):
        sb.status.observed_generation = obs.generation
    return _finish(decision, sb)


def _finish(decision: Decision, sb: StatusBuilder) -> Decision:
    planned.settle(sb)
    sb.summarize()
    decision.status = sb.status
    decision.events = list(dict.fromkeys([*decision.events, *sb.events]))
    return decision


def _lost_nodes(obs: Observed, sb: StatusBuilder, nodes: Mapping[int, str],
                avoiding: bool = True) -> frozenset[str]:  # fmt: skip
    """Nodes of the previous placement that a recovery must move off: gone, NotReady or avoided."""
    avoided = policy.avoided_nodes(sb.status.node_failures) if avoiding else frozenset()
    return frozenset(
        n for n in nodes.values() if not _ready(obs, n) or n in avoided
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
    resume: int | None = None,
) -> None:
    """No pod of the current attempt exists: place the gang and create it, resuming from
    `resume` (a planned change's served checkpoint) or else the newest commit."""
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
    if _refused_too_long(obs, sb, decision):
        return
    ckpt = obs.checkpoint
    if ckpt is not None and not ckpt.reachable:
        sb.set(C.RECOVERING if sb.status.attempt else C.SCHEDULABLE, False, CHECKPOINT_UNAVAILABLE,
               f"cannot read the checkpoint store, so the resume step is unknown: {ckpt.error}")
        decision.requeue_after = WAIT_SHORT
        return
    if obs.strategy == "recreate" and any(p.attempt < attempt and p.phase != "Failed" for p in obs.pods):
        decision.requeue_after = WAIT_SHORT  # the baseline waits until the old gang is gone
        return
    if outcome is None:
        outcome = _plan(obs, sb, previous)
    if not outcome.feasible:
        sb.unschedulable(outcome.reason, outcome.message)
        decision.requeue_after = None  # node and pod events wake us when capacity changes
        return
    if resume is None:
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


def _refused_too_long(obs: Observed, sb: StatusBuilder, decision: Decision) -> bool:
    """The API server refused the gang's pods: retry every CREATE_RETRY s, fail after the timeout.

    True when this pass must not create pods (waiting to retry, or the job just Failed).
    """
    cond = sb.status.condition(C.PODS_CREATED)
    if cond is None or cond.status != "False" or cond.reason not in (*REFUSALS, Reason.FOREIGN_OBJECT):
        return False
    limit = obs.spec.failure_policy.scheduling_timeout_seconds
    if cond.reason == Reason.FOREIGN_OBJECT:
        limit = 0  # a namesake's pod goes away by itself: wait for it, however long
    since = sb.parse(cond.last_transition_time) if cond.last_transition_time else obs.now
    refused_for = (obs.now - since).total_seconds()
    if limit > 0 and refused_for > limit:
        sb.failed(cond.reason, f"the API server refused the gang's pods for {int(refused_for)}s "
                  f"(spec.failurePolicy.schedulingTimeoutSeconds {limit}): {cond.message}")
        return True
    if obs.last_refusal is not None:
        wait = CREATE_RETRY - (obs.now - obs.last_refusal).total_seconds()
        if wait > 0:
            decision.requeue_after = wait
            return True
    return False


def _plan(obs: Observed, sb: StatusBuilder, previous: Mapping[int, str] | None) -> PlanOutcome:
    outcome = _plan_on(obs, sb, previous, obs.planner, avoiding=True)
    avoided = policy.avoided_nodes(sb.status.node_failures)
    if outcome.feasible or not avoided or obs.unavoiding_planner is None:
        return outcome
    # Nothing fits without the nodes that failed this job: use them again rather than wait for
    # capacity that may never come (every node of a small pool can reach the threshold).
    relaxed = _plan_on(obs, sb, previous, obs.unavoiding_planner, avoiding=False)
    if relaxed.feasible:
        sb.forgive_nodes(avoided & set(relaxed.assignments.values()))
        return relaxed
    return outcome


def _plan_on(obs: Observed, sb: StatusBuilder, previous: Mapping[int, str] | None,
             planner: Planner, avoiding: bool) -> PlanOutcome:  # fmt: skip
    low, high = elastic.bounds(obs.spec.parallelism)
    table = obs.rank_table
    if previous is None and table is not None and table.attempt < sb.status.attempt:
        previous = table.assignments
    recovering = sb.status.recovery is not None and sb.status.recovery.started is not None
    if obs.strategy == "incremental" and previous and recovering:
        current = sb.status.parallelism.data if sb.status.parallelism else high
        if low <= current <= high:
            return planner.replan(previous, _lost_nodes(obs, sb, previous, avoiding), low, current)
    return planner.plan(low, high)


def _steady(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView],
) -> None:
    """The current attempt has pods: finish creating it, watch it, restart it or resize it."""
    data = sb.status.parallelism.data if sb.status.parallelism else obs.spec.parallelism.data
    expected = elastic.pods_for(obs.spec.parallelism, data, obs.spec.worker.gpus_per_pod)
    live = [p for p in current if not p.terminating]
    if all(p.gated for p in live) and not any(p.terminating for p in current):
        _finish_creating(obs, sb, decision, attempt, live, expected)
        return
    sb.set(C.PODS_CREATED, True, Reason.PODS_CREATED_OK, f"attempt {attempt}: {expected} pods created")
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
        failure = policy.reported_failure(obs.checkpoint.worker_failure, attempt, live,
                                          obs.spec.failure_policy)
    if failure is None and running:
        failure = _hang(obs, sb, attempt)
    if failure is None and not running:
        failure = policy.stuck_failure(live, sb.attempt_started(), obs.spec.failure_policy, obs.now)
    if failure is not None:
        _on_failure(obs, sb, decision, attempt, current, failure)
        return
    if not running:
        pending = [p for p in live if p.phase not in ("Running", "Succeeded")]
        sb.pods_pending(sum(p.phase == "Running" for p in live), expected,
                        policy.pending_detail(pending[0]) if pending else "")
        return
    decision.recovered_seconds = sb.running()
    if _roll_for_spec_change(obs, sb, decision, attempt, current):
        return
    if _move_off_cordoned(obs, sb, decision, attempt, current, data):
        return
    _maybe_resize(obs, sb, decision, attempt, current, data)


def _suspend(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], why: str = "spec.suspend", reason: str = Reason.SUSPENDED,
    then: str = "false resumes it from the newest commit", cause: str = "suspend",
) -> None:
    """spec.suspend: stop the gang and keep the job, losing no step.

    A Running gang is asked for a checkpoint first (planned.py, as for a resize) and keeps
    training until it is committed (or the request's bound passed); then its pods are deleted
    (their trainers also save on SIGTERM) and the attempt moves on, so the gang that resumes is
    a new attempt from the newest commit. A gang not Running yet is deleted at once.
    """
    live = [p for p in current if not p.terminating]
    step = None if obs.checkpoint is None else obs.checkpoint.step
    running = sb.status.phase == "Running" and bool(live) and all(p.phase == "Running" for p in live)
    if running:
        wait = planned.checkpoint_first(sb, obs.checkpoint, current, attempt, cause, obs.now,
                                        obs.checkpoint_request_timeout)
        if not wait.ready:
            decision.checkpoint_request, decision.requeue_after = wait.ask, wait.requeue_after
            sb.suspending(attempt, why)
            return
        step = wait.resume_step if wait.resume_step is not None else step
    else:
        planned.cancel(sb)
    decision.relabel, decision.release = None, []
    if live:
        decision.delete += [p.name for p in live if p.name not in decision.delete]
        sb.status.attempt = attempt + 1
    sb.suspended(step, len(live), why, reason, then)


def _admission(obs: Observed, sb: StatusBuilder, queue: QueueGate) -> None:
    """The Admitted condition from Kueue's decision."""
    if queue.evicted:
        sb.admission(False, Reason.EVICTED, queue.message)
    elif queue.admitted:
        sb.admission(True, Reason.KUEUE_ADMITTED, queue.message)
    else:
        sb.admission(False, Reason.WAITING_FOR_ADMISSION, queue.message)


def _hold_for_queue(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView],
) -> None:
    """Kueue has not admitted the job, or evicted it: no gang runs.

    A job that never ran waits Pending. An evicted gang stops as for spec.suspend (a
    checkpoint first, then its pods go), the job is Suspended until Kueue admits it again,
    and once none of its pods is left the quota is given back, so Kueue requeues it (and
    the preemptor's pods do not wait for GPUs still held).
    """
    if current or sb.status.start_time or sb.status.phase == "Suspended":
        _suspend(obs, sb, decision, attempt, current, why="evicted by Kueue",
                 reason=Reason.EVICTED, cause="evict", then="it resumes from the newest commit once Kueue "
                 "admits it again")



def _hang(obs: Observed, sb: StatusBuilder, attempt: int) -> policy.Failure | None:
    """A hang, judged by the operator's own clock; never while the checkpoint store is unreadable.

    progress.json lives in the checkpoint prefix: no checkpoint store, no hang detection.
    """
    ckpt = obs.checkpoint
    if ckpt is None or not ckpt.reachable:
        return None
    progress = sb.status.progress
    heartbeat = None
    if progress is not None and progress.attempt == attempt and progress.observed_time:
        heartbeat = sb.parse(progress.observed_time)  # an earlier attempt's: still starting
    # Ready may have stayed True from an earlier attempt (no pass saw this one's pods Pending):
    # the clock never starts before this attempt's pods were created.
    clocks = (sb.running_since(), sb.store_reachable_since(), sb.attempt_started())
    since = [t for t in clocks if t is not None]
    return policy.stalled_failure(
        heartbeat, max(since) if since else None, obs.spec.failure_policy, obs.now,
    )


def _roll_for_spec_change(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView],
) -> bool:
    """The spec's pod template changed: restart the gang on it, losing no step.

    A checkpoint of the running gang comes first (planned.py, as for a resize): the new
    template resumes from the step the change was seen at, or from the last commit once the
    request's bound passed. The old gang keeps training meanwhile. Pods without the template
    annotation (made by an older operator) are taken as current.
    """
    stale = [p for p in current if p.template and obs.template and p.template != obs.template]
    if not stale:
        sb.status.template_generation = obs.generation
        return False
    if obs.config_problem is not None:
        return False  # a spec that cannot run yet: keep the running gang
    wait = planned.checkpoint_first(sb, obs.checkpoint, current, attempt, "rollout", obs.now,
                                    obs.checkpoint_request_timeout)
    if not wait.ready:
        decision.checkpoint_request, decision.requeue_after = wait.ask, wait.requeue_after
        return True
    decision.delete += [p.name for p in current if not p.terminating]
    resume = wait.resume_step
    if resume is None and obs.checkpoint is not None:
        resume = obs.checkpoint.step
    sb.rolling(obs.generation, attempt + 1, resume)
    _launch(obs, sb, decision, attempt + 1, resume=resume)
    return True


def _finish_creating(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    live: list[policy.PodView], expected: int,
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
    resumes = {p.resume_step for p in live}
    if (table is not None and table.attempt == attempt and all(i in table.assignments for i in missing)
            and len(resumes) == 1 and _newer_commit(obs, _step(next(iter(resumes)))) is None):
        # The gang's other pods say which step it resumes from: every pod must agree.
        resume = next(iter(resumes))
        decision.launch = Launch(
            attempt=attempt, data=table.data, pool=obs.status.pool,
            assignments=dict(table.assignments), resume_step=_step(resume),
            mode="resume", only=missing,
        )
        return
    # No record of the plan, or a newer step was committed since the gang was told its step
    # (nothing of it runs yet: all gated): start this attempt over.
    decision.delete += [p.name for p in live]
    decision.requeue_after = WAIT_SHORT


def _step(annotation: str | None) -> int | None:
    return int(annotation) if annotation else None


def _overdue(obs: Observed) -> list[str]:
    """Pods still Terminating on a Ready node long after their grace period ended: deleted again.

    A kubelet removes such a pod within its grace period. One that lingers may be a ghost (a
    deletion the watch missed: snapshot.Ghosts); the API server's 404 to this delete says so, and
    for a real pod the delete changes nothing.
    """
    return [p.name for p in obs.pods if p.terminating and p.deletion_deadline and _ready(obs, p.node)
            and (obs.now - parse(p.deletion_deadline)).total_seconds() > OVERDUE_SECONDS]


def _ready(obs: Observed, node: str) -> bool:
    """The node is in the cluster and Ready (its kubelet acts on its pods)."""
    return node in obs.nodes and obs.nodes[node].ready


def _blocking(obs: Observed, attempt: int, nodes: set[str]) -> bool:
    """Older pods still on healthy nodes the new gang needs (pods on lost nodes never block)."""
    return any(
        p.attempt < attempt and p.phase not in ("Failed", "Succeeded") and p.where in nodes
        and _ready(obs, p.where)
        for p in obs.pods
    )


def _still_saving(obs: Observed, sb: StatusBuilder, current: list[policy.PodView]
                  ) -> tuple[float, datetime]:
    """(seconds to wait, when the wait began) before restarting a gang whose pods someone is
    deleting gracefully; 0 seconds: restart now.

    An evicted or deleted pod gets SIGTERM and its grace period; the bundled trainer saves the
    current step in it (docs/trainer.md). Restarting at once would resume from the last periodic
    commit and throw that save away, so the restart waits while a pod of the attempt is still
    Terminating and not yet stopped on a Ready node, at most its terminationGracePeriodSeconds
    from when the wait began (`_saving_since`). The
    deletionTimestamp is not the bound: a force delete after the graceful one moves it to now
    while the containers still run. Not for a job without a readable checkpoint store, nor for
    pods on lost nodes (their kubelet is gone).
    """
    if obs.checkpoint is None or not obs.checkpoint.reachable:
        return 0.0, obs.now
    stopping = [p for p in current if p.terminating and p.phase not in ("Failed", "Succeeded")
                and _ready(obs, p.where)]
    if not stopping:
        return 0.0, obs.now
    since = _saving_since(sb, obs.now)
    grace = max(p.grace_seconds for p in stopping)
    return max(0.0, grace - (obs.now - since).total_seconds()), since


def _saving_since(sb: StatusBuilder, now: datetime) -> datetime:
    """When the wait for stopping pods began: the Ready condition's message says (it is written
    on the wait's first pass and kept while the wait lasts); else now."""
    ready = sb.status.condition(C.READY)
    if ready is None or ready.reason != Reason.POD_DELETED or f"{SAVING} since " not in ready.message:
        return now
    stamp = ready.message.rsplit(f"{SAVING} since ", 1)[1].split(" ", 1)[0]
    try:
        return sb.parse(stamp)
    except ValueError:
        return now


def _on_failure(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], failure: policy.Failure,
) -> None:
    saving, since = _still_saving(obs, sb, current) if failure.reason == Reason.POD_DELETED else (0.0, obs.now)
    if saving > 0:
        # Nothing is recorded yet: the next pass sees the same failure, once the pods are gone.
        sb.set(C.READY, False, failure.reason,
               f"{failure.message}; {SAVING} since {iso(since)} (up to {saving:.0f}s more)")
        decision.requeue_after = min(saving, WAIT_SHORT)
        return
    used = policy.used_budgets(sb.status.restarts, sb.status.restarts_by_class)
    verdict = policy.decide(failure, used, obs.spec.failure_policy)
    sb.record_failure(failure, obs.spec.failure_policy)
    keep, moved = (_in_place_plan(obs, sb, attempt, current, failure) if verdict.action == "restart"
                   else (None, None))  # fmt: skip
    if keep is not None:
        decision.restart_reason = failure.reason
        if moved is not None:  # a lost node's pod moves: the placement changes
            sb.placement(moved)
            decision.placement_cost = moved.cost
        _restart_in_place(obs, sb, decision, attempt, verdict, failure, keep)
        return
    decision.relabel = None  # a kept pod failed again: the gang is recreated
    # The crashed pods stay (they hold no GPUs) until the next attempt runs: their logs survive.
    decision.delete += [p.name for p in current if not p.terminating and p.phase != "Failed"]
    if verdict.action == "fail":
        sb.failed(verdict.reason, verdict.message)
        return
    decision.restart_reason = failure.reason
    sb.restarting(verdict, attempt + 1, failure.kind)
    previous = {p.index: p.where for p in current if p.where}
    table = obs.rank_table
    if table is not None and table.attempt == attempt:
        # Pods that vanished (deleted, evicted) are no longer in `current`: the attempt's
        # placement says where they ran, so the re-plan sees the whole gang.
        previous = {**table.assignments, **previous}
    if verdict.delay_seconds > 0 or obs.strategy != "incremental":
        decision.requeue_after = verdict.delay_seconds or WAIT_SHORT
        return
    _launch(obs, sb, decision, attempt + 1, previous=previous)


def _move_off_cordoned(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], data: int,
) -> bool:
    """A node of the running gang was cordoned (`kubectl cordon`, or the first half of
    `kubectl drain`): move the gang off it before an eviction comes, losing no step.

    Planned like a resize (planned.py): the running gang is asked for a checkpoint and keeps
    training; once that checkpoint is committed (or the request's bound passed) the gang restarts
    from it on nodes that are not cordoned, at its current data degree or more (up to
    spec.parallelism.data; less only where the spec now asks for less). No failure budget is
    spent. When the gang fits nowhere else at that degree it stays where it is: a cordon alone
    takes nothing from the job, and an eviction later is an ordinary drain (its SIGTERM save;
    that recovery may shrink). True when this pass acted (asked, or moved).
    """
    if not obs.move_off_cordoned or obs.config_problem is not None:
        return False
    cordoned = sorted({p.node for p in current if not p.terminating and p.node in obs.nodes
                       and obs.nodes[p.node].cordoned})  # fmt: skip
    if not cordoned:
        return False
    low, high = elastic.bounds(obs.spec.parallelism)
    # `data`: the running degree; cordoned nodes are not in the planner's inventory
    outcome = obs.planner.plan(max(low, min(data, high)), high)
    if not outcome.feasible or set(cordoned) & set(outcome.assignments.values()):
        return False
    wait = planned.checkpoint_first(sb, obs.checkpoint, current, attempt, "drain", obs.now,
                                    obs.checkpoint_request_timeout)
    if not wait.ready:
        decision.checkpoint_request, decision.requeue_after = wait.ask, wait.requeue_after
        return True
    decision.delete += [p.name for p in current if not p.terminating]
    sb.moving(cordoned, outcome.data, attempt + 1, wait.resume_step)
    _launch(obs, sb, decision, attempt + 1, outcome=outcome, resume=wait.resume_step)
    return True


def _maybe_resize(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], data: int,
) -> None:
    """Running: grow back toward spec.parallelism.data, or follow `kubectl scale` down.

    A checkpoint of the running gang comes first (planned.py), so the new degree resumes from
    the step the change was asked at rather than from the last periodic commit.
    """
    request = elastic.resize_request(obs.spec.parallelism, data)
    if request is None or obs.config_problem is not None:
        planned.cancel(sb)
        return
    outcome = obs.planner.plan(request.low, request.high)
    if not outcome.feasible or not request.worth_it(outcome.data):
        planned.cancel(sb)
        return
    wait = planned.checkpoint_first(sb, obs.checkpoint, current, attempt, "resize", obs.now,
                                    obs.checkpoint_request_timeout)
    if not wait.ready:
        decision.checkpoint_request, decision.requeue_after = wait.ask, wait.requeue_after
        return
    decision.delete += [p.name for p in current if not p.terminating]
    sb.resizing(request, outcome.data, attempt + 1)
    _launch(obs, sb, decision, attempt + 1, outcome=outcome, resume=wait.resume_step)


# --- in-place restart (see inplace.py) ------------------------------------------


def _in_place_plan(
    obs: Observed, sb: StatusBuilder, attempt: int, current: list[policy.PodView],
    failure: policy.Failure,
) -> tuple[inplace.InPlacePlan | None, PlanOutcome | None]:
    """The in-place restart for `failure`, if any, and the re-plan that moves a lost node's pod
    (None when no pod changes node)."""
    ckpt = obs.checkpoint
    if (not obs.spec.failure_policy.restart_in_place or obs.strategy != "incremental"
            or (ckpt is not None and not ckpt.reachable) or obs.config_problem is not None):
        return None, None
    data = sb.status.parallelism.data if sb.status.parallelism else obs.spec.parallelism.data
    expected = elastic.pods_for(obs.spec.parallelism, data, obs.spec.worker.gpus_per_pod)
    table = obs.rank_table
    placed = dict(table.assignments) if table is not None and table.attempt == attempt else None
    previous = {**(placed or {}), **{p.index: p.where for p in current if p.where}}
    outcome = _relocated(obs, sb, previous, data) if failure.lost_nodes else None
    relocated = None if outcome is None else {
        i: n for i, n in outcome.assignments.items() if previous.get(i) != n}
    keep = inplace.plan(failure, current, expected, obs.nodes,
                        policy.avoided_nodes(sb.status.node_failures), sb.status, attempt, placed,
                        relocated)  # fmt: skip
    return keep, outcome


def _relocated(
    obs: Observed, sb: StatusBuilder, previous: Mapping[int, str], data: int,
) -> PlanOutcome | None:
    """A lost node's pods: the incremental re-plan of `previous` (index -> node; the same re-plan
    a recreate would use) at the running degree, or None when it re-places more (mode "full", a
    shrink)."""
    if not previous:
        return None
    low, _ = elastic.bounds(obs.spec.parallelism)
    outcome = obs.planner.replan(previous, _lost_nodes(obs, sb, previous), low, data)
    if not outcome.feasible or outcome.mode != "incremental" or outcome.data != data:
        return None
    return outcome if set(outcome.assignments) == set(previous) else None


def _restart_in_place(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    verdict: policy.RestartDecision, failure: policy.Failure, keep: inplace.InPlacePlan,
) -> None:
    """Keep the healthy pods (moved to the next attempt), replace only the failed indices."""
    nxt = attempt + 1
    sb.restarting(verdict, nxt, failure.kind)
    rec = sb.status.recovery
    assert rec is not None
    rec.mode, rec.replaced_indices = inplace.IN_PLACE, sorted(keep.replaced)
    rec.resume_step = obs.checkpoint.step if obs.checkpoint is not None else None
    sb.status.attempt_start_time = iso(obs.now)
    step = "from scratch" if rec.resume_step is None else f"from step {rec.resume_step}"
    where = ", ".join(f"index {i} on {n}" for i, n in sorted(keep.replaced.items()))
    message = (f"attempt {nxt} {step} in place: kept {len(keep.kept)} pod(s)"
               + (f", replacing {where}" if where else ""))
    sb.set(C.RECOVERING, True, Reason.RESTARTED_IN_PLACE, f"{message}; {verdict.message}")
    sb.events.append(("Normal", Reason.RESTARTED_IN_PLACE, message))
    moved = [replace(p, attempt=nxt) for p in keep.kept]
    # A pod on a lost node goes in the same pass (a crashed pod is kept for its logs): the kept
    # pods are moved only after it, so two attempts never look Running together.
    decision.delete += [p.name for p in obs.pods if p.attempt == attempt and p.where in failure.lost_nodes
                        and not p.terminating and p.phase != "Failed"]  # fmt: skip
    _relabel(obs, sb, decision, nxt, [p.name for p in keep.kept], moved)
    if keep.replaced:
        _replace_in_place(obs, sb, decision, nxt, moved, dict(keep.replaced))


def _relabel(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int, names: list[str],
    current: list[policy.PodView] | None = None,
) -> None:
    """Patch the kept pods onto `attempt` (again on every pass until the watch shows it)."""
    if not names:
        return
    pods = current if current is not None else [p for p in obs.pods if p.attempt == attempt]
    rec = sb.status.recovery
    decision.relabel = Relabel(
        pods=tuple(names), attempt=attempt, resume_step=rec.resume_step if rec else None,
        master_addr=inplace.master_address(obs.name, obs.namespace, attempt, pods),
    )


def _missing_replaced(sb: StatusBuilder, current: list[policy.PodView]) -> list[int]:
    rec = sb.status.recovery
    present = {p.index for p in current}
    return [i for i in (rec.replaced_indices or []) if i not in present] if rec else []


def _newer_commit(obs: Observed, told: int | None) -> int | None:
    """The newest committed step, when it is newer than the step a gang was told."""
    ckpt = obs.checkpoint
    if ckpt is None or not ckpt.reachable or ckpt.step is None:
        return None
    return ckpt.step if told is None or ckpt.step > told else None


def _retarget(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], missing: tuple[int, ...], step: int,
) -> tuple[int, list[policy.PodView]]:
    """A step newer than the one the in-place attempt was told was committed before its
    replacement pods could be created (the dying gang's rank 0 finished an upload after the
    restart was decided; the backoff or a refused create delayed the replacement): move the
    attempt's pods to the next attempt, told that step, rather than lose the steps between.
    Not a restart of its own: the budgets are untouched."""
    rec = sb.status.recovery
    assert rec is not None
    nxt, told = attempt + 1, rec.resume_step
    rec.resume_step, rec.replaced_indices = step, sorted(missing)
    sb.status.attempt, sb.status.attempt_start_time = nxt, iso(obs.now)
    message = (f"attempt {nxt} from step {step} in place: step {step} was committed after attempt "
               f"{attempt} was told step {told}, before its replacement pods were created")
    sb.set(C.RECOVERING, True, Reason.RESTARTED_IN_PLACE, message)
    sb.events.append(("Normal", Reason.RESTARTED_IN_PLACE, message))
    kept = [p for p in current if not p.terminating and p.phase not in ("Failed", "Succeeded")]
    moved = [replace(p, attempt=nxt) for p in kept]
    _relabel(obs, sb, decision, nxt, [p.name for p in kept], moved)
    return nxt, moved


def _replace_in_place(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], nodes: Mapping[int, str] | None = None, settled: bool = False,
) -> None:
    """Create the replacement pods of an in-place restart, after the backoff.

    `settled`: every kept pod shows the attempt's label (the move was seen), so the attempt may
    be moved on again when a newer step was committed meanwhile (_retarget)."""
    missing = tuple(_missing_replaced(sb, current))
    if not missing:
        return
    waiting = _backoff_left(obs, sb)
    if waiting > 0:
        sb.set(C.RECOVERING, True, Reason.BACKOFF,
               f"in-place restart {sb.status.restarts}: the replacement pod waits {waiting:.0f}s")
        decision.requeue_after = waiting
        return
    if _refused_too_long(obs, sb, decision):
        return
    table = obs.rank_table
    assignments = {p.index: p.where for p in current if p.where}
    # Where the failed pod ran (the crashed pod is kept for its logs; else the rank table).
    before = {p.index: p.where for p in obs.pods if p.attempt == attempt - 1 and p.where}
    for index in missing:
        node = ((nodes or {}).get(index) or before.get(index)
                or (table.assignments.get(index) if table else None))
        if node is None:
            return  # no record of where it ran: the pods-not-starting clock ends it as a recreate
        assignments[index] = node
    rec = sb.status.recovery
    newer = _newer_commit(obs, rec.resume_step if rec else None)
    if settled and rec is not None and newer is not None:
        attempt, current = _retarget(obs, sb, decision, attempt, current, missing, newer)
    data = sb.status.parallelism.data if sb.status.parallelism else obs.spec.parallelism.data
    decision.launch = Launch(
        attempt=attempt, data=data, pool=sb.status.pool, assignments=assignments,
        resume_step=rec.resume_step if rec else None, mode=inplace.IN_PLACE, only=missing,
        release=not _blocking(obs, attempt, {assignments[i] for i in missing}), in_place=True,
        master_addr=inplace.master_address(obs.name, obs.namespace, attempt, current),
    )
