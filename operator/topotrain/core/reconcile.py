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

from dataclasses import replace

from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason
from topotrain.core import deadline, elastic, inplace, planned, policy
from topotrain.core.decision import Decision, Launch, Observed
from topotrain.core.planning import PlanOutcome
from topotrain.core.progress_rate import total_steps
from topotrain.core.reconcile_faults import on_failure
from topotrain.core.reconcile_inplace import missing_replaced, relabel, replace_in_place
from topotrain.core.reconcile_launch import WAIT_SHORT, blocking, launch, newer_commit, node_ready
from topotrain.core.reconcile_status import StatusBuilder
from topotrain.core.reconcile_suspend import admission, hold_for_queue, suspend
from topotrain.core.status_edits import parse
from topotrain.core.transitions import FINISHED, observe_edge, settle

OVERDUE_SECONDS = 30.0  # past a Terminating pod's grace period: deleted again (_overdue)


def selector(name: str) -> str:
    return f"topotrain.io/job={name}"


def reconcile(obs: Observed) -> Decision:
    """One level-triggered pass, in steps:

    1. Observe: the checkpoint store, and what acting on the last decision found
       (transitions.observe_edge). A finished job only deletes what it need not keep.
    2. The current attempt: the newest the status or any pod names; older pods go, and pods
       kept by an in-place restart are moved onto it.
    3. The configuration: a problem (a Secret, a name taken) stops a job that runs nothing.
    4. One branch: spec.suspend, Kueue's hold, a Running gang that vanished, a launch, an
       in-place restart in flight, or the steady gang (failures, rollout, drain, resize).
    5. Afterwards: Kueue's quota back after an eviction, the recovery's first step, crashed
       pods of earlier attempts, observedGeneration.
    6. Settle the pass's status once (transitions.settle).
    """
    sb = StatusBuilder(obs.status, obs.generation, obs.now)
    sb.select(selector(obs.name))
    sb.observe_checkpoint(obs.checkpoint, total_steps(obs.spec.training))
    observe_edge(obs, sb)
    decision = Decision(status=sb.status)
    if sb.status.phase in FINISHED:
        return settle(_finished(obs, sb, decision), sb)
    obs, attempt, stale = _current_attempt(obs, sb, decision)
    current = [p for p in obs.pods if p.attempt == attempt]
    if not _configured(obs, sb, decision, current):
        return settle(decision, sb)
    if deadline.expired(obs, sb, decision, attempt, current):  # spec.activeDeadlineSeconds
        return settle(decision, sb)
    _branch(obs, sb, decision, attempt, current, stale)
    _afterwards(obs, sb, decision, attempt)
    deadline.come_back_by(obs, sb, decision)
    return settle(decision, sb)


def _finished(obs: Observed, sb: StatusBuilder, decision: Decision) -> Decision:
    # A Failed job keeps its crashed pods (they hold no GPUs) so their logs can be read.
    keep = ("Failed",) if sb.status.phase == "Failed" else ()
    decision.delete = [p.name for p in obs.pods if not p.terminating and p.phase not in keep]
    sb.generation_observed()
    deadline.after_finish(obs, sb, decision)  # spec.ttlSecondsAfterFinished
    return decision


def _current_attempt(obs: Observed, sb: StatusBuilder,
                     decision: Decision) -> tuple[Observed, int, list[str]]:
    """The attempt the pass works on, the pods as an in-place restart counts them, and the kept
    pods still to be moved onto the attempt (relabelled)."""
    attempt = max([sb.status.attempt, *(p.attempt for p in obs.pods)])
    sb.at_attempt(attempt)
    pods, stale = inplace.effective(obs.pods, sb.status)
    obs = replace(obs, pods=pods)
    decision.delete = [p.name for p in obs.pods if p.attempt < attempt and not p.terminating
                       and p.phase != "Failed"]
    decision.delete += _overdue(obs)
    relabel(obs, sb, decision, attempt, stale)
    return obs, attempt, stale


def _configured(obs: Observed, sb: StatusBuilder, decision: Decision,
                current: list[policy.PodView]) -> bool:
    """ConfigValid; False when a configuration problem stops a job that runs nothing yet."""
    if obs.config_problem is None:
        sb.config_ok()
        return True
    sb.config_invalid(*obs.config_problem)
    decision.events.extend(sb.events)
    if current:
        return True
    decision.requeue_after = None  # a Secret or node change wakes us
    return False


def _branch(obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
            current: list[policy.PodView], stale: list[str]) -> None:
    queue = obs.queue
    if queue is not None and not obs.spec.suspend:
        admission(obs, sb, queue)
    if not obs.spec.suspend and sb.status.phase == "Suspended" and not (queue and queue.holds):
        sb.resumed() if queue is None else sb.resumed(
            f"{queue.message}: the gang starts again from the newest committed step")
    if obs.spec.suspend:
        suspend(obs, sb, decision, attempt, current)
    elif queue is not None and queue.holds:
        hold_for_queue(obs, sb, decision, attempt, current, queue)
    elif not current and sb.status.phase == "Running":
        # The Running gang vanished whole before a pass saw a pod go (a one-pod gang's pod
        # deleted, a lost node's pods collected): a failure, never a relaunch of the same attempt.
        data = sb.status.parallelism.data if sb.status.parallelism else obs.spec.parallelism.data
        expected = elastic.pods_for(obs.spec.parallelism, data, obs.spec.worker.gpus_per_pod)
        gone = policy.detect_failure([], expected, obs.nodes, obs.spec.failure_policy, started=True)
        if gone is not None:
            on_failure(obs, sb, decision, attempt, [], gone)
    elif not current:
        launch(obs, sb, decision, attempt)
    elif inplace.in_flight(sb.status) and missing_replaced(sb, current):
        replace_in_place(obs, sb, decision, attempt, current, settled=not stale)
    else:
        _steady(obs, sb, decision, attempt, current)


def _afterwards(obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int) -> None:
    if obs.queue is not None and obs.queue.evicted:
        # (spec.suspend too: it deactivates the Workload, which Kueue evicts). A pod deleted on a
        # lost node holds no GPU Kueue could give anyone, and may stay Terminating until its node
        # object goes: it does not hold the quota back (Kueue's Job integration counts such pods
        # as terminating, not active, either).
        decision.release_quota = not any(
            p.phase not in ("Failed", "Succeeded") and not (p.terminating and not node_ready(obs, p.where))
            for p in obs.pods)
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
        sb.generation_observed()
    if decision.checkpoint_request is None:  # a called-off planned stop is cleared on its pods
        planned.settle(sb)
        decision.checkpoint_request = planned.release(sb, [p for p in obs.pods if p.attempt == attempt])


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
        on_failure(obs, sb, decision, attempt, current, failure)
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
        sb.template_current()
        return False
    if obs.config_problem is not None:
        return False  # a spec that cannot run yet: keep the running gang
    wait = planned.checkpoint_first(sb, obs.checkpoint, current, attempt, "rollout", obs.now,
                                    obs.checkpoint_request_timeout)
    if not wait.ready:
        decision.checkpoint_request, decision.requeue_after = wait.ask, wait.requeue_after
        return True
    decision.delete += [p.name for p in current if not p.terminating]
    step = _planned_step(obs, wait)
    sb.rolling(obs.generation, attempt + 1, step)
    _relaunch(obs, sb, decision, attempt + 1, "rollout", step)
    return True


def _planned_step(obs: Observed, wait: planned.Wait) -> int | None:
    """The step a planned change resumes from: its served checkpoint's, else the last commit's."""
    if wait.resume_step is None and obs.checkpoint is not None:
        return obs.checkpoint.step
    return wait.resume_step


def _relaunch(obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int, reason: str,
              step: int | None, outcome: PlanOutcome | None = None) -> None:
    """Start the changed gang (`attempt`) from `step`, recorded as the floor under which no
    later commit of the replaced gang is ever resumed from (resume.py)."""
    sb.restore_floor(reason, attempt, step)
    launch(obs, sb, decision, attempt, outcome=outcome, resume=step, planned=reason)


def _finish_creating(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    live: list[policy.PodView], expected: int,
) -> None:
    """Every pod is still gated: create the missing ones, or release them all together."""
    missing = tuple(i for i in range(expected) if i not in {p.index for p in live})
    if not missing:
        if blocking(obs, attempt, {p.where for p in live}):
            decision.requeue_after = WAIT_SHORT  # their deletion events wake us sooner
            return
        decision.release = [p.name for p in live]
        return
    table = obs.ranks()
    resumes = {p.resume_step for p in live}
    if (table is not None and table.attempt == attempt and all(i in table.assignments for i in missing)
            and len(resumes) == 1 and newer_commit(obs, _step(next(iter(resumes)))) is None):
        # The gang's other pods say which step it resumes from: every pod must agree.
        told = next(iter(resumes))
        decision.launch = Launch(
            attempt=attempt, data=table.data, pool=obs.status.pool,
            assignments=dict(table.assignments), resume_step=_step(told),
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
    return [p.name for p in obs.pods if p.terminating and p.deletion_deadline and node_ready(obs, p.node)
            and (obs.now - parse(p.deletion_deadline)).total_seconds() > OVERDUE_SECONDS]


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
    step = _planned_step(obs, wait)
    sb.moving(cordoned, outcome.data, attempt + 1, wait.resume_step)
    _relaunch(obs, sb, decision, attempt + 1, "drain", step, outcome)
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
    _relaunch(obs, sb, decision, attempt + 1, "resize", _planned_step(obs, wait), outcome)


