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

from collections.abc import Iterator
from typing import Any

import pytest

from testbed import faults
from testbed.harness_stack import Stack, checkpoint_store, step_losses
from testbed.kube import Kube
from testbed.nodes import wait_nodes_ready
from testbed.procs import wait_until
from tests.e2e.jobs import (
    INTERVAL,
    JOB_TIMEOUT,
    STEPS,
    TRAINING,
    assert_losses_match,
    attempts,
    held,
    holding,
    last_step,
    of_kind,
    phase_is,
    spec_dp2,
)

# A hang is a gang that is Running but makes no progress for this long once its trainer
# reported a step (before that, startupTimeoutSeconds covers process start, rendezvous and
# the checkpoint load); every step reports (progressEvery 1) and takes well under a second.
HANG_TIMEOUT = 30


def test_job_trains_writes_async_checkpoints_and_completes(reference: dict[str, Any]) -> None:
    events, job, stack = reference["events"], reference["job"], reference["stack"]
    losses = step_losses(events)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1], "the loss goes down"
    saved = [e for e in events if e.get("event") == "checkpoint_saved"]
    # (A loaded machine may restart even this run, when a node misses heartbeats: the same steps
    # are then saved again, and every loss is still the same.)
    assert {e["step"] for e in saved} == {4, 8, 12} and {e["mode"] for e in saved} == {"async"}
    # Completion: Succeeded, pods gone, checkpoints kept in S3 (keep=3).
    assert job["status"]["phase"] == "Succeeded"
    assert reference["committed"] == [4, 8, 12]
    assert job["status"]["checkpoint"]["step"] == 12
    assert job["status"]["parallelism"] == {"tensor": 1, "pipeline": 1, "data": 2}
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


def _all_events(stack: Stack, job: str) -> list[dict[str, Any]]:
    return [e for events in attempts(stack, job).values() for e in events]


def test_node_failure_restarts_gang_from_last_committed_checkpoint(
    kube: Kube, stack: Stack, reference: dict[str, Any], restore_nodes: list[str]
) -> None:
    stack.apply_job("resume", spec_dp2(hold=True))
    # Lose a node once a checkpoint is committed and training has moved past it (the first
    # attempt holds there until the node's loss stops it).
    wait_until(lambda: held(stack, "resume"), timeout=JOB_TIMEOUT,
               what="a committed checkpoint and two more steps")  # fmt: skip
    victim = _node_of(stack, "resume", 0)
    restore_nodes.append(victim)
    faults.node_not_ready(kube.kubeconfig, victim)

    job = stack.wait_job(
        "resume", phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the restart"
    )
    status = job["status"]
    assert status["restarts"] >= 1 and status["attempt"] >= 1
    assert status["lastFailure"]["reason"] in ("NodeNotReady", "NodeLost", "PodFailed")
    by_attempt = attempts(stack, "resume")
    restored = of_kind(by_attempt[1], "restored")
    assert restored, "the new gang restored a checkpoint"
    resumed = int(restored[0]["step"])
    assert resumed >= INTERVAL and resumed % INTERVAL == 0
    assert resumed == status["recovery"]["resumeStep"]
    assert resumed <= last_step(by_attempt[0]), "never a checkpoint the failed gang had not reached"
    assert restored[0]["consumed_samples"] == resumed * TRAINING["globalBatch"]
    assert not {p["spec"]["nodeName"] for p in stack.pods("resume")} & {victim}
    # The whole run's losses, recomputed steps included, equal the uninterrupted run's.
    assert sorted(step_losses(_all_events(stack, "resume"))) == list(range(1, STEPS + 1))
    assert_losses_match(_all_events(stack, "resume"), reference["losses"])
    # `kubectl get tj` shows the restart, the checkpoint step and the recovery time.
    table = stack.kubectl("get", "tj", "resume", "-n", stack.namespace).stdout.splitlines()
    row = dict(zip(table[0].split(), table[1].split(), strict=False))
    assert int(row["RESTARTS"]) >= 1 and int(row["CHECKPOINT"]) == STEPS
    # RECOVERY is the time to the new attempt's first step, which includes the pods starting
    # and the trainer's import, rendezvous and checkpoint load, each reported as a phase.
    recovery = status["recovery"]
    assert float(row["RECOVERY"]) == recovery["timeToFirstStepSeconds"] > recovery["lastSeconds"] > 0
    phases = recovery["phases"]
    assert phases["podsRunning"] == recovery["lastSeconds"] and phases["checkpointLoad"] > 0
    assert recovery["cause"] == "infrastructure"


def test_hang_is_detected_and_restarted(stack: Stack, reference: dict[str, Any]) -> None:
    spec = {
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2},
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": INTERVAL, "keep": 2},
        "failurePolicy": {
            "backoffSeconds": 0,
            "maxRestarts": 3,
            "progressTimeoutSeconds": HANG_TIMEOUT,
            "restartInPlace": False,  # freeze() stops whole pods, supervisors too: the recreate path
        },
        "training": holding(TRAINING),
    }
    stack.apply_job("hang", spec)
    wait_until(lambda: held(stack, "hang"), timeout=JOB_TIMEOUT, what="a committed checkpoint")
    assert stack.harness is not None
    assert stack.harness.freeze(stack.namespace, "hang") == 2  # SIGSTOP; the pods stay Running
    # Released at once: from now on only the freeze keeps the gang from training (a gang that
    # were not frozen would go on to Succeed, and the wait below would fail).
    stack.release_hold("hang")
    stalled = stack.wait_job(
        "hang", lambda j: (j["status"].get("lastFailure") or {}).get("reason") == "ProgressStalled",
        timeout=JOB_TIMEOUT, what="the hang detected",
    )  # fmt: skip
    assert stalled["status"]["restarts"] >= 1

    job = stack.wait_job(
        "hang", phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the hang"
    )
    assert of_kind(attempts(stack, "hang").get(1, []), "restored"), (
        "the restarted gang resumed from a checkpoint"
    )
    assert_losses_match(_all_events(stack, "hang"), reference["losses"])
    assert job["status"]["restarts"] >= 1
