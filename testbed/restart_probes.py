"""What the restart tests and `bench/recovery.py --first-step` look at and poke on a Stack.

The live pods' UIDs (a pod recreated gets a new one), the process of the pod
that the harness runs for an index (whose children are the trainer ranks,
`testbed.faults.signal_trainer`), the node of an index, and whether the job's
latest restart has trained its first step (`status.recovery`).
"""

from __future__ import annotations

from typing import Any

from testbed.harness_stack import Stack


def live_uids(stack: Stack, job: str) -> dict[str, str]:
    """Pod name -> UID of the job's pods that are not being deleted."""
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in stack.pods(job)
            if not p["metadata"].get("deletionTimestamp")}  # fmt: skip


def _live_pods(stack: Stack, job: str, index: int) -> list[dict[str, Any]]:
    return [p for p in stack.pods(job) if not p["metadata"].get("deletionTimestamp")
            and p["metadata"]["labels"].get("topotrain.io/index") == str(index)]  # fmt: skip


def pod_name(stack: Stack, job: str, index: int) -> str:
    """The live pod holding `index` (a kept pod keeps the name of the attempt that made it)."""
    pods = _live_pods(stack, job, index)
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    name: str = pods[0]["metadata"]["name"]
    return name


def node_of(stack: Stack, job: str, index: int) -> str:
    pods = _live_pods(stack, job, index)
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    node: str = pods[0]["spec"]["nodeName"]
    return node


def pod_pid(stack: Stack, job: str, index: int) -> int:
    """The pid of the process the harness runs for the live pod of `index` (its supervisor)."""
    assert stack.harness is not None
    name = pod_name(stack, job, index)
    runs = [r for r in stack.harness.running(stack.namespace, job) if r.name == name]
    assert len(runs) == 1, runs
    return runs[0].process.pid


def first_step_after(job: dict[str, Any], attempt: int = 0) -> bool:
    """A restart after `attempt` is Running and has trained its first step (time to first step known)."""
    status = job.get("status") or {}
    recovery = status.get("recovery") or {}
    return (status.get("attempt", 0) > attempt and status.get("phase") == "Running"
            and recovery.get("timeToFirstStepSeconds") is not None
            and recovery.get("awaitingAttempt") is None and not recovery.get("started"))  # fmt: skip
