"""End to end: a TrainingJob trains for real, writes its asynchronous checkpoints
and completes, keeping them. (A lost node and a hang restarting the gang from
the newest committed checkpoint are shown on real kubelets by tests/kind and,
for the hang, in place by tests/e2e/test_inplace.py; the recreate path of a
restart by test_inplace.py's killed trainer.)

The chart is installed by helm, the operator runs as a local process with
the chart's ServiceAccount token, and the trainer runs as real processes
(torch.distributed on gloo). KWOK nodes run no processes: the pod process
harness (testbed.harness) runs each pod's own command and environment
locally, standing in for a kubelet's process execution.

Kept CPU-cheap: the tiny model, a dozen steps, a checkpoint every few steps.
"""

from __future__ import annotations

from typing import Any

from testbed.harness_stack import checkpoint_store, step_losses
from tests.e2e.jobs import STEPS


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
