"""End to end, elastic: a node is lost with no spare capacity, the job shrinks
its data degree and continues with the same global batch and sample order;
capacity returns and it grows back.

The job gets a GPU pool of its own: two 1-GPU KWOK nodes, so losing one
leaves no room for data=2. Its losses at every degree are held to the
uninterrupted run of test_training (same model, seed, global batch and
schedule: the trainer reproduces a single-process run at any mesh within its
tolerance). Trainer processes run through the pod process harness.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from testbed import faults
from testbed.harness_stack import Stack
from testbed.kube import Kube
from testbed.nodes import add_node, delete_node, wait_nodes_ready
from testbed.procs import wait_until
from tests.e2e.jobs import (
    JOB_TIMEOUT,
    STEPS,
    TRAINING,
    assert_losses_match,
    attempts,
    held,
    holding,
    last_step,
    of_kind,
    phase_is,
)

INTERVAL = 4


@pytest.fixture
def pool(kube: Kube) -> Iterator[tuple[str, list[str]]]:
    """A GPU product of this test's own on two 1-GPU nodes in one rack."""
    suffix = uuid.uuid4().hex[:6]
    product = f"E2E-ELASTIC-{suffix}"
    names = [f"elastic-{suffix}-{i}" for i in range(2)]
    for name in names:
        add_node(
            kube.kubeconfig,
            name,
            product=product,
            gpus=1,
            block=f"elastic-{suffix}",
            rack=f"elastic-{suffix}-r0",
        )
    wait_nodes_ready(kube.kubeconfig, names, timeout=60)
    yield product, names
    for name in names:
        delete_node(kube.kubeconfig, name)


def _data(job: dict[str, Any]) -> int | None:
    par = job.get("status", {}).get("parallelism") or {}
    return par.get("data")


def test_shrinks_without_spare_capacity_and_grows_back(
    kube: Kube, stack: Stack, pool: tuple[str, list[str]], reference: dict[str, Any]
) -> None:
    product, _ = pool
    spec = {
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2, "minData": 1},
        "worker": {"gpusPerPod": 1, "gpuTypes": [product]},
        "checkpoint": {"intervalSteps": INTERVAL, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 5},
        # every attempt holds two steps past a commit until the test releases it: capacity is
        # lost, and returns, while the job certainly still trains
        "training": holding(TRAINING, attempts=STEPS),
    }
    stack.apply_job("elastic", spec)
    wait_until(lambda: held(stack, "elastic"), timeout=JOB_TIMEOUT, what="a committed checkpoint at data=2")
    lost = next(
        p["spec"]["nodeName"]
        for p in stack.pods("elastic")
        if p["metadata"]["labels"]["topotrain.io/index"] == "1"
    )
    faults.node_not_ready(kube.kubeconfig, lost)
    try:
        shrunk = stack.wait_job(
            "elastic", lambda j: _data(j) == 1, timeout=JOB_TIMEOUT, what="data=1"
        )
        attempt = int(shrunk["status"]["attempt"])
        # The shrunk gang trains up to the hold: capacity returns mid-run.
        wait_until(
            lambda: last_step(attempts(stack, "elastic").get(attempt, [])) > 0
            and bool(of_kind(attempts(stack, "elastic").get(attempt, []), "held")),
            timeout=JOB_TIMEOUT,
            what="a step at data=1",
        )
    finally:
        faults.node_ready(kube.kubeconfig, lost)
    grown = stack.wait_job(
        "elastic", lambda j: _data(j) == 2 and int(j["status"]["attempt"]) > attempt,
        timeout=JOB_TIMEOUT, what="grown back to data=2",
    )  # fmt: skip
    # The shrink is a restart after a failure; growing back is a resize, not a restart.
    assert grown["status"]["restarts"] >= 1 and int(grown["status"]["attempt"]) >= 2
    wait_until(lambda: bool(of_kind(attempts(stack, "elastic").get(int(grown["status"]["attempt"]), []), "restored")),
               timeout=JOB_TIMEOUT, what="the grown gang restored")  # fmt: skip
    stack.release_hold("elastic")
    job = stack.wait_job("elastic", phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded")

    by_attempt = attempts(stack, "elastic")
    restored = [e for a in sorted(by_attempt) for e in of_kind(by_attempt[a], "restored")]
    assert [e["mesh"]["data"] for e in restored][:1] == [1] and restored[-1]["mesh"]["data"] == 2
    for e in restored:
        assert e["consumed_samples"] == e["step"] * TRAINING["globalBatch"], (
            "same global batch, same sample counter"
        )
    # Every step at every data degree has the uninterrupted run's loss: same batch, same sample order.
    everything = [e for a in sorted(by_attempt) for e in by_attempt[a]]
    assert sorted({int(e["step"]) for e in of_kind(everything, "step")}) == list(
        range(1, STEPS + 1)
    )
    assert_losses_match(everything, reference["losses"])
    assert job["status"]["parallelism"]["data"] == 2
