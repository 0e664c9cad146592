"""Failure policy: what counts as a failure of the gang, and what to do about it.

Pure functions of typed views of pods and nodes (built by the Kubernetes edge).

Failures, in the order they are reported when several happen at once:

| failure | reason | retryable |
|---|---|---|
| a container exited with a code in `nonRetryableExitCodes` (default 78, EX_CONFIG) | NonRetryableExitCode | no |
| a pod Failed (any other exit code, OOMKilled, ...) | PodFailed | yes |
| a pod's supervisor reported its own trainer rank's failure in `failure.json` (warm spares; the pod stays Running, waiting to be restarted in place) | PodFailed (or NonRetryableExitCode for such a code) | yes |
| a pod was evicted (status.reason Evicted), or refused by its node's kubelet at admission (OutOf<resource>, NodeAffinity, ...: it never ran) | PodEvicted | yes |
| a pod exited EXIT_STOPPED (75: SIGTERM, after committing a checkpoint of its current step) | PodDeleted | yes |
| a pod was deleted, or is being deleted, by someone else | PodDeleted | yes |
| a pod's node was deleted | NodeLost | yes |
| a pod's node is NotReady | NodeNotReady | yes |
| a pod was preempted (condition DisruptionTarget, reason PreemptionByScheduler) | PodPreempted | yes |
| pods not Running `schedulingTimeoutSeconds` after the attempt started (image pull errors, CreateContainerConfigError, Unschedulable) | PodsNotStarting | yes |
| the step in `progress.json` unchanged for `progressTimeoutSeconds` while Running, by the operator's clock (`startupTimeoutSeconds` before the attempt's first heartbeat); never while the checkpoint store is unreachable | ProgressStalled | yes |

Failure classes, each with its own budget: *application* failures (PodFailed,
ProgressStalled) count against `maxRestarts`; *infrastructure* failures (the
rest) count against `maxInfrastructureRestarts`, so a flaky cluster does not
use up the application's budget. A retryable failure restarts the whole gang
after `min(backoffSeconds * 2**(n-1), maxBackoffSeconds)`, n being the
restarts of its class so far; once a class's budget is spent, the next failure
of that class fails the job with a reason naming the budget.

Node accounting: a failure is attributed to the node(s) it happened on when it
is localized (one node's pods failed, the node was lost, pods stuck there);
after `nodeFailureThreshold` failures that node is avoided by the job's
re-plans and listed in `status.nodeFailures` (node_failures.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING

from topotrain.api.spec import FailurePolicy
from topotrain.api.status import Reason
from topotrain.contract import EXIT_STOPPED

if TYPE_CHECKING:
    from topotrain.checkpoints import WorkerFailure

APPLICATION, INFRASTRUCTURE = "application", "infrastructure"
INFRASTRUCTURE_REASONS = frozenset({
    Reason.POD_EVICTED, Reason.POD_DELETED, Reason.NODE_LOST, Reason.NODE_NOT_READY,
    Reason.PODS_NOT_STARTING, Reason.POD_PREEMPTED,
})
# Waiting reasons that mean "this pod will not start by itself".
STUCK_REASONS = frozenset({
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
    "CreateContainerError", "RunContainerError", "Unschedulable", "SchedulingGated",
})


def failure_class(reason: str) -> str:
    return INFRASTRUCTURE if reason in INFRASTRUCTURE_REASONS else APPLICATION


@dataclass(frozen=True)
class PodView:
    """What the operator needs to know about one pod of a job."""

    name: str
    index: int
    attempt: int
    phase: str = "Pending"  # Pending, Running, Succeeded, Failed, Unknown
    planned_node: str = ""  # where the plan put it (annotation topotrain.io/node)
    node: str = ""  # spec.nodeName once bound
    gated: bool = False  # still behind the topotrain.io/gang scheduling gate
    terminating: bool = False  # metadata.deletionTimestamp is set
    deletion_deadline: str = ""  # metadata.deletionTimestamp: when its grace period ends
    # spec.terminationGracePeriodSeconds: how long a stopping trainer may take to save its
    # SIGTERM checkpoint once the pod is being deleted
    grace_seconds: float = 30.0
    exit_code: int | None = None  # first non-zero container exit code, if any
    reason: str = ""  # status.reason (Evicted, ...) or the container's terminated reason
    message: str = ""  # status.message, else the container's termination message (log tail)
    gpus: int = 0
    waiting: str = ""  # why it is not running yet: a container waiting reason or Unschedulable
    waiting_message: str = ""
    preempted: bool = False  # condition DisruptionTarget with a preemption reason
    resume_step: str | None = None  # annotation topotrain.io/resume-step (None: absent)
    template: str = ""  # annotation topotrain.io/template: the pod template hash it runs
    checkpoint_request: str = ""  # annotation topotrain.io/checkpoint-request (planned.py)
    owned: bool = True  # its controller owner is this job (False: another object's pod)
    exits: tuple[tuple[str, int], ...] = ()  # (container, exit code) of each that exited non-zero
    conditions: frozenset[tuple[str, str]] = frozenset()  # (type, status) of its notable conditions

    @property
    def where(self) -> str:
        return self.node or self.planned_node


@dataclass(frozen=True)
class NodeView:
    """A node as far as failure detection cares."""

    name: str
    ready: bool = True
    cordoned: bool = False  # spec.unschedulable: a drain is likely to evict its pods next


@dataclass(frozen=True)
class Failure:
    """One failure of the current attempt, as the operator acts on it."""

    reason: str
    message: str
    retryable: bool = True
    pod: str | None = None
    node: str | None = None
    exit_code: int | None = None
    lost_nodes: frozenset[str] = field(default_factory=frozenset)
    blamed: frozenset[str] = field(default_factory=frozenset)  # nodes the failure is attributed to
    node_fault: bool = False  # it got a node avoided: the node's, whatever its reason (charged_to_node)
    # What the failure rules match (failure_rules.py): the failed pod's container exits, its
    # conditions, its termination reason and message, and the other failures seen with it.
    exits: tuple[tuple[str, int], ...] = ()
    conditions: frozenset[tuple[str, str]] = frozenset()
    termination_reason: str = ""
    detail: str = ""
    others: tuple[Failure, ...] = ()

    @property
    def kind(self) -> str:
        return INFRASTRUCTURE if self.node_fault else failure_class(self.reason)


def _pod_failure(pod: PodView, non_retryable: Iterable[int]) -> Failure | None:
    where = pod.where or None
    if pod.preempted and (pod.phase == "Failed" or pod.terminating):
        return Failure(
            Reason.POD_PREEMPTED, f"pod {pod.name} was preempted: {pod.message or 'by the scheduler'}",
            pod=pod.name, node=where,
        )
    if pod.phase == "Failed":
        if pod.exit_code is not None and pod.exit_code in set(non_retryable):
            return Failure(
                Reason.NON_RETRYABLE,
                f"pod {pod.name} exited with code {pod.exit_code}, which is non-retryable "
                f"(spec.failurePolicy.nonRetryableExitCodes): fix the job's configuration{_tail(pod)}",
                retryable=False, pod=pod.name, node=where, exit_code=pod.exit_code,
            )
        if rejected(pod):
            # Its node's kubelet refused it at admission (a pod the operator bound itself, whose
            # node lost the GPUs to another pod in the meantime, say): it never ran.
            return Failure(
                Reason.POD_EVICTED, f"pod {pod.name} was refused by node {where}'s kubelet "
                f"({pod.reason or 'no reason'}): {pod.message or 'no message'}",
                pod=pod.name, node=where, blamed=frozenset({where} if where else ()),
            )
        if pod.reason == "Evicted":
            return Failure(
                Reason.POD_EVICTED, f"pod {pod.name} was evicted: {pod.message or 'no message'}",
                pod=pod.name, node=where, blamed=frozenset({where} if where else ()),
            )
        if pod.terminating and pod.exit_code not in set(non_retryable):
            # Its deletion stopped it (an eviction, a drain, `kubectl delete`): the SIGKILL at the
            # end of the grace period (137) or any exit while stopping is not the application's.
            return Failure(
                Reason.POD_DELETED, f"pod {pod.name} was stopped by its deletion (exit code "
                f"{pod.exit_code})", pod=pod.name, node=where, exit_code=pod.exit_code,
            )
        if pod.exit_code == EXIT_STOPPED:  # a planned stop: infrastructure, never the application's
            return Failure(
                Reason.POD_DELETED, f"pod {pod.name} was stopped by SIGTERM after committing a "
                f"checkpoint of its current step (exit code {EXIT_STOPPED})",
                pod=pod.name, node=where, exit_code=pod.exit_code,
            )
        code = "" if pod.exit_code is None else f" with exit code {pod.exit_code}"
        why = f" ({pod.reason})" if pod.reason else ""
        return Failure(
            Reason.POD_FAILED, f"pod {pod.name} failed{code}{why}{_tail(pod)}",
            pod=pod.name, node=where, exit_code=pod.exit_code,
            blamed=frozenset({where} if where else ()),
        )
    if pod.terminating and pod.phase != "Succeeded":
        return Failure(
            Reason.POD_DELETED, f"pod {pod.name} is being deleted", pod=pod.name, node=where,
        )
    return None


# The reasons a kubelet gives a pod it refuses at admission, besides OutOf<resource>.
ADMISSION_REASONS = frozenset({"NodeAffinity", "NodeName", "UnexpectedAdmissionError", "Taint"})


def rejected(pod: PodView) -> bool:
    """A Failed pod its node's kubelet refused to run (no container of it ever started)."""
    return (pod.phase == "Failed" and pod.exit_code is None and not pod.exits
            and (pod.reason.startswith("OutOf") or pod.reason in ADMISSION_REASONS
                 or pod.message.startswith("Pod was rejected")))


def _tail(pod: PodView, limit: int = 400) -> str:
    """The last lines of the container's termination message (its log tail), if any."""
    text = pod.message.strip()
    if not text:
        return ""
    return ": " + (text if len(text) <= limit else "..." + text[-limit:])


def _node_failure(pod: PodView, nodes: Mapping[str, NodeView]) -> Failure | None:
    where = pod.where
    if not where or pod.phase in ("Succeeded", "Failed"):
        return None
    node = nodes.get(where)
    if node is None:
        return Failure(
            Reason.NODE_LOST, f"node {where} of pod {pod.name} was deleted",
            pod=pod.name, node=where, lost_nodes=frozenset({where}), blamed=frozenset({where}),
        )
    if not node.ready:
        return Failure(
            Reason.NODE_NOT_READY, f"node {where} of pod {pod.name} is NotReady",
            pod=pod.name, node=where, lost_nodes=frozenset({where}), blamed=frozenset({where}),
        )
    return None


_ORDER = [
    Reason.NON_RETRYABLE, Reason.POD_FAILED, Reason.POD_EVICTED, Reason.POD_PREEMPTED,
    Reason.POD_DELETED, Reason.NODE_LOST, Reason.NODE_NOT_READY, Reason.PODS_NOT_STARTING,
]


def detect_failure(
    pods: Iterable[PodView], expected: int, nodes: Mapping[str, NodeView],
    policy: FailurePolicy, *, started: bool,
) -> Failure | None:
    """The most serious failure among the current attempt's pods, or None.

    `expected` is the gang's pod count; a missing index counts as a deleted pod
    once the gang was `started` (every pod created and released).
    """
    pods = list(pods)
    found: list[Failure] = []
    for pod in pods:
        failure = _pod_failure(pod, policy.non_retryable_exit_codes) or _node_failure(pod, nodes)
        if failure is not None:
            found.append(replace(failure, exits=pod.exits, conditions=pod.conditions,
                                 termination_reason=pod.reason, detail=pod.message))
    if started:
        present = {p.index for p in pods}
        missing = [i for i in range(expected) if i not in present]
        if missing:
            found.append(Failure(
                Reason.POD_DELETED,
                f"{len(missing)} pod(s) of the gang disappeared (index {missing[0]}"
                f"{', ...' if len(missing) > 1 else ''})",
            ))
    if not found:
        return None
    found.sort(key=lambda f: _ORDER.index(f.reason))
    first = found[0]
    lost = frozenset().union(*(f.lost_nodes for f in found))
    # A crash on one node is that node's fault only if it is the only node whose pods crashed:
    # a bug in the trainer fails ranks everywhere, and no node should be blamed for it.
    crashed = {f.node for f in found if f.reason == Reason.POD_FAILED}
    blamed = frozenset().union(*(f.blamed for f in found if f.reason != Reason.POD_FAILED))
    if len(crashed) == 1:
        blamed |= frozenset(n for n in crashed if n)
    message = first.message if len(found) == 1 else f"{first.message} (+{len(found) - 1} more)"
    return replace(first, message=message, lost_nodes=lost, blamed=blamed, others=tuple(found[1:]))


def stuck_failure(
    pods: Iterable[PodView], attempt_started: datetime | None, policy: FailurePolicy,
    now: datetime,
) -> Failure | None:
    """Pods of the attempt that are still not Running schedulingTimeoutSeconds after it started.

    The pods' nodes are blamed when the pods say why they cannot start there (image pull,
    container config, Unschedulable), so the restart places the gang elsewhere.
    """
    limit = policy.scheduling_timeout_seconds
    if limit <= 0 or attempt_started is None or (now - attempt_started).total_seconds() <= limit:
        return None
    stuck = [p for p in pods if p.phase not in ("Running", "Succeeded") and not p.terminating]
    if not stuck:
        return None
    blamed = frozenset(p.where for p in stuck if p.where and p.waiting in STUCK_REASONS)
    first = stuck[0]
    return Failure(
        Reason.PODS_NOT_STARTING,
        f"{len(stuck)} pod(s) not Running {limit}s after the attempt started "
        f"(spec.failurePolicy.schedulingTimeoutSeconds); {pending_detail(first)}",
        pod=first.name, node=first.where or None, blamed=blamed,
    )


def pending_detail(pod: PodView) -> str:
    """Why one pod is not Running, in words."""
    where = f" on {pod.where}" if pod.where else ""
    if pod.gated:
        return f"{pod.name}{where} is gated: the gang waits for all its pods and for the nodes to be free"
    if pod.waiting:
        text = f": {pod.waiting_message}" if pod.waiting_message else ""
        return f"{pod.name}{where}: {pod.waiting}{text}"[:500]
    return f"{pod.name}{where} is {pod.phase}"


def reported_failure(
    report: WorkerFailure | None, attempt: int, pods: Iterable[PodView], policy: FailurePolicy,
) -> Failure | None:
    """A failure a pod's supervisor reported for `attempt` (checkpoints.WorkerFailure): the
    pod of its node rank is still Running, its supervisor waiting for the next attempt."""
    if report is None or report.attempt != attempt:
        return None
    pod = next((p for p in pods if p.index == report.node_rank and p.attempt == attempt), None)
    name = pod.name if pod is not None else (report.pod or f"of index {report.node_rank}")
    where = pod.where if pod is not None else ""
    said = f"pod {name}'s trainer exited with code {report.exit_code} (reported by its supervisor"
    if report.exit_code in set(policy.non_retryable_exit_codes):
        return Failure(
            Reason.NON_RETRYABLE, f"{said}), which is non-retryable "
            "(spec.failurePolicy.nonRetryableExitCodes): fix the job's configuration",
            retryable=False, pod=name, node=where or None, exit_code=report.exit_code,
        )
    return Failure(
        Reason.POD_FAILED, f"{said}, which keeps the pod for an in-place restart)",
        pod=name, node=where or None, exit_code=report.exit_code,
        blamed=frozenset({where} if where else ()),
    )


def stalled_failure(
    heartbeat: datetime | None, running_since: datetime | None, policy: FailurePolicy,
    now: datetime,
) -> Failure | None:
    """A hang: no progress for progressTimeoutSeconds while every pod is Running.

    `heartbeat` is when the operator last saw the current attempt's step change
    (its own clock, never the trainer's), None before its trainer first
    reported a step. `running_since` is the later of the moment the gang became
    Running and the moment the checkpoint store last became reachable again,
    since heartbeats cannot be seen while it is not. Until the first heartbeat
    the limit is startupTimeoutSeconds: imports, rendezvous and a checkpoint
    load can take far longer than a training step.
    """
    timeout = policy.progress_timeout_seconds
    if timeout <= 0 or running_since is None:
        return None
    if heartbeat is None:
        limit, last = policy.startup_timeout_seconds or timeout, running_since
    else:
        limit, last = timeout, max(heartbeat, running_since)
    idle = (now - last).total_seconds()
    if idle <= limit:
        return None
    if heartbeat is None:
        return Failure(
            Reason.PROGRESS_STALLED,
            f"no progress.json from this attempt {int(idle)}s after the gang became Running "
            f"(startupTimeoutSeconds {limit}): the trainer hangs while starting",
        )
    return Failure(
        Reason.PROGRESS_STALLED,
        f"the training step has not changed for more than {limit}s (last change seen {int(idle)}s "
        "ago): the trainer hangs",
    )
