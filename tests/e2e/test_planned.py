"""End to end: `kubectl scale` down and back up loses no step (issue 16).

The real operator and trainer (gloo on CPU), the pod process harness standing in
for the kubelet (it rewrites the pods' downwardAPI control files when their
annotations change). Before each resize the operator asks the running gang for a
checkpoint through the pods' `topotrain.io/checkpoint-request` annotation and
waits for its COMMITTED; the new degree resumes from that step. The job commits
no periodic checkpoint (intervalSteps beyond the run), so without the request a
resize would start over from step 0.

The job holds at its middle step until both resizes are done (training.holdAtStep);
its losses are held to the single-process reference trainer's
(tests/trainer/reference.py) at every step, at every degree.
"""

from __future__ import annotations

from topotrain_trainer.config import TrainingConfig

from testbed.harness_stack import Stack, step_losses
from testbed.procs import wait_until
from tests.e2e.jobs import (
    JOB_TIMEOUT,
    LOSS_ATOL,
    TRAINING,
    attempts,
    holding,
    last_step,
    of_kind,
    phase_is,
)
from tests.trainer.reference import reference_run

# Every attempt holds at HOLD (training.holdAtStep, a test aid) until the test releases it once
# both resizes are done, so neither resize can find the job finished, however fast the machine:
# each lands mid-training or on the held gang.
STEPS, HOLD = 24, 12


def _scale(stack: Stack, name: str, data: int) -> None:
    stack.kubectl("-n", stack.namespace, "scale", f"trainingjobs.topotrain.io/{name}",
                  f"--replicas={data}")  # fmt: skip


def _resize_without_loss(stack: Stack, name: str, attempt: int, data: int) -> int:
    """Scale to `data` while attempt `attempt` trains; returns the attempt that took over."""
    def trained() -> int:
        """The last step attempt `attempt` reached (trained, or restored and held at)."""
        events = attempts(stack, name).get(attempt, [])
        if not of_kind(events, "step") and not of_kind(events, "held"):
            return 0
        return max([last_step(events), *(int(e["step"]) for e in of_kind(events, "restored"))])

    wait_until(lambda: trained() >= 1, timeout=JOB_TIMEOUT, what=f"attempt {attempt} training")
    reached = trained()
    _scale(stack, name, data)
    job = stack.wait_job(
        name, lambda j: (j["status"].get("parallelism") or {}).get("data") == data
        and int(j["status"]["attempt"]) > attempt, timeout=JOB_TIMEOUT, what=f"data={data}",
    )  # fmt: skip
    status = job["status"]
    request = status["checkpointRequest"]
    assert request["state"] == "Committed" and request["attempt"] == attempt, request
    assert status["restarts"] == 0, "a resize is not a failure"
    new = int(status["attempt"])
    # The old gang saved the step it had reached when asked: every step trained before the
    # scale is in the checkpoint the new degree restores.
    served = [e for e in of_kind(attempts(stack, name)[attempt], "checkpoint_requested")
              if e.get("request") == request["value"]]
    assert served and int(served[0]["step"]) == request["step"], served
    assert request["step"] >= reached, f"asked at step {reached}, saved {request['step']}"
    wait_until(lambda: bool(of_kind(attempts(stack, name).get(new, []), "restored")),
               timeout=JOB_TIMEOUT, what=f"attempt {new} restored")  # fmt: skip
    restored = of_kind(attempts(stack, name)[new], "restored")[0]
    assert int(restored["step"]) == request["step"], "the resumed step is the requested one"
    assert restored["mesh"]["data"] == data
    return new


def test_kubectl_scale_down_and_up_loses_no_step(stack: Stack) -> None:
    name = "scale"
    training = holding({**TRAINING, "steps": STEPS}, at=HOLD, attempts=STEPS)
    spec = {
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2, "minData": 1},
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": 10 * STEPS, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 0},
        "training": training,
    }
    stack.apply_job(name, spec)
    shrunk = _resize_without_loss(stack, name, 0, 1)
    _resize_without_loss(stack, name, shrunk, 2)
    stack.release_hold(name)
    job = stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded")
    assert job["status"]["restarts"] == 0 and job["status"]["parallelism"]["data"] == 2

    everything = [e for a in sorted(attempts(stack, name)) for e in attempts(stack, name)[a]]
    assert sorted(step_losses(everything)) == list(range(1, STEPS + 1))
    reference, _ = reference_run(TrainingConfig.from_mapping(training))
    for e in of_kind(everything, "step"):
        step, loss = int(e["step"]), float(e["loss"])
        assert abs(loss - reference[step - 1]) <= LOSS_ATOL, f"step {step}: {loss} != {reference[step - 1]}"
