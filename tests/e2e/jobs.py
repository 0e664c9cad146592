"""TrainingJob specs and checks shared by the end-to-end tests."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from testbed.harness_proc import json_lines
from testbed.harness_stack import Stack

# The trainer states (tests/trainer, docs/trainer.md) that any mesh, resumed
# or resharded, matches a single-process run within 1e-5 absolute on CPU;
# two such runs compared with each other: twice that.
LOSS_ATOL = 2e-5
STEPS = 12
INTERVAL = 4
JOB_TIMEOUT = 900.0

TRAINING: dict[str, Any] = {
    "model": "tiny", "steps": STEPS, "globalBatch": 8, "microBatch": 2,
    "progressEvery": 1, "metricsPort": 0,
}  # fmt: skip


def spec_3d(**failure_policy: Any) -> dict[str, Any]:
    """tp=2, pp=2, dp=2 on 2-GPU pods: 4 pods of 2 ranks, 8 ranks in all."""
    return {
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 2},
        "worker": {"gpusPerPod": 2, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": INTERVAL, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 5, **failure_policy},
        "training": TRAINING,
    }


def phase_is(phase: str) -> Callable[[dict[str, Any]], bool]:
    return lambda job: job.get("status", {}).get("phase") == phase


def attempts(stack: Stack, job: str) -> dict[int, list[dict[str, Any]]]:
    """The trainer's JSON log lines per attempt (global rank 0 writes them)."""
    assert stack.harness is not None
    out: dict[int, list[dict[str, Any]]] = {}
    for path in stack.harness.job_logs(stack.namespace, job):
        out.setdefault(int(path.name[1:].split("-", 1)[0]), []).extend(json_lines([path]))
    return out


def of_kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


def last_step(events: list[dict[str, Any]]) -> int:
    return max((int(e["step"]) for e in of_kind(events, "step")), default=0)


def assert_losses_match(events: list[dict[str, Any]], reference: dict[int, float]) -> None:
    """Every step logged (in any attempt, at any degree) has the reference run's loss."""
    for e in of_kind(events, "step"):
        step, loss = int(e["step"]), float(e["loss"])
        assert math.isclose(loss, reference[step], rel_tol=0.0, abs_tol=LOSS_ATOL), (
            f"step {step}: {loss} != {reference[step]}"
        )
