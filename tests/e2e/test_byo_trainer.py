"""End to end: trainers topotrain did not write get topotrain's recovery through the SDK.

Two recipes, each as its users write it: `recipes/ddp_train.py`, a plain torchrun DDP script
(`Session.step_done`, DCP checkpoints), and `recipes/hf_trainer.py`, a Hugging Face `Trainer`
with a `TrainerCallback` (the Trainer's own checkpoint folders through the SDK's folder
adapter). The pods run them under `topotrain-launch --fork` (here `python -m topotrain_sdk.launch`,
the same entry point; each attempt's workers forked from the pod's forker). The real operator, real S3 (versitygw) and real trainer processes
(torch.distributed on gloo); KWOK nodes run no processes, so the pod process harness runs
each pod's command locally (a stand-in for a kubelet's process execution, not a kubelet).

One job per recipe goes through every fault of the acceptance in turn, one per attempt, each
attempt held (training.holdAtStep, a test aid) until the test's fault or resize lands:

- attempt 0: SIGKILL of pod 1's worker; the gang restarts in place (pod UIDs unchanged) from
  the newest committed step (4);
- attempt 1: `kubectl scale` to dp=1, attempt 2: back to dp=2; each resize restores exactly
  the step the operator's checkpoint request saved (6, then 7), no restart counted;
- attempt 3, once it committed step 8: hang detection is turned on (progressTimeoutSeconds, a
  field the gang does not roll for), pod 1's worker gets SIGSTOP and this attempt alone is
  released (`attempt-3`): pod 0 blocks in its next collective with pod 1 (the hold's poll or
  the step's gradient all-reduce), no step is reported, the operator restarts the gang in place
  (the launchers stop their workers, SIGCONT included) from step 8. Turned on earlier, the hang
  clock would also run through the holds of the resizes;
- attempt 4 trains to the end, hang detection off again (30 s is short for a step or a save on
  a CI machine that runs the kind suite beside this one). Every step's loss, in every attempt,
  is the same script's run uninterrupted by the launcher alone on this machine (within
  LOSS_ATOL).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from testbed import faults
from testbed.harness_proc import events_by_attempt
from testbed.harness_stack import Stack, checkpoint_store, step_losses
from testbed.procs import free_port, wait_until
from testbed.restart_probes import first_step_after, live_uids, pod_pid
from tests.e2e.jobs import (
    HOLD,
    INTERVAL,
    JOB_TIMEOUT,
    LOSS_ATOL,
    STEPS,
    of_kind,
    phase_is,
)
from topotrain_sdk.contract import CONTRACT_VERSION

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RECIPE = {"ddp": RECIPES / "ddp_train.py", "hf": RECIPES / "hf_trainer.py"}
HANG_TIMEOUT = 30  # every step reports; a step takes well under a second
HELD_ATTEMPTS = 4  # kill, hang, scale down, scale up: attempt 4 trains to the end


def _launch(recipe: str, folder: Path) -> subprocess.Popen[bytes]:
    """The recipe run to the end by the launcher alone (two workers, no checkpoints); its output
    in `folder`/out and err."""
    folder.mkdir()
    env = {**os.environ, "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()),
           "TOPOTRAIN_CONTROL_DIR": str(folder), "STEPS": str(STEPS)}  # fmt: skip
    for key in ("TOPOTRAIN_JOB_NAME", "TOPOTRAIN_CHECKPOINT_URI", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    with (folder / "out").open("wb") as out, (folder / "err").open("wb") as err:
        return subprocess.Popen([sys.executable, "-m", "topotrain_sdk.launch", "--", sys.executable,
                                 str(RECIPE[recipe])], env=env, stdout=out, stderr=err)  # fmt: skip


def uninterrupted(runs: dict[str, tuple[subprocess.Popen[bytes], Path]]) -> dict[str, dict[int, float]]:
    """Each recipe's losses in its uninterrupted run (waited for)."""
    losses: dict[str, dict[int, float]] = {}
    for recipe, (run, folder) in runs.items():
        code = run.wait(timeout=600)
        out, err = (folder / "out").read_text(errors="replace"), (folder / "err").read_text(errors="replace")
        assert code == 0, f"{recipe}: {out[-2000:]}{err[-2000:]}"
        events = [json.loads(line) for line in out.splitlines() if line.startswith('{"')]  # not HF's dicts
        losses[recipe] = step_losses(events)
        assert sorted(losses[recipe]) == list(range(1, STEPS + 1)), recipe
    return losses


def spec(recipe: str) -> dict[str, Any]:
    """dp=2 on one-rank pods, elastic down to 1; attempts 0-3 hold at HOLD (a committed step
    behind it in attempt 0), each until the test's fault or resize."""
    return {
        # --fork: each attempt's workers forked from the pod's forker (torch imported once); the
        # uninterrupted reference above starts them as new interpreters, so the losses compared
        # below show forked workers train the same
        "command": ["python", "-m", "topotrain_sdk.launch", "--fork", "--", "python", str(RECIPE[recipe])],
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2, "minData": 1},
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": INTERVAL, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 5},
        "training": {"holdAtStep": HOLD, "holdAttempts": HELD_ATTEMPTS},
    }


def by_attempt(stack: Stack, name: str) -> dict[int, list[dict[str, Any]]]:
    """The trainer's log events per attempt; a pod kept by an in-place restart logs several
    attempts in its one file (its launcher's `workers_started` line starts each)."""
    assert stack.harness is not None
    return events_by_attempt(stack.harness.job_logs(stack.namespace, name))


def held(stack: Stack, name: str, attempt: int) -> bool:
    """Attempt `attempt` holds with a commit of its own behind it."""
    events = by_attempt(stack, name).get(attempt, [])
    return bool(of_kind(events, "held")) and bool(of_kind(events, "checkpoint_committed"))


def holds(stack: Stack, name: str, attempt: int) -> bool:
    """Attempt `attempt` holds (`held`: with a commit of its own behind it)."""
    return bool(of_kind(by_attempt(stack, name).get(attempt, []), "held"))


def restored(stack: Stack, name: str, attempt: int) -> int:
    """The step attempt `attempt` restored (waits for its `restored` line)."""
    wait_until(lambda: bool(of_kind(by_attempt(stack, name).get(attempt, []), "restored")),
               timeout=JOB_TIMEOUT, what=f"attempt {attempt} restored")  # fmt: skip
    return int(of_kind(by_attempt(stack, name)[attempt], "restored")[0]["step"])


def restarted_in_place(stack: Stack, name: str, attempt: int, sig: signal.Signals) -> dict[str, Any]:
    """Signal pod 1's worker while attempt `attempt` holds with a commit of its own behind it;
    the gang restarts in place with every pod kept (same UIDs). The job's status then."""
    wait_until(partial(held, stack, name, attempt), timeout=JOB_TIMEOUT, what=f"attempt {attempt} held")
    before = live_uids(stack, name)
    if sig == signal.SIGSTOP:  # hang detection on, now that no hold of a resize is ahead
        _hang_timeout(stack, name, HANG_TIMEOUT)
    assert faults.signal_trainer(pod_pid(stack, name, 1), sig), "no worker found"
    if sig == signal.SIGSTOP:  # pod 0 goes on into a collective with pod 1 that never completes
        stack.release_hold(name, attempt)
    job = stack.wait_job(name, partial(first_step_after, attempt=attempt), timeout=JOB_TIMEOUT,
                         what=f"the first step after attempt {attempt}'s fault")  # fmt: skip
    assert job["status"]["recovery"]["mode"] == "inPlace"
    assert live_uids(stack, name) == before, "a pod was replaced"
    if sig == signal.SIGSTOP:  # off again: a 30 s clock would also run through a step or a save
        _hang_timeout(stack, name, 0)  # slowed by a loaded CI machine (once 3 restarts, not 2)
    return dict(job["status"])


def _hang_timeout(stack: Stack, name: str, seconds: int) -> None:
    stack.kubectl("-n", stack.namespace, "patch", f"trainingjobs.topotrain.io/{name}", "--type=merge",
                  "-p", json.dumps({"spec": {"failurePolicy": {"progressTimeoutSeconds": seconds}}}))


def scaled(stack: Stack, name: str, attempt: int, data: int) -> None:
    """`kubectl scale` to `data` while attempt `attempt` holds: the operator asks the gang for a
    checkpoint first, and the next attempt restores exactly that step; no restart counted."""
    wait_until(partial(holds, stack, name, attempt), timeout=JOB_TIMEOUT, what=f"attempt {attempt} held")
    restarts = int(stack.job(name)["status"].get("restarts", 0))
    stack.kubectl("-n", stack.namespace, "scale", f"trainingjobs.topotrain.io/{name}",
                  f"--replicas={data}")  # fmt: skip
    job = stack.wait_job(name, lambda j: (j["status"].get("parallelism") or {}).get("data") == data
                         and int(j["status"]["attempt"]) > attempt, timeout=JOB_TIMEOUT,
                         what=f"data={data}")  # fmt: skip
    request = job["status"]["checkpointRequest"]
    assert request["state"] == "Committed" and request["attempt"] == attempt, request
    assert int(job["status"]["restarts"]) == restarts, "a resize is not a failure"
    assert restored(stack, name, int(job["status"]["attempt"])) == request["step"]


def through_every_fault(stack: Stack, recipe: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The recipe's job through the kill, the two resizes and the hang, to Succeeded: its final
    object and its trainer's log events."""
    name = f"byo-{recipe}"
    stack.apply_job(name, spec(recipe))

    status = restarted_in_place(stack, name, 0, signal.SIGKILL)  # a killed worker
    assert status["lastFailure"]["reason"] == "PodFailed" and int(status["restarts"]) == 1
    assert restored(stack, name, 1) == HOLD // INTERVAL * INTERVAL  # held at 6, committed 4

    scaled(stack, name, 1, 1)
    scaled(stack, name, 2, 2)  # attempt 3 restores the request's step 7, trains 8, commits it

    status = restarted_in_place(stack, name, 3, signal.SIGSTOP)  # a hung worker
    assert status["lastFailure"]["reason"] == "ProgressStalled" and int(status["restarts"]) == 2
    assert restored(stack, name, 4) == 2 * INTERVAL

    done = stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded")
    assert [c.step for c in checkpoint_store(stack, name).list_committed()][-1] == STEPS
    return done, stack.events(name)


def test_both_recipes_recover_from_a_kill_a_resize_and_a_hang_with_uninterrupted_losses(
    stack: Stack, tmp_path: Path
) -> None:
    """Both recipes' jobs at once, beside their uninterrupted runs (CI's time: issue 31)."""
    runs = {recipe: (_launch(recipe, tmp_path / recipe), tmp_path / recipe) for recipe in RECIPE}
    try:
        with ThreadPoolExecutor(len(RECIPE)) as pool:
            jobs = {recipe: pool.submit(through_every_fault, stack, recipe) for recipe in RECIPE}
            finished = {recipe: job.result() for recipe, job in jobs.items()}
        reference = uninterrupted(runs)
    finally:
        for run, _ in runs.values():
            if run.poll() is None:
                run.kill()
    for recipe, (done, events) in finished.items():
        assert int(done["status"]["restarts"]) == 2, (  # the kill and the hang, no resize
            recipe, done["status"].get("lastFailure"),
            [line for line in stack.operator_log(100_000).splitlines() if f"byo-{recipe}" in line][-40:])
        assert done["status"]["parallelism"]["data"] == 2, recipe
        assert sorted(step_losses(events)) == list(range(1, STEPS + 1)), recipe
        for e in of_kind(events, "step"):  # every step trained, in every attempt, at either degree
            assert math.isclose(float(e["loss"]), reference[recipe][int(e["step"])], abs_tol=LOSS_ATOL), (recipe, e)
        started = of_kind(events, "workers_started")  # each pod's launcher, each attempt: forked (--fork)
        assert started and all(e["forked"] == e["workers"] for e in started), (
            recipe, [(e["attempt"], e["workers"], e["forked"], e["warm"]) for e in started],
            [e for e in events if e.get("event") in ("fork_failed", "workers_failed")])
        # What the operator shows of the trainer's cooperation, and the contract version it reported.
        assert done["status"]["trainer"] == {"heartbeat": True, "commits": True, "checkpointRequests": "Honoured",
                                             "contractVersion": CONTRACT_VERSION}, recipe  # fmt: skip
        cooperation = next(c for c in done["status"]["conditions"] if c["type"] == "TrainerCooperation")
        assert cooperation["status"] == "True", (recipe, cooperation)
