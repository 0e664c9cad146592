"""TrainingJob specs and checks shared by the end-to-end tests."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

from testbed.harness_proc import events_by_attempt
from testbed.harness_stack import Stack
from tests.datasets import dataset_uri

# The trainer states (tests/trainer, docs/trainer.md) that any mesh, resumed
# or resharded, matches a single-process run within 1e-5 absolute on CPU;
# two such runs compared with each other: twice that.
LOSS_ATOL = 2e-5
STEPS = 12
INTERVAL = 4
JOB_TIMEOUT = 900.0

# The session's bucket (conftest.s3_target creates it), named here so that every job's training
# can name the dataset the session fixture writes into it (tests/datasets.py): each job trains
# from tokenized shards in S3.
BUCKET = f"e2e-{uuid.uuid4().hex[:10]}"
TRAINING: dict[str, Any] = {
    "model": "tiny", "steps": STEPS, "globalBatch": 8, "microBatch": 2,
    "progressEvery": 1, "metricsPort": 0, "dataset": dataset_uri(BUCKET),
}  # fmt: skip
# A fault or a resize needs a job that is still training when it lands. No test sizes a job's
# length to win that race: the job holds (training.holdAtStep, a test aid, docs/trainer.md) at
# HOLD, a committed checkpoint (INTERVAL) and two steps behind it, in its first `attempts`
# attempts, until the test's fault or resize stops it or the test releases it
# (Stack.release_hold); the attempts after that train to the end.
HOLD = INTERVAL + 2


def holding(training: dict[str, Any], *, at: int = HOLD, attempts: int = 1) -> dict[str, Any]:
    """`training` with the hold of the first `attempts` attempts at step `at`."""
    return {**training, "holdAtStep": at, "holdAttempts": attempts}


def spec_3d(*, hold: bool = False, **failure_policy: Any) -> dict[str, Any]:
    """tp=2, pp=2, dp=2 on 2-GPU pods: 4 pods of 2 ranks, 8 ranks in all; `hold`: the first
    attempt holds at HOLD."""
    return {
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 2},
        "worker": {"gpusPerPod": 2, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": INTERVAL, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 5, **failure_policy},
        "training": holding(TRAINING) if hold else TRAINING,
    }


def spec_dp2(*, hold: bool = False, **failure_policy: Any) -> dict[str, Any]:
    """dp=2 on 1-GPU pods: 2 pods of 1 rank, the gang of the tests about the operator's handling
    of a fault (the trainer's 3D meshes are held to the reference by tests/trainer, the 3D
    reference run below and the kind suite; a quarter of the processes keeps CI inside its
    budget). Same training as the 3D run, so the same losses within LOSS_ATOL."""
    return {
        **spec_3d(hold=hold, **failure_policy),
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2},
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"]},
    }


def phase_is(phase: str) -> Callable[[dict[str, Any]], bool]:
    return lambda job: job.get("status", {}).get("phase") == phase


def attempts(stack: Stack, job: str) -> dict[int, list[dict[str, Any]]]:
    """The trainer's JSON events per attempt (global rank 0 writes them). A pod kept across an
    in-place restart logs several attempts in its one file: its supervisor's `workers_started`
    names the attempt of the lines after it (by file name alone, they all counted as the first)."""
    assert stack.harness is not None
    return events_by_attempt(stack.harness.job_logs(stack.namespace, job))


def of_kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


def held(stack: Stack, job: str, attempt: int = 0) -> bool:
    """Attempt `attempt` holds (training.holdAtStep) with a committed checkpoint behind it."""
    events = attempts(stack, job).get(attempt, [])
    return bool(of_kind(events, "held")) and bool(of_kind(events, "checkpoint_committed"))


def last_step(events: list[dict[str, Any]]) -> int:
    return max((int(e["step"]) for e in of_kind(events, "step")), default=0)


def assert_losses_match(events: list[dict[str, Any]], reference: dict[int, float]) -> None:
    """Every step logged (in any attempt, at any degree) has the reference run's loss."""
    for e in of_kind(events, "step"):
        step, loss = int(e["step"]), float(e["loss"])
        assert math.isclose(loss, reference[step], rel_tol=0.0, abs_tol=LOSS_ATOL), (
            f"step {step}: {loss} != {reference[step]}"
        )


def table_row(table: str) -> dict[str, str]:
    """The first row of `kubectl get` output by column: each value sliced at its header's offsets
    (an empty column, such as ETA before a rate is known, leaves no token to split on)."""
    header, row = table.splitlines()[:2]
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
    ends = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}

