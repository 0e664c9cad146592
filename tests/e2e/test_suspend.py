"""End to end: `spec.suspend` stops a training gang with no lost step and resumes it.

The real operator and trainer (gloo on CPU), the pod process harness standing in for the
kubelet. The job commits no periodic checkpoint (intervalSteps beyond the run), so every step
that survives the suspension does so through the checkpoint the operator asks for before it
stops the gang (or the trainers' own save on SIGTERM, when it commits). Losses are held to the single-process
reference at every step.
"""

from __future__ import annotations

import json

from topotrain_trainer.config import TrainingConfig

from testbed.harness_stack import Stack, step_losses
from testbed.procs import wait_until
from tests.e2e.jobs import (
    JOB_TIMEOUT,
    TRAINING,
    assert_losses_match,
    attempts,
    holding,
    last_step,
    of_kind,
    phase_is,
)
from tests.trainer.reference import reference_run

# The first attempt holds at HOLD (training.holdAtStep, a test aid) until the suspension stops
# it, so the suspension lands mid-training however fast the machine; the resumed one runs free.
STEPS, HOLD = 24, 12


def _suspend(stack: Stack, name: str, on: bool) -> None:
    stack.kubectl("-n", stack.namespace, "patch", f"trainingjobs.topotrain.io/{name}", "--type=merge",
                  "-p", json.dumps({"spec": {"suspend": on}}))  # fmt: skip


def test_suspend_stops_the_gang_after_its_checkpoint_and_resume_loses_no_step(stack: Stack) -> None:
    name = "pause"
    training = holding({**TRAINING, "steps": STEPS}, at=HOLD)
    stack.apply_job(name, {
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2},
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": 10 * STEPS, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 0},
        "training": training,
    })  # fmt: skip
    wait_until(lambda: last_step(attempts(stack, name).get(0, [])) >= 1, timeout=JOB_TIMEOUT,
               what="attempt 0 training")  # fmt: skip
    trained = last_step(attempts(stack, name)[0])
    _suspend(stack, name, True)
    job = stack.wait_job(name, phase_is("Suspended"), timeout=JOB_TIMEOUT, what="Suspended")
    status = job["status"]
    request = status["checkpointRequest"]
    assert request["state"] == "Committed" and request["attempt"] == 0, request
    assert request["step"] >= trained, f"asked at step {trained}, saved {request['step']}"
    assert status["restarts"] == 0 and int(status["attempt"]) == 1
    assert {c["type"]: c["status"] for c in status["conditions"]}["Suspended"] == "True"
    wait_until(lambda: not stack.pods(name), timeout=JOB_TIMEOUT, what="every pod of the job gone")
    before = last_step(attempts(stack, name)[0])
    assert before <= HOLD

    _suspend(stack, name, False)
    job = stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded")
    assert job["status"]["restarts"] == 0
    restored = of_kind(attempts(stack, name)[1], "restored")
    # no lost step: the resume starts at or after the step the gang had reached when asked
    # (later when its SIGTERM save committed; the harness may not keep a deleted pod's last lines)
    assert len(restored) == 1 and int(restored[0]["step"]) >= request["step"], restored
    everything = [e for a in sorted(attempts(stack, name)) for e in attempts(stack, name)[a]]
    logged = sorted(step_losses(everything))
    assert logged[0] == 1 and logged[-1] == STEPS
    assert set(range(int(restored[0]["step"]) + 1, STEPS + 1)) <= set(logged)
    reference, _ = reference_run(TrainingConfig.from_mapping(training))
    assert_losses_match(everything, {i + 1: loss for i, loss in enumerate(reference)})
