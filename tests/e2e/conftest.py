"""Fixtures of the end-to-end suite.

Every test here runs the real stack: the Helm chart installed by helm, the
operator as a local process with the chart's ServiceAccount token, and the
trainer's real processes. KWOK nodes run no processes, so the pod process
harness (testbed.harness, a stand-in for a kubelet's process execution, not
a kubelet) runs the pods' commands locally. Every test in this folder is
marked `e2e`.

The checkpoint store is the session's S3 server (versitygw), or the one that
TOPOTRAIN_E2E_S3_ENDPOINT / _ACCESS_KEY / _SECRET_KEY name (MinIO on kind).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.harness import PodProcessHarness
from testbed.harness_stack import (
    S3Target,
    Stack,
    checkpoint_store,
    stack_in_new_namespace,
    step_losses,
)
from testbed.kube import Kube
from testbed.procs import wait_until
from tests.datasets import prepare
from tests.e2e.jobs import BUCKET, JOB_TIMEOUT, phase_is, spec_dp2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def harness(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[PodProcessHarness]:
    """The pod process harness alone, for this test's namespace (processes killed at teardown)."""
    logging.getLogger("topotrain.testbed.harness").setLevel(logging.INFO)
    with PodProcessHarness(kube.kubeconfig, tmp_path / "harness", namespace=namespace) as running:
        yield running


@pytest.fixture(scope="session")
def s3_target(request: pytest.FixtureRequest) -> S3Target:
    """The session's bucket for its jobs, on the external S3 store if one is named, with the
    tokenized dataset every job trains from (tests/datasets.py) written into it."""
    endpoint = os.environ.get("TOPOTRAIN_E2E_S3_ENDPOINT")
    if endpoint:
        target = S3Target(
            endpoint,
            os.environ["TOPOTRAIN_E2E_S3_ACCESS_KEY"],
            os.environ["TOPOTRAIN_E2E_S3_SECRET_KEY"],
            BUCKET,
        )
        target.client().create_bucket(Bucket=target.bucket)
    else:
        server = request.getfixturevalue("s3")
        target = S3Target(server.endpoint, server.access_key, server.secret_key, server.create_bucket(BUCKET))
    prepare(target.client(), target.bucket)
    return target


@pytest.fixture
def stack(
    kube: Kube, s3_target: S3Target, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    stem = request.node.name.replace("_", "-").lower()[5:25].strip("-")
    with stack_in_new_namespace(kube, s3_target, tmp_path, stem) as made:
        yield made


@pytest.fixture(scope="session")
def reference(
    kube: Kube, s3_target: S3Target, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """One uninterrupted run to completion: its final job, log events, losses, committed steps.

    Two one-rank pods (dp=2): the 3D mesh through the operator runs on real kubelets in the kind
    suite (tests/kind/test_01_training.py), and against the single-process reference in
    tests/trainer; here a quarter of the processes keeps CI inside its budget.

    The other tests hold their losses to this run's: same model, seed, global
    batch and schedule, so the same loss at every step whatever the mesh.
    """
    with stack_in_new_namespace(
        kube, s3_target, tmp_path_factory.mktemp("reference"), "e2e-ref"
    ) as stack:
        stack.apply_job("ref", spec_dp2())
        job = stack.wait_job("ref", phase_is("Succeeded"), timeout=JOB_TIMEOUT, what="Succeeded")
        wait_until(
            lambda: not stack.pods("ref"), timeout=120, what="the finished job's pods to be gone"
        )
        events = stack.events("ref")
        yield {
            "job": job,
            "events": events,
            "losses": step_losses(events),
            "committed": [c.step for c in checkpoint_store(stack, "ref").list_committed()],
            "stack": stack,
        }
