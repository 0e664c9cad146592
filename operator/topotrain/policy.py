"""Failure policy: what counts as a failure of the gang, and what to do about it.

Pure functions of typed views of pods and nodes (built by the Kubernetes edge).

Failures, in the order they are reported when several happen at once:

| failure | reason | retryable |
|---|---|---|
| a container exited with a code in `nonRetryableExitCodes` (default 78, EX_CONFIG) | NonRetryableExitCode | no |
| a pod Failed (any other exit code, OOMKilled, ...) | PodFailed | yes |
| a pod was evicted (status.reason Evicted) | PodEvicted | yes |
| a pod was deleted, or is being deleted, by someone else | PodDeleted | yes |
| a pod's node was deleted | NodeLost | yes |
| a pod's node is NotReady | NodeNotReady | yes |
| `progress.json` older than `progressTimeoutSeconds` while Running (`startupTimeoutSeconds` before the attempt's first heartbeat) | ProgressStalled | yes |

A retryable failure restarts the whole gang (every rank must rendezvous again)
after `min(backoffSeconds * 2**(restarts-1), maxBackoffSeconds)`; once
`maxRestarts` restarts were made the next failure fails the job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from topotrain.api import FailurePolicy
from topotrain.status import Reason


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
    exit_code: int | None = None  # first non-zero container exit code, if any
    reason: str = ""  # status.reason (Evicted, ...) or the container's terminated reason
    message: str = ""
    gpus: int = 0

    @property
    def where(self) -> str:
        return self.node or self.planned_node


@dataclass(frozen=True)
class NodeView:
    """A node as far as failure detection cares."""

    name: str
    ready: bool = True


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


def backoff_seconds(policy: FailurePolicy, restart: int) -> float:
    """Delay before restart number `restart` (1-based): exponential, capped."""
    if restart < 1:
        return 0.0
    delay = policy.backoff_seconds * 2 ** min(restart - 1, 30)
    return float(min(delay, policy.max_backoff_seconds))


def _pod_failure(pod: PodView, non_retryable: Iterable[int]) -> Failure | None:
    if pod.phase == "Failed":
        if pod.exit_code is not None and pod.exit_code in set(non_retryable):
            return Failure(
                Reason.NON_RETRYABLE,
                f"pod {pod.name} exited with code {pod.exit_code}, which is non-retryable "
                "(spec.failurePolicy.nonRetryableExitCodes): fix the job's configuration",
                retryable=False, pod=pod.name, node=pod.where or None, exit_code=pod.exit_code,
            )
        if pod.reason == "Evicted":
            return Failure(
                Reason.POD_EVICTED, f"pod {pod.name} was evicted: {pod.message or 'no message'}",
                pod=pod.name, node=pod.where or None,
            )
        code = "" if pod.exit_code is None else f" with exit code {pod.exit_code}"
        why = f" ({pod.reason})" if pod.reason else ""
        return Failure(
            Reason.POD_FAILED, f"pod {pod.name} failed{code}{why}",
            pod=pod.name, node=pod.where or None, exit_code=pod.exit_code,
        )
    if pod.terminating and pod.phase != "Succeeded":
        return Failure(
            Reason.POD_DELETED, f"pod {pod.name} is being deleted", pod=pod.name,
            node=pod.where or None,
        )
    return None


def _node_failure(pod: PodView, nodes: Mapping[str, NodeView]) -> Failure | None:
    where = pod.where
    if not where or pod.phase in ("Succeeded", "Failed"):
        return None
    node = nodes.get(where)
    if node is None:
        return Failure(
            Reason.NODE_LOST, f"node {where} of pod {pod.name} was deleted",
            pod=pod.name, node=where, lost_nodes=frozenset({where}),
        )
    if not node.ready:
        return Failure(
            Reason.NODE_NOT_READY, f"node {where} of pod {pod.name} is NotReady",
            pod=pod.name, node=where, lost_nodes=frozenset({where}),
        )
    return None


_ORDER = [
    Reason.NON_RETRYABLE, Reason.POD_FAILED, Reason.POD_EVICTED, Reason.POD_DELETED,
    Reason.NODE_LOST, Reason.NODE_NOT_READY,
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
            found.append(failure)
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
    if len(found) > 1:
        first = Failure(
            first.reason, f"{first.message} (+{len(found) - 1} more)", first.retryable,
            first.pod, first.node, first.exit_code, lost,
        )
    return first


def stalled_failure(
    heartbeat: datetime | None, running_since: datetime | None, policy: FailurePolicy,
    now: datetime,
) -> Failure | None:
    """A hang: no progress for progressTimeoutSeconds while every pod is Running.

    `heartbeat` is the current attempt's last progress.json time, None before its
    trainer first wrote one. The clock starts at the later of the heartbeat and
    the moment the gang became Running; until the first heartbeat the limit is
    startupTimeoutSeconds, since imports, rendezvous and a checkpoint load can
    take far longer than a training step.
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
        f"progress.json not updated for more than {limit}s (last heartbeat {int(idle)}s ago): "
        "the trainer hangs",
    )


@dataclass(frozen=True)
class RestartDecision:
    """What to do about a failure: restart the gang after a delay, or fail the job."""

    action: Literal["restart", "fail"]
    reason: str
    message: str
    delay_seconds: float = 0.0
    restarts: int = 0  # the job's restart count after this decision


def decide(failure: Failure, restarts: int, policy: FailurePolicy) -> RestartDecision:
    """Restart or fail, given `restarts` made so far."""
    if not failure.retryable:
        return RestartDecision("fail", Reason.NON_RETRYABLE, failure.message, restarts=restarts)
    if restarts >= policy.max_restarts:
        return RestartDecision(
            "fail", Reason.MAX_RESTARTS,
            f"{failure.message}; maxRestarts ({policy.max_restarts}) exhausted",
            restarts=restarts,
        )
    nth = restarts + 1
    delay = backoff_seconds(policy, nth)
    return RestartDecision(
        "restart", failure.reason,
        f"{failure.message}; restart {nth}/{policy.max_restarts} after {delay:g}s",
        delay_seconds=delay, restarts=nth,
    )
