"""Failure classification and the restart policy, as tables."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from topotrain.api.spec import FailurePolicy
from topotrain.api.status import Reason, RestartBudgets
from topotrain.core.policy import (
    NodeView,
    PodView,
    detect_failure,
    stalled_failure,
)
from topotrain.core.restarts import backoff_seconds, decide

NODES = {"a": NodeView("a"), "b": NodeView("b"), "sick": NodeView("sick", ready=False)}
DEFAULT = FailurePolicy()


def pod(i: int = 0, **kw: object) -> PodView:
    base: dict[str, object] = {"phase": "Running", "node": "a", "planned_node": "a"}
    base.update(kw)
    return PodView(f"p{i}", i, 0, **base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pods", "expected", "reason", "retryable"),
    [
        ([pod(0), pod(1, node="b")], 2, None, True),
        ([pod(0, phase="Failed", exit_code=1), pod(1)], 2, Reason.POD_FAILED, True),
        ([pod(0, phase="Failed", exit_code=137, reason="OOMKilled")], 1, Reason.POD_FAILED, True),
        ([pod(0, phase="Failed", exit_code=78)], 1, Reason.NON_RETRYABLE, False),
        # non-retryable wins over a simultaneous ordinary failure
        ([pod(0, phase="Failed", exit_code=1), pod(1, phase="Failed", exit_code=78)], 2,
         Reason.NON_RETRYABLE, False),
        ([pod(0, phase="Failed", reason="Evicted")], 1, Reason.POD_EVICTED, True),
        # a planned stop (SIGTERM, checkpoint committed): infrastructure, never PodFailed
        ([pod(0, phase="Failed", exit_code=75)], 1, Reason.POD_DELETED, True),
        ([pod(0, terminating=True)], 1, Reason.POD_DELETED, True),
        ([pod(0)], 2, Reason.POD_DELETED, True),  # index 1 vanished
        ([pod(0, node="gone", planned_node="gone")], 1, Reason.NODE_LOST, True),
        ([pod(0, node="sick", planned_node="sick")], 1, Reason.NODE_NOT_READY, True),
        ([pod(0, phase="Pending", node="", planned_node="gone")], 1, Reason.NODE_LOST, True),
        ([pod(0, phase="Succeeded", node="gone")], 1, None, True),  # finished pods hold nothing
    ],
)
def test_detect_failure(pods: list[PodView], expected: int, reason: str | None, retryable: bool) -> None:
    failure = detect_failure(pods, expected, NODES, DEFAULT, started=True)
    assert (failure.reason if failure else None) == reason
    if failure:
        assert failure.retryable is retryable


@pytest.mark.parametrize(("reason", "message"), [
    ("OutOfnvidia.com/gpu", "Pod was rejected: Node didn't have enough resource: nvidia.com/gpu"),
    ("NodeAffinity", "Pod was rejected: Predicate NodeAffinity failed"),
    ("UnexpectedAdmissionError", "Pod was rejected: Allocate failed due to no healthy devices"),
])
def test_a_pod_its_kubelet_refused_is_an_infrastructure_failure_of_its_node(reason: str, message: str) -> None:
    """A pod bound by the operator (`--pod-binding operator`) whose node's kubelet refuses it at
    admission never ran: the restart counts against the infrastructure budget, not the
    application's, and the node is blamed (re-plans avoid it after nodeFailureThreshold)."""
    failure = detect_failure([pod(0, phase="Failed", reason=reason, message=message), pod(1, node="b")],
                             2, NODES, DEFAULT, started=True)
    assert failure is not None and failure.reason == Reason.POD_EVICTED and failure.retryable
    assert failure.kind == "infrastructure" and failure.blamed == {"a"}
    assert "refused by node a's kubelet" in failure.message and reason in failure.message
    # a container that ran and exited is the application's, whatever the pod's reason says
    ran = detect_failure([pod(0, phase="Failed", reason=reason, exit_code=1)], 1, NODES, DEFAULT, started=True)
    assert ran is not None and ran.reason == Reason.POD_FAILED and ran.kind == "application"


def test_lost_nodes_are_collected() -> None:
    pods = [pod(0, node="gone", planned_node="gone"), pod(1, node="sick", planned_node="sick")]
    failure = detect_failure(pods, 2, NODES, DEFAULT, started=True)
    assert failure is not None and failure.lost_nodes == {"gone", "sick"}


def test_custom_non_retryable_codes() -> None:
    policy = FailurePolicy(nonRetryableExitCodes=[2])
    assert detect_failure([pod(0, phase="Failed", exit_code=2)], 1, NODES, policy, started=True).retryable is False  # type: ignore[union-attr]
    assert detect_failure([pod(0, phase="Failed", exit_code=78)], 1, NODES, policy, started=True).retryable is True  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("base", "cap", "restart", "delay"),
    [(10, 300, 1, 10), (10, 300, 2, 20), (10, 300, 3, 40), (10, 300, 6, 300), (10, 300, 60, 300),
     (0, 300, 5, 0), (10, 300, 0, 0)],
)
def test_backoff_is_exponential_and_capped(base: int, cap: int, restart: int, delay: float) -> None:
    policy = FailurePolicy(backoffSeconds=base, maxBackoffSeconds=cap)
    assert backoff_seconds(policy, restart) == delay


@pytest.mark.parametrize(
    ("restarts", "max_restarts", "action", "reason"),
    [(0, 3, "restart", Reason.POD_FAILED), (2, 3, "restart", Reason.POD_FAILED),
     (3, 3, "fail", Reason.MAX_RESTARTS), (0, 0, "fail", Reason.MAX_RESTARTS)],
)
def test_decide(restarts: int, max_restarts: int, action: str, reason: str) -> None:
    failure = detect_failure([pod(0, phase="Failed", exit_code=1)], 1, NODES, DEFAULT, started=True)
    assert failure is not None
    verdict = decide(failure, RestartBudgets(application=restarts), FailurePolicy(maxRestarts=max_restarts))
    assert (verdict.action, verdict.reason) == (action, reason)
    if action == "restart":
        assert verdict.restarts == restarts + 1


T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("heartbeat", "running", "now", "timeout", "stalled"),
    [
        (T0, T0, T0 + timedelta(seconds=61), 60, True),
        (T0 + timedelta(seconds=30), T0, T0 + timedelta(seconds=61), 60, False),
        # a heartbeat from before the gang became Running does not count against it
        (T0 - timedelta(hours=1), T0, T0 + timedelta(seconds=30), 60, False),
        (T0 - timedelta(hours=1), T0, T0 + timedelta(seconds=61), 60, True),
        (T0, T0, T0 + timedelta(hours=5), 0, False),  # 0 disables
        (T0, None, T0 + timedelta(hours=5), 60, False),  # not Running
    ],
)
def test_hang_detection_after_the_first_heartbeat(
    heartbeat: datetime, running: datetime | None, now: datetime, timeout: int, stalled: bool
) -> None:
    policy = FailurePolicy(progressTimeoutSeconds=timeout, startupTimeoutSeconds=600)
    failure = stalled_failure(heartbeat, running, policy, now)
    assert (failure is not None) is stalled
    if failure is not None:
        assert failure.reason == Reason.PROGRESS_STALLED and "has not changed" in failure.message


@pytest.mark.parametrize(
    ("startup", "idle", "stalled"),
    [
        (600, 599, False),  # slow start-up (imports, rendezvous, checkpoint load) is not a hang
        (600, 601, True),  # ... until startupTimeoutSeconds
        (0, 61, True),  # 0: the progress timeout applies from the start
        (0, 59, False),
    ],
)
def test_hang_detection_before_the_first_heartbeat(startup: int, idle: int, stalled: bool) -> None:
    policy = FailurePolicy(progressTimeoutSeconds=60, startupTimeoutSeconds=startup)
    failure = stalled_failure(None, T0, policy, T0 + timedelta(seconds=idle))
    assert (failure is not None) is stalled
    if failure is not None:
        assert "while starting" in failure.message


def test_a_pod_killed_at_the_end_of_its_deletion_grace_period_is_not_the_applications_fault() -> None:
    """A drained pod whose save outran its grace period is SIGKILLed (137) while Terminating: an
    infrastructure restart (drain e2e: it counted as an application failure)."""
    killed = pod(0, phase="Failed", exit_code=137)
    failure = detect_failure([replace(killed, terminating=True)], 1, NODES, DEFAULT, started=True)
    assert failure is not None and failure.reason == Reason.POD_DELETED and failure.kind == "infrastructure"
    crashed = detect_failure([killed], 1, NODES, DEFAULT, started=True)
    assert crashed is not None and crashed.reason == Reason.POD_FAILED
