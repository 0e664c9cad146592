"""End to end: a restart after a spec roll never resumes from the replaced gang's later steps
(issue 37 item 6).

The real operator and trainer (gloo on CPU); the pod process harness runs the pods'
commands as local processes (it stands in for a kubelet's process execution and writes
the pods' downwardAPI control files). The crash is a SIGKILL of one pod's trainer ranks
(`testbed.faults.signal_trainer`).

The replaced gang commits a step after the one the roll restored, for certain: with
checkpoint-on-demand off (`operator.checkpointRequestTimeoutSeconds: 0`) the roll onto the
new `training.lr` restores the last commit, step INTERVAL, while the old gang, held at HOLD
(`training.holdAtStep`, a test aid), saves step HOLD on its SIGTERM, trained with the old lr:
the late commit a trainer that trains on after a planned stop's checkpoint makes (the bundled
trainer no longer does: tests/trainer/test_trainer.py). The new gang holds at HOLD too,
committing nothing, and is crashed there, before its first own commit. Before the fix the
restart resumed from the old gang's step HOLD.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
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
from testbed.procs import wait_until
from testbed.restart_probes import first_step_after, pod_pid
from tests.e2e.jobs import (
    HOLD,
    INTERVAL,
    JOB_TIMEOUT,
    STEPS,
    TRAINING,
    attempts,
    held,
    holding,
    of_kind,
    phase_is,
    spec_dp2,
)


@pytest.fixture
def stack(kube: Any, s3_target: S3Target, tmp_path: Path) -> Iterator[Stack]:
    # no checkpoint request before a roll; a grace period long enough for the SIGTERM save
    with stack_in_new_namespace(kube, s3_target, tmp_path, "floor", checkpointRequestTimeoutSeconds=0,
                                podGraceSeconds=30) as made:  # fmt: skip
        yield made


def test_a_crash_after_an_lr_edit_resumes_from_the_rolls_step_not_the_old_gangs(stack: Stack) -> None:
    name = "floor"
    spec = spec_dp2()
    spec["training"] = holding(TRAINING, attempts=2)  # the old gang and the new one hold at HOLD
    stack.apply_job(name, spec)
    wait_until(lambda: held(stack, name), timeout=JOB_TIMEOUT, what=f"attempt 0 held at {HOLD}")
    # The roll restores the newest commit the operator has read from the store (no checkpoint
    # request here): wait until it read step INTERVAL, which the trainer's log shows first (a
    # loaded machine patched before the operator's next poll, and the roll started fresh).
    stack.wait_job(name, lambda j: int((j["status"].get("checkpoint") or {}).get("step") or 0) >= INTERVAL,
                   timeout=JOB_TIMEOUT, what=f"the operator read the commit of step {INTERVAL}")  # fmt: skip

    stack.kubectl("-n", stack.namespace, "patch", f"trainingjobs.topotrain.io/{name}", "--type=merge",
                  "-p", json.dumps({"spec": {"training": {"lr": 2e-3}}}))  # fmt: skip
    job = stack.wait_job(name, lambda j: (j["status"].get("plannedRestore") or {}).get("attempt") == 1,
                         timeout=JOB_TIMEOUT, what="the roll onto the new lr")  # fmt: skip
    assert job["status"]["plannedRestore"] == {"reason": "rollout", "attempt": 1, "step": INTERVAL}
    store = checkpoint_store(stack, name)
    wait_until(lambda: (c := store.read_commit(HOLD)) is not None and c.attempt == 0, timeout=JOB_TIMEOUT,
               what=f"the old gang's SIGTERM save of step {HOLD}")  # fmt: skip
    wait_until(lambda: bool(of_kind(attempts(stack, name).get(1, []), "held")), timeout=JOB_TIMEOUT,
               what=f"attempt 1 restored at {INTERVAL} and held at {HOLD}")  # fmt: skip
    newest = store.latest_committed()
    assert newest is not None and (newest.step, newest.attempt) == (HOLD, 0), "the new gang committed"

    assert faults.signal_trainer(pod_pid(stack, name, 1), signal.SIGKILL), "no trainer ranks found"
    job = stack.wait_job(name, lambda j: first_step_after(j, attempt=1), timeout=JOB_TIMEOUT,
                         what="the first step after the crash")  # fmt: skip
    status = job["status"]
    recovery = status["recovery"]
    assert recovery["resumeStep"] == INTERVAL, recovery
    assert (f"step {HOLD}, committed by attempt 0 after the rollout to attempt 1 restored step "
            f"{INTERVAL}") in recovery["resumeReason"], recovery  # fmt: skip
    # (a pod kept by an in-place restart logs its next attempts into the file of the attempt
    # that created it: the trainer's own events are read across the job's logs)
    wait_until(lambda: len(of_kind(stack.events(name), "restored")) >= 2, timeout=JOB_TIMEOUT,
               what="the restart's restore")  # fmt: skip
    stack.wait_job(name, phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded after the crash")
    events = stack.events(name)
    restored = [int(e["step"]) for e in of_kind(events, "restored")]
    assert restored == [INTERVAL, INTERVAL], f"the new gang and its restart restored {restored}"
    assert sorted(step_losses(events)) == list(range(1, STEPS + 1))
    assert max(int(e["step"]) for e in of_kind(events, "step")) == STEPS
