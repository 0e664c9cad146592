"""Failures on the testbed: pod exit, node NotReady, restart limits, non-retryable exits.

No trainer runs on KWOK nodes: the tests seed committed (and uncommitted)
checkpoints in the S3 server through topotrain.checkpoints, as the trainer
would, and check which step the replacement gang is told to resume from.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_support import Cluster, cluster_fixture, wait_for

from testbed.faults import fail_pod, node_not_ready, node_ready
from testbed.kube import Kube
from testbed.s3 import S3Server

pytestmark = pytest.mark.integration
MESH = {"tensor": 8, "pipeline": 2, "data": 2}


@pytest.fixture
def cluster(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    yield from cluster_fixture(kube, namespace, tmp_path)


def env(pod: Any) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env if e.value is not None}


def test_pod_failure_restarts_gang_from_highest_committed_step(
    cluster: Cluster, s3: S3Server, s3_bucket: str
) -> None:
    cluster.add_nodes(racks=2, per_rack=2)
    cluster.create_secret(s3)
    store = cluster.store(s3, s3_bucket, "llm")
    store.write_commit(100, MESH, 10)  # seeded, so the job must opt in to resuming it
    cluster.apply(cluster.manifest("llm", bucket=s3_bucket, s3=s3, checkpoint={"resumePolicy": "Always"}))
    first = wait_for("attempt 0 Running", lambda: cluster.running_gang("llm", 0, 4))
    assert {env(p)["TOPOTRAIN_RESUME_STEP"] for p in first} == {"100"}

    store.write_commit(200, MESH, 10)  # the newest complete checkpoint
    store.client.put_object(Bucket=s3_bucket, Key=f"{store.step_key(300)}/__0_0.distcp", Body=b"partial")
    fail_pod(cluster.kube.kubeconfig, cluster.namespace, first[1].metadata.name, exit_code=1)

    second = wait_for("attempt 1 Running", lambda: cluster.running_gang("llm", 1, 4))
    assert {env(p)["TOPOTRAIN_ATTEMPT"] for p in second} == {"1"}
    assert {env(p)["TOPOTRAIN_RESUME_STEP"] for p in second} == {"200"}, "never an uncommitted step"
    status = cluster.wait_phase("llm", "Running")
    assert status["restarts"] == 1 and status["attempt"] == 1
    assert status["lastFailure"]["reason"] == "PodFailed" and status["lastFailure"]["exitCode"] == 1
    assert status["checkpoint"]["step"] == 200 and status["recovery"]["resumeStep"] == 200
    assert status["recovery"]["lastSeconds"] > 0
    wait_for("attempt 0 gone", lambda: all(
        p.metadata.labels["topotrain.io/attempt"] == "1" for p in cluster.pods("llm")))


def test_node_not_ready_replaces_its_pod_in_the_same_rack(cluster: Cluster) -> None:
    cluster.add_nodes(racks=2, per_rack=3)
    cluster.apply(cluster.manifest("llm"))
    before = {int(p.metadata.labels["topotrain.io/index"]): p.spec.node_name
              for p in wait_for("Running", lambda: cluster.running_gang("llm", 0, 4))}
    free = [n for n in cluster.nodes if n not in before.values()]
    rack_of = {n: n.rsplit("-n", 1)[0] for n in cluster.nodes}
    # a pod whose rack still has a free node (6 nodes, 4 pods: such a rack exists)
    lost_index, lost_node = next((i, n) for i, n in sorted(before.items())
                                 if any(rack_of[f] == rack_of[n] for f in free))
    rack = rack_of[lost_node]
    free_in_rack = [f for f in free if rack_of[f] == rack]
    node_not_ready(cluster.kube.kubeconfig, lost_node)
    try:
        after = {int(p.metadata.labels["topotrain.io/index"]): p.spec.node_name
                 for p in wait_for("attempt 1 Running", lambda: cluster.running_gang("llm", 1, 4), 180)}
    finally:
        node_ready(cluster.kube.kubeconfig, lost_node)
    assert after[lost_index] in free_in_rack, f"replacement left rack {rack}: {after[lost_index]}"
    assert {i: n for i, n in after.items() if i != lost_index} == {
        i: n for i, n in before.items() if i != lost_index}, "healthy pods should keep their nodes"
    status = cluster.status("llm")
    assert status["lastFailure"]["reason"] == "NodeNotReady" and status["lastFailure"]["node"] == lost_node
    assert status["placement"]["mode"] == "incremental"


def test_max_restarts_exhausted_fails_the_job(cluster: Cluster) -> None:
    cluster.add_nodes(racks=1, per_rack=2)
    cluster.apply(cluster.manifest("llm", pipeline=1, failurePolicy={"maxRestarts": 1}))
    gang = wait_for("attempt 0 Running", lambda: cluster.running_gang("llm", 0, 2))
    fail_pod(cluster.kube.kubeconfig, cluster.namespace, gang[0].metadata.name, exit_code=2)
    gang = wait_for("attempt 1 Running", lambda: cluster.running_gang("llm", 1, 2))
    fail_pod(cluster.kube.kubeconfig, cluster.namespace, gang[1].metadata.name, exit_code=2)
    status = cluster.wait_phase("llm", "Failed")
    failed = cluster.condition("llm", "Failed")
    assert failed is not None and failed["reason"] == "MaxRestartsExceeded"
    assert status["restarts"] == 1
    # The crashed pod stays for its logs (it holds no GPUs); the rest of the gang is deleted.
    wait_for("healthy pods deleted", lambda: [p.metadata.name for p in cluster.pods("llm")
                                              if p.metadata.deletion_timestamp is None] == [gang[1].metadata.name])
    assert "exit code 2" in status["lastFailure"]["message"]


def test_non_retryable_exit_code_fails_at_once(cluster: Cluster) -> None:
    cluster.add_nodes(racks=1, per_rack=2)
    cluster.apply(cluster.manifest("llm", pipeline=1))
    gang = wait_for("attempt 0 Running", lambda: cluster.running_gang("llm", 0, 2))
    fail_pod(cluster.kube.kubeconfig, cluster.namespace, gang[0].metadata.name, exit_code=78,
             reason="InvalidConfig")
    status = cluster.wait_phase("llm", "Failed")
    failed = cluster.condition("llm", "Failed")
    assert failed is not None and failed["reason"] == "NonRetryableExitCode"
    assert status["restarts"] == 0 and status["lastFailure"]["exitCode"] == 78
