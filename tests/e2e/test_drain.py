"""End to end: `kubectl drain` of a job's nodes loses no step (issue 16).

The real operator, the real trainer (gloo on CPU) under its pod supervisor,
`kubectl drain` against the real API server (cordon, then the Eviction API);
the pod process harness stands in for the kubelet: an evicted pod's processes
get SIGTERM and the pod's grace period. Each rank finishes its step, the gang
saves that step, waits for its COMMITTED and exits 75. The operator restarts the
gang off the cordoned nodes (a cordoned node never takes a replacement pod, so
the restart is a recreate) and the new attempt resumes from the SIGTERM save:
every step trained before the drain is kept, and the run's losses are the
uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from topotrain_trainer.config import TrainingConfig

from testbed.harness import HOLD_ENV
from testbed.harness_stack import Stack, step_losses
from testbed.kube import Kube
from testbed.procs import wait_until
from tests.e2e.jobs import (
    INTERVAL,
    JOB_TIMEOUT,
    LOSS_ATOL,
    TRAINING,
    attempts,
    last_step,
    of_kind,
    phase_is,
    spec_3d,
)
from tests.trainer.reference import reference_run

# Longer than the shared 12-step run, so that the drain lands mid-training on a quiet machine
# too (the eviction reaches the ranks a second or two after `kubectl drain` starts).
STEPS = 40


@pytest.fixture(autouse=True)
def kubelet_like_deletion(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness keeps an evicted pod Terminating until its processes exit, as a kubelet does
    (KWOK alone deletes it at once, and the operator would not see the save in flight)."""
    monkeypatch.setenv(HOLD_ENV, "1")


@pytest.fixture
def uncordon(kube: Kube) -> Iterator[list[str]]:
    """Nodes a test cordoned; they are made schedulable again afterwards."""
    cordoned: list[str] = []
    yield cordoned
    for node in cordoned:
        kube.kubectl("uncordon", node, check=False)


def test_kubectl_drain_of_the_jobs_nodes_loses_no_step(
    kube: Kube, stack: Stack, uncordon: list[str]
) -> None:
    name = "drain"
    training = {**TRAINING, "steps": STEPS}
    stack.apply_job(name, {**spec_3d(), "training": training})
    wait_until(
        lambda: bool(of_kind(attempts(stack, name).get(0, []), "checkpoint_committed"))
        and last_step(attempts(stack, name).get(0, [])) >= INTERVAL + 1,
        timeout=JOB_TIMEOUT, what="a committed checkpoint and a step more",
    )  # fmt: skip
    drained = sorted({p["spec"]["nodeName"] for p in stack.pods(name)})
    trained = last_step(attempts(stack, name)[0])
    uncordon.extend(drained)
    # Cordon them all first, as a maintenance of these machines would: the restarted gang must
    # not land on a node that is drained next.
    kube.kubectl("cordon", *drained)
    for node in drained:
        kube.kubectl("drain", node, "--pod-selector", f"topotrain.io/job={name}",
                     "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s")  # fmt: skip

    job = stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the drain")
    status = job["status"]
    assert status["restartsByClass"].get("application", 0) == 0, "an eviction is not the trainer's fault"
    by_attempt = attempts(stack, name)
    stopped = of_kind(by_attempt[0], "stopped")
    assert stopped and all(e["committed"] for e in stopped), stopped
    saved = int(stopped[0]["step"])
    assert saved >= trained, f"drained at step {trained}, the SIGTERM save holds {saved}"
    restored = of_kind(by_attempt[1], "restored")
    assert restored and int(restored[0]["step"]) == saved, "the next attempt resumes from the SIGTERM save"
    assert stack.harness is not None
    later = {launch.node for launch in stack.harness.launches if launch.job == name and launch.attempt != "0"}
    assert later and not later & set(drained), f"a pod ran on a cordoned node: {later & set(drained)}"

    everything: list[dict[str, Any]] = [e for a in sorted(by_attempt) for e in by_attempt[a]]
    assert sorted(step_losses(everything)) == list(range(1, STEPS + 1))
    # Every step was trained exactly once: nothing trained before the drain was lost.
    trained_steps = [int(e["step"]) for e in of_kind(everything, "step")]
    assert len(trained_steps) == STEPS, f"{len(trained_steps) - STEPS} steps trained again after the drain"
    reference, _ = reference_run(TrainingConfig.from_mapping(training))
    for e in of_kind(everything, "step"):
        step, loss = int(e["step"]), float(e["loss"])
        assert abs(loss - reference[step - 1]) <= LOSS_ATOL, f"step {step}: {loss} != {reference[step - 1]}"
