"""End to end: a TrainingJob trains for real, loses a node, and resumes from
its last asynchronous checkpoint.

The chart is installed by helm, the operator runs as a local process with
the chart's ServiceAccount token, and the trainer runs as real processes
(torch.distributed on gloo). KWOK nodes run no processes: the pod process
harness (testbed.harness) runs each pod's own command and environment
locally, standing in for a kubelet's process execution.

Kept CPU-cheap: the tiny model, a dozen steps, a checkpoint every few steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from testbed import faults
from testbed.harness_stack import (
    S3Target,
    Stack,
    checkpoint_store,
    stack_in_new_namespace,
    step_losses,
)
from testbed.kube import Kube
from testbed.nodes import wait_nodes_ready
from testbed.procs import wait_until

# The trainer's own numerics tests hold a resumed or resharded run to the
# uninterrupted one within this relative tolerance on CPU (fp32, gloo).
LOSS_RTOL = 1e-4
STEPS = 12
INTERVAL = 4
JOB_TIMEOUT = 420.0

TRAINING = {
    "model": "tiny",
    "steps": STEPS,
    "globalBatch": 8,
    "microBatch": 2,
    "progressEvery": 1,
    "metricsPort": 0,
}


def spec_3d(**failure_policy: Any) -> dict[str, Any]:
    """tp=2, pp=2, dp=2 on 2-GPU pods: 4 pods of 2 ranks, 8 ranks in all."""
    return {
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 2},
        "worker": {"gpusPerPod": 2, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": INTERVAL, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 5, **failure_policy},
        "training": TRAINING,
    }


def phase_is(phase: str) -> Any:
    return lambda job: job.get("status", {}).get("phase") == phase


def assert_losses_match(run: dict[int, float], reference: dict[int, float]) -> None:
    assert sorted(run) == sorted(reference), "every step of the run must have a loss"
    for step, loss in reference.items():
        assert math.isclose(run[step], loss, rel_tol=LOSS_RTOL), (
            f"step {step}: {run[step]} != {loss}"
        )


@pytest.fixture(scope="module")
def reference(
    kube: Kube, s3_target: S3Target, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """One uninterrupted 3D run to completion: its final job, losses and committed checkpoints."""
    with stack_in_new_namespace(
        kube, s3_target, tmp_path_factory.mktemp("reference"), "e2e-ref"
    ) as stack:
        stack.apply_job("ref", spec_3d())
        job = stack.wait_job("ref", phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded")
        wait_until(
            lambda: not stack.pods("ref"), timeout=120, what="the finished job's pods to be gone"
        )
        yield {
            "job": job,
            "events": stack.events("ref"),
            "committed": [c.step for c in checkpoint_store(stack, "ref").list_committed()],
            "stack": stack,
        }


def test_3d_job_trains_writes_async_checkpoints_and_completes(reference: dict[str, Any]) -> None:
    events, job, stack = reference["events"], reference["job"], reference["stack"]
    losses = step_losses(events)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1], "the loss goes down"
    saved = [e for e in events if e.get("event") == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [4, 8, 12] and {e["mode"] for e in saved} == {"async"}
    # Completion: Succeeded, pods gone, checkpoints kept in S3 (keep=3).
    assert job["status"]["phase"] == "Succeeded"
    assert reference["committed"] == [4, 8, 12]
    assert job["status"]["checkpoint"]["step"] == 12
    assert job["status"]["parallelism"] == {"tensor": 2, "pipeline": 2, "data": 2}
    stack.kubectl(
        "delete", "trainingjob", "ref", "-n", stack.namespace, "--wait=true", "--timeout=60s"
    )
    assert [c.step for c in checkpoint_store(stack, "ref").list_committed()] == [4, 8, 12], (
        "deleting a TrainingJob leaves its checkpoints"
    )


@pytest.fixture
def restore_nodes(kube: Kube) -> Iterator[list[str]]:
    """Names of nodes a test made fail; they are made Ready again afterwards."""
    failed: list[str] = []
    yield failed
    for node in failed:
        faults.node_ready(kube.kubeconfig, node)
    wait_nodes_ready(kube.kubeconfig, failed, timeout=120)


def _node_of(stack: Stack, job: str, index: int) -> str:
    pods = [
        p
        for p in stack.pods(job)
        if p["metadata"]["labels"].get("topotrain.io/index") == str(index)
    ]
    node: str = pods[0]["spec"]["nodeName"]
    return node


def _events_of(stack: Stack, job: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in stack.events(job) if e.get("event") == kind]


def test_node_failure_restarts_gang_from_last_committed_checkpoint(
    kube: Kube, stack: Stack, reference: dict[str, Any], restore_nodes: list[str]
) -> None:
    stack.apply_job("resume", spec_3d())
    # Lose a node once a checkpoint is committed and training has moved past it.
    wait_until(
        lambda: bool(_events_of(stack, "resume", "checkpoint_committed"))
        and max((e["step"] for e in _events_of(stack, "resume", "step")), default=0) >= INTERVAL + 2,
        timeout=JOB_TIMEOUT, what="a committed checkpoint and two more steps",
    )  # fmt: skip
    victim = _node_of(stack, "resume", 0)
    old_nodes = {p["spec"]["nodeName"] for p in stack.pods("resume")}
    restore_nodes.append(victim)
    faults.node_not_ready(kube.kubeconfig, victim)

    job = stack.wait_job(
        "resume", phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the restart"
    )
    status = job["status"]
    assert status["restarts"] >= 1 and status["attempt"] >= 1
    assert status["lastFailure"]["reason"] in ("NodeNotReady", "NodeLost", "PodFailed")
    restored = _events_of(stack, "resume", "restored")
    assert restored, "the new gang restored a checkpoint"
    resumed = restored[0]["step"]
    assert resumed >= INTERVAL and resumed % INTERVAL == 0
    assert resumed == status["recovery"]["resumeStep"]
    assert restored[0]["consumed_samples"] == resumed * TRAINING["globalBatch"]
    # The whole run's losses equal the uninterrupted run's.
    assert_losses_match(step_losses(stack.events("resume")), step_losses(reference["events"]))
    assert victim in old_nodes
    # `kubectl get tj` shows the restart, the checkpoint step and the recovery time.
    table = stack.kubectl("get", "tj", "resume", "-n", stack.namespace).stdout.splitlines()
    row = dict(zip(table[0].split(), table[1].split(), strict=False))
    assert int(row["RESTARTS"]) >= 1 and int(row["CHECKPOINT"]) == STEPS
    assert float(row["RECOVERY"]) > 0


def test_hang_is_detected_and_restarted(stack: Stack) -> None:
    spec = {
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2},
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": 5, "keep": 2},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 3, "progressTimeoutSeconds": 20},
        "training": {**TRAINING, "steps": 20},
    }
    stack.apply_job("hang", spec)
    wait_until(
        lambda: bool(_events_of(stack, "hang", "checkpoint_committed")),
        timeout=JOB_TIMEOUT,
        what="a committed checkpoint",
    )
    assert stack.harness is not None
    assert stack.harness.freeze(stack.namespace, "hang") == 2  # SIGSTOP: the pods stay Running

    job = stack.wait_job(
        "hang", phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the hang"
    )
    assert job["status"]["restarts"] >= 1
    reasons = [e.get("reason") for e in _job_failures(job)]
    assert "ProgressStalled" in reasons
    assert _events_of(stack, "hang", "restored"), "the restarted gang resumed from a checkpoint"


def _job_failures(job: dict[str, Any]) -> list[dict[str, Any]]:
    failure = job["status"].get("lastFailure")
    return [failure] if failure else []
