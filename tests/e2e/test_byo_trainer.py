"""End to end: a trainer topotrain did not write gets topotrain's recovery through the SDK.

`recipes/ddp_train.py` is a plain torchrun DDP script with five topotrain lines; the pods run
it under `topotrain-launch` (here `python -m topotrain_sdk.launch`, the same entry point). The
real operator, real S3 (versitygw) and real trainer processes (torch.distributed on gloo);
KWOK nodes run no processes, so the pod process harness runs each pod's command locally (a
stand-in for a kubelet's process execution, not a kubelet).

The losses are held to the same script run uninterrupted, outside any TrainingJob, by the
launcher on this machine.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testbed import faults
from testbed.harness_stack import Stack, checkpoint_store, step_losses
from testbed.procs import free_port, wait_until
from testbed.restart_probes import first_step_after, live_uids, pod_pid
from tests.e2e.jobs import (
    HOLD,
    INTERVAL,
    JOB_TIMEOUT,
    LOSS_ATOL,
    STEPS,
    attempts,
    held,
    holding,
    of_kind,
    phase_is,
)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "ddp_train.py"
COMMAND = ["python", "-m", "topotrain_sdk.launch", "--", "python", str(RECIPE)]
HANG_TIMEOUT = 30  # every step reports; a step takes well under a second


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The recipe's losses run to the end by the launcher alone: two workers, no checkpoints."""
    control = tmp_path_factory.mktemp("control")
    env = {**os.environ, "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()),
           "TOPOTRAIN_CONTROL_DIR": str(control), "STEPS": str(STEPS)}  # fmt: skip
    for key in ("TOPOTRAIN_JOB_NAME", "TOPOTRAIN_CHECKPOINT_URI", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    run = subprocess.run([sys.executable, "-m", "topotrain_sdk.launch", "--", sys.executable,
                          str(RECIPE)], env=env, capture_output=True, text=True, timeout=600,
                         check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    losses = step_losses(events)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def spec(**failure_policy: Any) -> dict[str, Any]:
    """dp=2 on one-rank pods; the first attempt holds at HOLD (a committed step behind it)."""
    return {
        "command": COMMAND,
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2},
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": INTERVAL, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 5, **failure_policy},
        "training": holding({}),
    }


def assert_uninterrupted_losses(events: list[dict[str, Any]], reference: dict[int, float]) -> None:
    losses = step_losses(events)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for e in of_kind(events, "step"):
        assert math.isclose(float(e["loss"]), reference[int(e["step"])], abs_tol=LOSS_ATOL), e


def resumed_in_place(stack: Stack, name: str, before: dict[str, str]) -> dict[str, Any]:
    """Wait for the restart's first step; every pod kept (same UIDs). The job's status then."""
    job = stack.wait_job(name, first_step_after, timeout=JOB_TIMEOUT, what="the first step after the fault")
    assert job["status"]["recovery"]["mode"] == "inPlace"
    assert live_uids(stack, name) == before, "a pod was replaced"
    return dict(job["status"])


def finished(stack: Stack, name: str, reference: dict[int, float]) -> list[dict[str, Any]]:
    """Succeeded with every step's loss the uninterrupted run's, resumed from the newest
    committed step behind the hold; the trainer's log events."""
    stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the fault")
    events = stack.events(name)
    restored = of_kind(events, "restored")
    assert [int(e["step"]) for e in restored] == [HOLD // INTERVAL * INTERVAL]
    assert_uninterrupted_losses(events, reference)
    # (A hung gang's SIGTERM at the in-place restart may save the held step too: a stop save.)
    committed = [c.step for c in checkpoint_store(stack, name).list_committed()]
    assert committed[-1] == STEPS and len(committed) == 3, committed
    return events


def test_a_killed_worker_resumes_in_place_from_the_newest_committed_step(
    stack: Stack, uninterrupted: dict[int, float]
) -> None:
    """SIGKILL pod 1's worker: its launcher reports the failure and keeps the pod; the operator
    restarts the gang in place; both pods resume from step 4 with the uninterrupted losses."""
    stack.apply_job("byo-kill", spec())
    wait_until(lambda: held(stack, "byo-kill"), timeout=JOB_TIMEOUT, what="a commit, then the hold")
    before = live_uids(stack, "byo-kill")
    assert faults.signal_trainer(pod_pid(stack, "byo-kill", 1), signal.SIGKILL), "no worker found"
    status = resumed_in_place(stack, "byo-kill", before)
    assert status["lastFailure"]["reason"] == "PodFailed" and status["restarts"] >= 1
    finished(stack, "byo-kill", uninterrupted)


def test_a_hung_worker_is_restarted_in_place_with_every_pod_kept(
    stack: Stack, uninterrupted: dict[int, float]
) -> None:
    """SIGSTOP pod 1's worker and release the hold: pod 0 blocks in DDP's all-reduce, no step is
    reported, the operator sees the hang and restarts the gang in place (the launchers stop their
    workers, SIGCONT included, and start the next attempt's)."""
    stack.apply_job("byo-hang", spec(progressTimeoutSeconds=HANG_TIMEOUT))
    wait_until(lambda: held(stack, "byo-hang"), timeout=JOB_TIMEOUT, what="a commit, then the hold")
    before = live_uids(stack, "byo-hang")
    assert faults.signal_trainer(pod_pid(stack, "byo-hang", 1), signal.SIGSTOP), "no worker found"
    stack.release_hold("byo-hang")
    status = resumed_in_place(stack, "byo-hang", before)
    assert status["lastFailure"]["reason"] == "ProgressStalled"
    finished(stack, "byo-hang", uninterrupted)


def _scale(stack: Stack, name: str, attempt: int, data: int) -> int:
    """`kubectl scale` the job to `data` while attempt `attempt` holds; the operator asks the
    gang for a checkpoint first, and the next attempt restores exactly that step. Returns it."""
    wait_until(lambda: bool(of_kind(attempts(stack, name).get(attempt, []), "held")),
               timeout=JOB_TIMEOUT, what=f"attempt {attempt} held")  # fmt: skip
    stack.kubectl("-n", stack.namespace, "scale", f"trainingjobs.topotrain.io/{name}",
                  f"--replicas={data}")  # fmt: skip
    job = stack.wait_job(name, lambda j: (j["status"].get("parallelism") or {}).get("data") == data
                         and int(j["status"]["attempt"]) > attempt, timeout=JOB_TIMEOUT,
                         what=f"data={data}")  # fmt: skip
    status = job["status"]
    request = status["checkpointRequest"]
    assert request["state"] == "Committed" and request["attempt"] == attempt, request
    assert status["restarts"] == 0, "a resize is not a failure"
    new = int(status["attempt"])
    wait_until(lambda: bool(of_kind(attempts(stack, name).get(new, []), "restored")),
               timeout=JOB_TIMEOUT, what=f"attempt {new} restored")  # fmt: skip
    assert int(of_kind(attempts(stack, name)[new], "restored")[0]["step"]) == request["step"]
    return new


def test_kubectl_scale_down_and_up_loses_no_step(stack: Stack, uninterrupted: dict[int, float]) -> None:
    """No periodic checkpoint (the interval is beyond the run): only the checkpoint the operator
    requests before each resize keeps the steps. Every attempt holds at HOLD until both resizes
    are done; the recipe's global batch is split over the ranks, so dp=1 trains as dp=2 does."""
    name = "byo-scale"
    job = {**spec(), "checkpoint": {"intervalSteps": 10 * STEPS, "keep": 3},
           "parallelism": {"tensor": 1, "pipeline": 1, "data": 2, "minData": 1},
           "training": holding({}, attempts=STEPS)}  # fmt: skip
    stack.apply_job(name, job)
    _scale(stack, name, _scale(stack, name, 0, 1), 2)
    stack.release_hold(name)
    done = stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded")
    assert done["status"]["restarts"] == 0 and done["status"]["parallelism"]["data"] == 2
    assert_uninterrupted_losses(stack.events(name), uninterrupted)
