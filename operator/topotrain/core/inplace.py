"""In-place restart: which failures keep the gang's healthy pods, and what those pods become.

Pure functions of the reconcile snapshot. A restart in place keeps every
healthy pod of the gang, moves it to the next attempt by patching its
`topotrain.io/attempt` label and annotations (its supervisor reads them
through the control volume and restarts its trainer processes), and creates
new pods only for the failed indices, on the same nodes.

It applies when the failure is a trainer process (a pod Failed with a
retryable exit code, a hang) or one pod deleted, the rest of the gang is
Running on nodes that are Ready, not cordoned and not avoided, and the failed
pod's node is too. It also applies when a node that held exactly one pod of the
gang is lost (deleted or NotReady): that pod is replaced on the node the
incremental re-plan chose for it (`relocated`, the planner's choice, as for a
recreate), and the rest of the gang is kept. Everything else recreates the gang
as before: `failurePolicy.restartInPlace: false`, the recreate strategy, a lost
node holding more than one pod of the gang (or a re-plan that would move a
healthy pod), an eviction or preemption, more than one pod to replace, a pod of
the gang not Running, a checkpoint store that cannot be read, a pod of the
gang built from another spec than the job's (an edit not rolled yet: kept, it
would run the old spec beside a replacement built from the new one;
reconcile_inplace.in_place_plan), and a second failure before an in-place
attempt trained its first step (its supervisors may not be able to restart: a
recreate starts clean).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from topotrain.api.status import Reason, TrainingJobStatus
from topotrain.core.manifests import pod_address, pod_name
from topotrain.core.policy import Failure, NodeView, PodView

IN_PLACE = "inPlace"
REASONS = frozenset({Reason.POD_FAILED, Reason.PROGRESS_STALLED, Reason.POD_DELETED,
                     Reason.NODE_LOST, Reason.NODE_NOT_READY})


@dataclass(frozen=True)
class InPlacePlan:
    """The pods a restart in place keeps and the indices it replaces (index -> node)."""

    kept: tuple[PodView, ...]
    replaced: Mapping[int, str]


def in_flight(status: TrainingJobStatus) -> bool:
    rec = status.recovery
    return rec is not None and rec.mode == IN_PLACE and rec.started is not None


def _untrained(status: TrainingJobStatus, attempt: int) -> bool:
    """The current attempt is an in-place restart that has not trained a step yet."""
    rec = status.recovery
    return rec is not None and rec.mode == IN_PLACE and (
        rec.started is not None or rec.awaiting_attempt == attempt
    )


def plan(
    failure: Failure, current: Iterable[PodView], expected: int, nodes: Mapping[str, NodeView],
    avoided: frozenset[str], status: TrainingJobStatus, attempt: int,
    table: Mapping[int, str] | None, relocated: Mapping[int, str] | None = None,
) -> InPlacePlan | None:
    """The in-place restart for `failure` of `attempt`, or None when the gang must be recreated.

    `table` is the attempt's placement (pod index -> node), for an index whose pod vanished.
    `relocated`: when nodes were lost, the indices the incremental re-plan moves and where to
    (None: no such plan, so a lost node recreates the gang).
    """
    if failure.reason not in REASONS or _untrained(status, attempt):
        return None
    lost = failure.lost_nodes
    if lost and relocated is None:
        return None
    moves = dict(relocated or {})
    pods = list(current)

    def healthy(node: str) -> bool:
        # A cordoned node takes no replacement pod (it would stay Pending on its pinned node) and
        # is likely being drained: the gang moves off it once, by a recreate, not pod by pod.
        return (bool(node) and node in nodes and nodes[node].ready and not nodes[node].cordoned
                and node not in avoided)

    bad = [p for p in pods if p.phase == "Failed" or p.terminating or (p.where and p.where in lost)]
    kept = [p for p in pods if p not in bad]
    replaced = {p.index: p.where for p in bad}
    indices = {p.index for p in pods}
    for index in range(expected):
        if index not in indices:
            replaced[index] = (table or {}).get(index, "")
    if not set(moves) <= set(replaced):
        return None  # the re-plan moves a healthy pod too: the gang is recreated
    replaced.update({i: moves.get(i, "") for i, node in replaced.items() if node in lost})
    if len(replaced) > 1 or len(kept) + len(replaced) != expected:
        return None
    if len({p.index for p in kept}) != len(kept) or set(replaced) & {p.index for p in kept}:
        return None
    if not all(p.phase == "Running" and not p.gated and healthy(p.node) for p in kept):
        return None
    if not all(healthy(node) for node in replaced.values()):
        return None  # a node gone, NotReady, cordoned or avoided: the recreate re-plans
    return InPlacePlan(tuple(kept), replaced)


def effective(pods: Iterable[PodView], status: TrainingJobStatus) -> tuple[tuple[PodView, ...], list[str]]:
    """The job's pods as this pass must see them, and the kept pods still to be moved.

    During an in-place recovery the kept pods of the previous attempt belong to the current
    one, even before the watch shows their new label (or before the patch was made, if the
    operator died after writing the status): they are never deleted or created again.
    """
    if not in_flight(status):
        return tuple(pods), []
    rec = status.recovery
    replaced = set(rec.replaced_indices or []) if rec is not None else set()
    out, stale = [], []
    for pod in pods:
        if (pod.attempt == status.attempt - 1 and pod.index not in replaced and pod.owned
                and not pod.terminating and pod.phase not in ("Failed", "Succeeded")):
            out.append(replace(pod, attempt=status.attempt))
            stale.append(pod.name)
        else:
            out.append(pod)
    return tuple(out), stale


def master_address(job: str, namespace: str, attempt: int, current: Iterable[PodView]) -> str:
    """Rank 0's address for the attempt: that of the pod holding index 0 (kept pods keep the
    name of the attempt that created them)."""
    zero = [p for p in current if p.index == 0 and p.attempt == attempt and p.phase != "Failed"
            and not p.terminating]
    name = zero[0].name if zero else pod_name(job, attempt, 0)
    return pod_address(job, namespace, name)
