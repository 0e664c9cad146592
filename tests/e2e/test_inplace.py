"""End to end: a trainer crash and a trainer hang are restarted in place.

The real operator and trainer (gloo on CPU); the pod process harness runs the
pods' commands as local processes (it stands in for a kubelet's process
execution and writes the pods' downwardAPI control files). The fault is a
signal to one pod's trainer ranks only (`testbed.faults.signal_trainer`): the
pod and its supervisor stay up, as when a rank segfaults or deadlocks.
"""

from __future__ import annotations

import signal
from typing import Any

from topotrain_trainer.supervisor import SPARE_DELAY_ENV

from testbed import faults
from testbed.harness_stack import Stack, step_losses
from testbed.procs import wait_until
from testbed.restart_probes import first_step_after, live_uids, pod_pid
from tests.e2e.jobs import (
    INTERVAL,
    JOB_TIMEOUT,
    STEPS,
    TRAINING,
    assert_losses_match,
    held,
    holding,
    of_kind,
    phase_is,
    spec_dp2,
    table_row,
)


def crash_pod_one(stack: Stack, name: str, spares: int = 0) -> tuple[dict[str, str], str, dict[str, Any]]:
    """Once a checkpoint is committed and the first attempt holds two steps later (and, with
    `spares`, that many pods' supervisors have started their warm spares), SIGKILL the trainer
    ranks of the pod of index 1 and wait for the restart's first step: (pod UIDs before, the
    victim's name, the job's status then)."""
    wait_until(
        lambda: held(stack, name) and len(of_kind(stack.events(name), "spares_started")) >= spares,
        timeout=JOB_TIMEOUT, what="a committed checkpoint and two steps more",
    )  # fmt: skip
    before = live_uids(stack, name)
    victim = next(n for n in before if n.endswith("-1"))
    assert faults.signal_trainer(pod_pid(stack, name, 1), signal.SIGKILL), "no trainer ranks found"
    job = stack.wait_job(name, first_step_after, timeout=JOB_TIMEOUT, what="the first step after the crash")
    return before, victim, job["status"]


def test_killed_trainer_is_restarted_by_a_new_gang_with_the_uninterrupted_losses(
    stack: Stack, reference: dict[str, Any]
) -> None:
    """restartInPlace off: the whole gang is recreated. (The in-place restart of a killed trainer,
    the healthy pods kept, is shown on real kubelets by tests/kind/test_02_failures.py and with warm
    spares below.)"""
    name = "crash"
    stack.apply_job(name, spec_dp2(hold=True, restartInPlace=False))
    before, victim, status = crash_pod_one(stack, name)
    assert status["lastFailure"]["reason"] == "PodFailed" and status["lastFailure"]["pod"] == victim
    after = live_uids(stack, name)
    # (a CRD without restartInPlace would prune it and restart in place all the same)
    assert status["recovery"].get("mode") != "inPlace"
    assert not set(before.values()) & set(after.values()) - {before[victim]}, "a pod was kept"
    # `kubectl get tj` shows the restart and the recovery time: the time to the new attempt's first
    # step, which includes the pods starting and the trainer's import, rendezvous and checkpoint
    # load, each reported as a phase.
    row = table_row(stack.kubectl("get", "tj", name, "-n", stack.namespace).stdout)
    recovery = status["recovery"]
    assert int(row["RESTARTS"]) >= 1
    assert float(row["RECOVERY"]) == recovery["timeToFirstStepSeconds"] > recovery["lastSeconds"] > 0
    assert recovery["phases"]["podsRunning"] == recovery["lastSeconds"]
    assert recovery["phases"]["checkpointLoad"] > 0
    assert recovery["resumeStep"] >= INTERVAL and recovery["resumeStep"] % INTERVAL == 0

    stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the crash")
    events = stack.events(name)
    assert sorted(step_losses(events)) == list(range(1, STEPS + 1))
    assert_losses_match(events, reference["losses"])


def test_a_crash_reported_by_a_supervisor_with_warm_spares_keeps_every_pod(stack: Stack) -> None:
    """training.warmSpares: the crashed pod's supervisor writes failure.json and stays up; the
    operator restarts the gang in place with every pod kept, and every rank of the next attempt
    is a warm spare (no interpreter starts cold)."""
    name = "spares"
    spec = {
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2},
        # (spares at once rather than 30 s after the start: the crash waits for them)
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"],
                   "env": [{"name": SPARE_DELAY_ENV, "value": "0"}]},
        "checkpoint": {"intervalSteps": INTERVAL, "keep": 2},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 3},
        "training": holding({**TRAINING, "warmSpares": True}),
    }
    stack.apply_job(name, spec)
    # Spares start `SPARE_DELAY_ENV` seconds after a group, or at once when a supervisor sees its
    # ranks fail; a crash before that can restart the healthy pod before it has noticed the lost
    # peer, and that pod's ranks then start cold (seen in CI). Crash once both pods hold spares.
    before, victim, status = crash_pod_one(stack, name, spares=2)
    failure = status["lastFailure"]
    assert failure["reason"] == "PodFailed" and failure["pod"] == victim, failure
    assert "reported by its supervisor" in failure["message"], failure
    assert status["recovery"]["mode"] == "inPlace" and live_uids(stack, name) == before, "a pod was replaced"
    assert of_kind(stack.events(name), "failure_reported"), "the crashed pod's supervisor reported it"
    restarted = [e for e in of_kind(stack.events(name), "workers_started") if e["attempt"] == status["attempt"]]
    assert len(restarted) == 2 and all(e["warm"] == 1 for e in restarted), restarted
    stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the crash")
    assert sorted(step_losses(stack.events(name))) == list(range(1, STEPS + 1))


def test_a_hung_trainer_is_restarted_in_place(stack: Stack) -> None:
    name = "hang"
    # The first attempt holds at HOLD so that the freeze lands mid-training; the crash test above
    # holds the losses.
    spec = {
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2},
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": INTERVAL, "keep": 2},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 3, "progressTimeoutSeconds": 30},
        "training": holding(TRAINING),
    }
    stack.apply_job(name, spec)
    wait_until(lambda: held(stack, name), timeout=JOB_TIMEOUT, what="training under way")
    before = live_uids(stack, name)
    assert faults.signal_trainer(pod_pid(stack, name, 1), signal.SIGSTOP), "no trainer ranks found"
    # Released at once: from now on only the stopped ranks keep the gang from training (a gang
    # with none stopped would go on to Succeed, and the wait below would fail).
    stack.release_hold(name)
    stalled = stack.wait_job(
        name, lambda j: (j["status"].get("lastFailure") or {}).get("reason") == "ProgressStalled",
        timeout=JOB_TIMEOUT, what="the hang detected",
    )  # fmt: skip
    assert (stalled["status"].get("recovery") or {}).get("mode") == "inPlace", stalled["status"]
    assert live_uids(stack, name) == before, "no pod is deleted or created for a hang"
    stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the hang")
    assert sorted(step_losses(stack.events(name))) == list(range(1, STEPS + 1))
