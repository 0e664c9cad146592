"""An in-place restart as a pass carries it out (the rules are inplace.py's): keep the healthy
pods, move them onto the next attempt, and create only the replacements of the failed ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason
from topotrain.core import elastic, inplace, node_failures, policy, restarts
from topotrain.core.decision import Decision, Launch, Observed, Relabel
from topotrain.core.planning import PlanOutcome
from topotrain.core.reconcile_launch import (
    backoff_left,
    blocking,
    launch,
    lost_nodes,
    newer_commit,
    refused_too_long,
)
from topotrain.core.reconcile_status import StatusBuilder
from topotrain.core.resume import explain


def _stale(obs: Observed, current: list[policy.PodView]) -> bool:
    """A pod of `current` runs a pod template other than the spec's (pods without the
    annotation, made by an older operator, are taken as current)."""
    return any(p.template and obs.template and p.template != obs.template for p in current)


def in_place_plan(
    obs: Observed, sb: StatusBuilder, attempt: int, current: list[policy.PodView],
    failure: policy.Failure,
) -> tuple[inplace.InPlacePlan | None, PlanOutcome | None]:
    """The in-place restart for `failure`, if any, and the re-plan that moves a lost node's pod
    (None when no pod changes node)."""
    ckpt = obs.checkpoint
    if (not obs.spec.failure_policy.restart_in_place or obs.strategy != "incremental"
            or (ckpt is not None and not ckpt.reachable) or obs.config_problem is not None):
        return None, None
    if _stale(obs, current):
        return None, None  # the spec changed: kept pods would run the old one beside the new
    data = sb.status.parallelism.data if sb.status.parallelism else obs.spec.parallelism.data
    expected = elastic.pods_for(obs.spec.parallelism, data, obs.spec.worker.gpus_per_pod)
    table = obs.ranks()
    placed = dict(table.assignments) if table is not None and table.attempt == attempt else None
    previous = {**(placed or {}), **{p.index: p.where for p in current if p.where}}
    outcome = _relocated(obs, sb, previous, data) if failure.lost_nodes else None
    relocated = None if outcome is None else {
        i: n for i, n in outcome.assignments.items() if previous.get(i) != n}
    keep = inplace.plan(failure, current, expected, obs.nodes,
                        node_failures.avoided_nodes(sb.status.node_failures), sb.status, attempt, placed,
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
    outcome = obs.planner.replan(previous, lost_nodes(obs, sb, previous), low, data)
    if not outcome.feasible or outcome.mode != "incremental" or outcome.data != data:
        return None
    return outcome if set(outcome.assignments) == set(previous) else None


def restart_in_place(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    verdict: restarts.RestartDecision, failure: policy.Failure, keep: inplace.InPlacePlan,
) -> None:
    """Keep the healthy pods (moved to the next attempt), replace only the failed indices."""
    nxt = attempt + 1
    resume = obs.checkpoint.step if obs.checkpoint is not None else None
    sb.restarting_in_place(verdict, nxt, failure.kind, keep.replaced, len(keep.kept), resume,
                           explain(sb.status, obs.checkpoint, resume))
    moved = [replace(p, attempt=nxt) for p in keep.kept]
    # A pod on a lost node goes in the same pass (a crashed pod is kept for its logs): the kept
    # pods are moved only after it, so two attempts never look Running together.
    decision.delete += [p.name for p in obs.pods if p.attempt == attempt and p.where in failure.lost_nodes
                        and not p.terminating and p.phase != "Failed"]  # fmt: skip
    relabel(obs, sb, decision, nxt, [p.name for p in keep.kept], moved)
    if keep.replaced:
        replace_in_place(obs, sb, decision, nxt, moved, dict(keep.replaced))


def relabel(
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


def missing_replaced(sb: StatusBuilder, current: list[policy.PodView]) -> list[int]:
    rec = sb.status.recovery
    present = {p.index for p in current}
    return [i for i in (rec.replaced_indices or []) if i not in present] if rec else []


def _retarget(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], missing: tuple[int, ...], step: int,
) -> tuple[int, list[policy.PodView]]:
    """A step newer than the one the in-place attempt was told was committed before its
    replacement pods could be created (the dying gang's rank 0 finished an upload after the
    restart was decided; the backoff or a refused create delayed the replacement): move the
    attempt's pods to the next attempt, told that step, rather than lose the steps between.
    Not a restart of its own: the budgets are untouched."""
    nxt = attempt + 1
    sb.retargeting(attempt, nxt, step, missing)
    kept = [p for p in current if not p.terminating and p.phase not in ("Failed", "Succeeded")]
    moved = [replace(p, attempt=nxt) for p in kept]
    relabel(obs, sb, decision, nxt, [p.name for p in kept], moved)
    return nxt, moved


def _recreate_on_new_spec(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView],
) -> None:
    """The pod template changed after the in-place restart was decided and before its
    replacement pods were created (during the backoff, or while their create was refused): a
    replacement built from the new template beside kept pods of the old one would be one gang of
    two specs. The kept pods go and the whole gang starts on the new template at the next
    attempt, from the newest commit: the spec change's roll, with no failure budget charged
    beyond the restart already counted."""
    decision.relabel = None
    decision.delete += [p.name for p in current if not p.terminating]
    # The gang's placement: the rank table's, where the failed pods ran, where the kept ones run.
    table = obs.ranks()
    previous = {**(table.assignments if table is not None else {}),
                **{p.index: p.where for p in obs.pods if p.attempt == attempt - 1 and p.where},
                **{p.index: p.where for p in current if p.where}}  # fmt: skip
    resume = obs.checkpoint.step if obs.checkpoint is not None else None
    sb.rolling(obs.generation, attempt + 1, resume)
    launch(obs, sb, decision, attempt + 1, previous=previous)


def replace_in_place(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], nodes: Mapping[int, str] | None = None, settled: bool = False,
) -> None:
    """Create the replacement pods of an in-place restart, after the backoff.

    `settled`: every kept pod shows the attempt's label (the move was seen), so the attempt may
    be moved on again when a newer step was committed meanwhile (_retarget)."""
    missing = tuple(missing_replaced(sb, current))
    if not missing:
        return
    waiting = backoff_left(obs, sb)
    if waiting > 0:
        sb.set(C.RECOVERING, True, Reason.BACKOFF,
               f"in-place restart {sb.status.restarts}: the replacement pod waits {waiting:.0f}s")
        decision.requeue_after = waiting
        return
    if refused_too_long(obs, sb, decision):
        return
    if obs.config_problem is None and _stale(obs, current):
        _recreate_on_new_spec(obs, sb, decision, attempt, current)
        return
    table = obs.ranks()
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
    newer = newer_commit(obs, rec.resume_step if rec else None)
    if settled and rec is not None and newer is not None:
        attempt, current = _retarget(obs, sb, decision, attempt, current, missing, newer)
    data = sb.status.parallelism.data if sb.status.parallelism else obs.spec.parallelism.data
    decision.launch = Launch(
        attempt=attempt, data=data, pool=sb.status.pool, assignments=assignments,
        resume_step=rec.resume_step if rec else None, mode=inplace.IN_PLACE, only=missing,
        release=not blocking(obs, attempt, {assignments[i] for i in missing}), in_place=True,
        master_addr=inplace.master_address(obs.name, obs.namespace, attempt, current),
    )
