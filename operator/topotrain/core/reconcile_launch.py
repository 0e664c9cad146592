"""Launching a gang, the step every branch of reconcile ends in when it (re)starts one.

`launch` is the one way a pass starts an attempt: it waits out the restart backoff and a
refused create, never starts while the checkpoint store is unreadable (the resume step
would be unknown), plans (incrementally after a failure; with the avoided nodes back in
only when nothing else fits) and gives the `Launch`. The helpers after it (`backoff_left`,
`refused_too_long`, `lost_nodes`, `blocking`, `node_ready`, `newer_commit`) serve the
other branches too.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason
from topotrain.core import elastic, node_failures, restarts
from topotrain.core.decision import Decision, Launch, Observed
from topotrain.core.planning import Planner, PlanOutcome
from topotrain.core.reconcile_status import REFUSAL_REASONS, StatusBuilder
from topotrain.core.resume import explain
from topotrain.core.status_edits import iso

CHECKPOINT_UNAVAILABLE = Reason.STORE_UNAVAILABLE
WAIT_SHORT = 2.0  # seconds: something in flight that no watch event announces
CREATE_RETRY = 10.0  # seconds between tries to create a gang the API server refused
REFUSALS = REFUSAL_REASONS


def launch(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    previous: Mapping[int, str] | None = None, outcome: PlanOutcome | None = None,
    resume: int | None = None, planned: str | None = None,
) -> None:
    """No pod of the current attempt exists: place the gang and create it, resuming from
    `resume` (the step of the planned change `planned`) or else the newest resumable commit
    (resume.py)."""
    if obs.config_problem is not None:
        return
    waiting = backoff_left(obs, sb)
    if waiting > 0:
        failure = sb.status.last_failure
        since = sb.parse(failure.time) if failure else obs.now
        delay = restarts.backoff_seconds(obs.spec.failure_policy, sb.status.restarts)
        sb.set(C.RECOVERING, True, Reason.BACKOFF,
               f"restart {sb.status.restarts} waits until {iso(since + timedelta(seconds=delay))}")
        decision.requeue_after = waiting
        return
    if refused_too_long(obs, sb, decision):
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
    if not outcome.feasible and outcome.reason == Reason.HANDED_BACK:
        hand_back(sb, decision, outcome.message)
        return
    if not outcome.feasible:
        sb.unschedulable(outcome.reason, outcome.message)
        decision.requeue_after = None  # node and pod events wake us when capacity changes
        return
    if resume is None:
        resume = None if ckpt is None else ckpt.step
    previous_data = sb.status.parallelism.data if sb.status.parallelism else outcome.data
    sb.placed(outcome, obs.spec.parallelism, previous_data, resume,
              explain(sb.status, ckpt, resume, planned))
    # Gated pods are never tried by the scheduler, so holding the gate until the older attempt's
    # pods are gone avoids the scheduler's backoff on nodes they still occupy.
    decision.launch = Launch(
        attempt=attempt, data=outcome.data, pool=outcome.pool,
        assignments=dict(outcome.assignments), resume_step=resume, mode=outcome.mode,
        release=not blocking(obs, attempt, set(outcome.assignments.values())),
    )
    decision.placement_cost = outcome.cost


def hand_back(sb: StatusBuilder, decision: Decision, message: str) -> None:
    """Under Kueue, a node of the job's topology assignment is lost and the gang fits nowhere
    else in it: rather than take nodes Kueue may have promised to other workloads, give the job
    back to Kueue for a new assignment (the Workload is evicted with `message`; the gang stops
    and the quota goes back as after any eviction, reconcile_suspend.py). Admitted turns False
    saying so; nothing is created."""
    sb.admission(False, Reason.HANDED_BACK, message)
    decision.hand_back = message
    decision.requeue_after = WAIT_SHORT  # the eviction's Workload event wakes us sooner


def refused_too_long(obs: Observed, sb: StatusBuilder, decision: Decision) -> bool:
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
    avoided = node_failures.avoided_nodes(sb.status.node_failures)
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
    table = obs.ranks()
    if previous is None and table is not None and table.attempt < sb.status.attempt:
        previous = table.assignments
    recovering = sb.status.recovery is not None and sb.status.recovery.started is not None
    if obs.strategy == "incremental" and previous and recovering:
        current = sb.status.parallelism.data if sb.status.parallelism else high
        if low <= current <= high:
            return planner.replan(previous, lost_nodes(obs, sb, previous, avoiding), low, current)
    return planner.plan(low, high)


def lost_nodes(obs: Observed, sb: StatusBuilder, nodes: Mapping[int, str],
                avoiding: bool = True) -> frozenset[str]:  # fmt: skip
    """Nodes of the previous placement that a recovery must move off: gone, NotReady or avoided."""
    avoided = node_failures.avoided_nodes(sb.status.node_failures) if avoiding else frozenset()
    return frozenset(
        n for n in nodes.values() if not node_ready(obs, n) or n in avoided
    )


def backoff_left(obs: Observed, sb: StatusBuilder) -> float:
    """Seconds left of the restart backoff after the last failure."""
    st = sb.status
    rec, failure = st.recovery, st.last_failure
    if rec is None or rec.started is None or failure is None or failure.time != rec.started:
        return 0.0  # no failure-triggered recovery in flight (a resize has no backoff)
    delay = restarts.backoff_seconds(obs.spec.failure_policy, st.restarts)
    return max(0.0, delay - (obs.now - sb.parse(failure.time)).total_seconds())


def blocking(obs: Observed, attempt: int, nodes: set[str]) -> bool:
    """Older pods still on healthy nodes the new gang needs (pods on lost nodes never block)."""
    return any(
        p.attempt < attempt and p.phase not in ("Failed", "Succeeded") and p.where in nodes
        and node_ready(obs, p.where)
        for p in obs.pods
    )


def node_ready(obs: Observed, node: str) -> bool:
    """The node is in the cluster and Ready (its kubelet acts on its pods)."""
    return node in obs.nodes and obs.nodes[node].ready


def newer_commit(obs: Observed, told: int | None) -> int | None:
    """The newest committed step, when it is newer than the step a gang was told."""
    ckpt = obs.checkpoint
    if ckpt is None or not ckpt.reachable or ckpt.step is None:
        return None
    return ckpt.step if told is None or ckpt.step > told else None
