"""End to end: `kubectl drain` of a job's nodes loses no step (issue 16).

The real operator, the real trainer (gloo on CPU) under its pod supervisor,
`kubectl drain` against the real API server (cordon, then the Eviction API,
which honours PodDisruptionBudgets); the pod process harness stands in for the
kubelet: an evicted or deleted pod's processes get SIGTERM and the pod's grace
period. Two ways, both losing no step and keeping the uninterrupted run's losses:

- the operator moves the gang first (the default): it sees the cordon, asks the
  running gang for a checkpoint, and restarts it from that step on other nodes;
  with a PodDisruptionBudget of `minAvailable: <pods>` the drain's evictions wait
  for that and the drain then finds nothing left to evict;
- the eviction comes first (`operator.moveOffCordonedNodes: false`, or no room
  elsewhere): each rank finishes its step, the gang saves that step, waits for
  its COMMITTED and exits 75; the operator restarts the gang off the cordoned
  nodes and the new attempt resumes from the SIGTERM save.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from topotrain_trainer.config import TrainingConfig

from testbed.harness import HOLD_ENV
from testbed.harness_stack import S3Target, Stack, stack_in_new_namespace, step_losses
from testbed.kube import Kube
from testbed.procs import wait_until
from tests.e2e.jobs import (
    JOB_TIMEOUT,
    LOSS_ATOL,
    TRAINING,
    attempts,
    held,
    holding,
    last_step,
    of_kind,
    phase_is,
    spec_dp2,
)
from tests.trainer.reference import reference_run

# The shared 12-step run; its first attempt holds at HOLD until the drain stops it, so the drain
# lands mid-training however fast the machine.
STEPS = 12


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


@pytest.fixture
def stack_evicted_first(kube: Kube, s3_target: S3Target, tmp_path: Path) -> Iterator[Stack]:
    """The stack with an operator that leaves a gang on its cordoned nodes until evicted."""
    with stack_in_new_namespace(kube, s3_target, tmp_path, "drain-evicted",
                                moveOffCordonedNodes=False) as made:  # fmt: skip
        yield made


def _training(stack: Stack, name: str) -> tuple[dict[str, Any], list[str], int]:
    """A job trained past its first commit: its training section, its nodes, its last step."""
    training = holding({**TRAINING, "steps": STEPS})
    stack.apply_job(name, {**spec_dp2(), "training": training})
    wait_until(lambda: held(stack, name), timeout=JOB_TIMEOUT,
               what="a committed checkpoint and a step more")  # fmt: skip
    drained = sorted({p["spec"]["nodeName"] for p in stack.pods(name)})
    return training, drained, last_step(attempts(stack, name)[0])


def _every_step_once_with_the_reference_losses(
    stack: Stack, name: str, training: dict[str, Any], drained: list[str], exactly_once: bool
) -> None:
    by_attempt = attempts(stack, name)
    assert stack.harness is not None
    later = {launch.node for launch in stack.harness.launches if launch.job == name and launch.attempt != "0"}
    assert later and not later & set(drained), f"a pod ran on a cordoned node: {later & set(drained)}"
    everything: list[dict[str, Any]] = [e for a in sorted(by_attempt) for e in by_attempt[a]]
    assert sorted(step_losses(everything)) == list(range(1, STEPS + 1))
    trained_steps = [int(e["step"]) for e in of_kind(everything, "step")]
    if exactly_once:
        # Every step was trained exactly once: nothing trained before the drain was lost.
        assert len(trained_steps) == STEPS, f"{len(trained_steps) - STEPS} steps trained again after the drain"
    reference, _ = reference_run(TrainingConfig.from_mapping(training))
    for e in of_kind(everything, "step"):
        step, loss = int(e["step"]), float(e["loss"])
        assert abs(loss - reference[step - 1]) <= LOSS_ATOL, f"step {step}: {loss} != {reference[step - 1]}"


def test_a_drain_held_by_a_disruption_budget_waits_for_the_operator_to_move_the_gang(
    kube: Kube, stack: Stack, uncordon: list[str]
) -> None:
    """`minAvailable: <every pod>` refuses every eviction; the operator sees the drain's cordon,
    asks the gang for a checkpoint, restarts it from that step on other nodes and deletes the old
    pods itself, so the drain completes without evicting anything and no step is lost.

    (Not `maxUnavailable: 0`: the disruption controller takes the expected pod count from the
    TrainingJob's scale subresource, which is the data degree, 2 here, and that budget let 2 of
    the 4 pods be evicted. docs/operations.md says so.)"""
    name = "moved"
    training, drained, trained = _training(stack, name)
    stack.disruption_budget(name, len(stack.pods(name)))
    uncordon.extend(drained)
    drain = stack.kubectl("drain", *drained, "--pod-selector", f"topotrain.io/job={name}",
                          "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s",
                          check=False)  # fmt: skip
    assert drain.returncode == 0, drain.stderr[-2000:]

    job = stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the move")
    status = job["status"]
    assert status["restarts"] == 0 and not status.get("restartsByClass"), (
        f"a move is not a failure: {status.get('lastFailure')} {status.get('recovery')}")
    request = status["checkpointRequest"]
    assert request["reason"] == "drain" and request["state"] == "Committed", request
    assert request["step"] >= trained, f"cordoned at step {trained}, the requested save holds {request['step']}"
    by_attempt = attempts(stack, name)
    restored = of_kind(by_attempt[1], "restored")
    assert restored and int(restored[0]["step"]) == request["step"], "the move resumes from the requested step"
    reasons = [e.reason for e in stack.core.list_namespaced_event(
        stack.namespace, field_selector=f"involvedObject.name={name}").items]  # fmt: skip
    assert "NodeCordoned" in reasons and "CheckpointServed" in reasons, reasons
    _every_step_once_with_the_reference_losses(stack, name, training, drained, exactly_once=False)


def test_kubectl_drain_of_the_jobs_nodes_loses_no_step(
    kube: Kube, stack_evicted_first: Stack, uncordon: list[str]
) -> None:
    stack = stack_evicted_first
    name = "drain"
    training, drained, trained = _training(stack, name)
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
    _every_step_once_with_the_reference_losses(stack, name, training, drained, exactly_once=True)
