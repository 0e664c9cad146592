"""A failed gang: wait for its stopping pods' save, then fail the job, restart it in place, or
recreate it (the failure policy's verdict, policy.py).
"""

from __future__ import annotations

from datetime import datetime

from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason
from topotrain.core import failure_rules, node_failures, policy, restarts
from topotrain.core.decision import Decision, Observed
from topotrain.core.reconcile_inplace import in_place_plan, restart_in_place
from topotrain.core.reconcile_launch import WAIT_SHORT, launch, node_ready
from topotrain.core.reconcile_status import StatusBuilder
from topotrain.core.status_edits import iso

SAVING = "waiting for the stopping pods' SIGTERM checkpoint"  # Ready's message while it waits


def on_failure(
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
    failure = node_failures.charged_to_node(failure, sb.status.node_failures, obs.spec.failure_policy)
    used = restarts.used_budgets(sb.status.restarts, sb.status.restarts_by_class)
    failure, verdict = failure_rules.decide_with_rules(failure, used, obs.spec.failure_policy)
    sb.record_failure(failure, obs.spec.failure_policy)
    keep, moved = (in_place_plan(obs, sb, attempt, current, failure) if verdict.action == "restart"
                   else (None, None))  # fmt: skip
    if keep is not None:
        decision.restart_reason = failure.reason
        if moved is not None:  # a lost node's pod moves: the placement changes
            sb.placement(moved)
            decision.placement_cost = moved.cost
        restart_in_place(obs, sb, decision, attempt, verdict, failure, keep)
        return
    decision.relabel = None  # a kept pod failed again: the gang is recreated
    # The crashed pods stay (they hold no GPUs) until the next attempt runs: their logs survive.
    decision.delete += [p.name for p in current if not p.terminating and p.phase != "Failed"]
    # A sharded checkpoint needs every rank: with ranks on a lost node (frozen or gone) the
    # healthy ranks' SIGTERM save hangs on them until the grace period ends (measured on kind: 29 s
    # with a paused node), and the next attempt waits for those pods' GPUs.
    decision.delete_now = any(p.where in failure.lost_nodes for p in current)
    if verdict.action == "fail":
        sb.failed(verdict.reason, verdict.message)
        return
    decision.restart_reason = failure.reason
    sb.restarting(verdict, attempt + 1, failure.kind)
    previous = {p.index: p.where for p in current if p.where}
    table = obs.ranks()
    if table is not None and table.attempt == attempt:
        # Pods that vanished (deleted, evicted) are no longer in `current`: the attempt's
        # placement says where they ran, so the re-plan sees the whole gang.
        previous = {**table.assignments, **previous}
    if verdict.delay_seconds > 0 or obs.strategy != "incremental":
        decision.requeue_after = verdict.delay_seconds or WAIT_SHORT
        return
    launch(obs, sb, decision, attempt + 1, previous=previous)


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
                and node_ready(obs, p.where)]
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
