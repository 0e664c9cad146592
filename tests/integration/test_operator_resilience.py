"""Resilience on the testbed: operator killed mid-reconcile, hangs, unsatisfiable specs."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from operator_support import Cluster, cluster_fixture, wait_for

from testbed.faults import fail_pod
from testbed.kube import Kube
from testbed.s3 import S3Server

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    yield from cluster_fixture(kube, namespace, tmp_path)


@pytest.mark.parametrize("kill_when", ["status-written", "first-pod-created"])
def test_operator_killed_mid_recovery_neither_duplicates_pods_nor_loses_status(
    cluster: Cluster, kill_when: str
) -> None:
    cluster.add_nodes(racks=2, per_rack=2)
    cluster.apply(cluster.manifest("llm", tensor=8, pipeline=2, data=2, gpus_per_pod=4))
    gang = wait_for("attempt 0 Running", lambda: cluster.running_gang("llm", 0, 8))
    fail_pod(cluster.kube.kubeconfig, cluster.namespace, gang[5].metadata.name, exit_code=1)
    if kill_when == "status-written":
        wait_for("restart recorded", lambda: cluster.status("llm").get("attempt") == 1, 60)
    else:
        wait_for("a pod of attempt 1", lambda: any(
            p.metadata.labels["topotrain.io/attempt"] == "1" for p in cluster.pods("llm")), 60)
    cluster.operator.kill()
    cluster.operator.start()

    wait_for("attempt 1 Running", lambda: cluster.running_gang("llm", 1, 8), 120)
    status = cluster.wait_phase("llm", "Running")
    # The crashed pod of attempt 0 is kept for its logs until attempt 1 is Running; the operator
    # writes the Running status first and deletes it right after, so the test waits for that.
    expected = [f"llm-1-{i}" for i in range(8)]
    wait_for("only attempt 1's pods left", lambda: sorted(
        p.metadata.name for p in cluster.pods("llm") if p.metadata.deletion_timestamp is None
    ) == expected, 60)
    assert status["restarts"] == 1 and status["attempt"] == 1
    assert status["lastFailure"]["pod"] == gang[5].metadata.name


def test_stale_progress_restarts_the_gang(cluster: Cluster, s3: S3Server, s3_bucket: str) -> None:
    cluster.add_nodes(racks=1, per_rack=2)
    cluster.create_secret(s3)
    store = cluster.store(s3, s3_bucket, "llm")
    store.write_progress(40, 0, datetime.now(UTC) - timedelta(hours=1))  # the trainer went quiet
    cluster.apply(cluster.manifest("llm", pipeline=1, bucket=s3_bucket, s3=s3,
                                   failurePolicy={"progressTimeoutSeconds": 5}))
    # Attempt 0 is Running for only about progressTimeoutSeconds: a loaded machine may poll
    # too late to see it, so the restart itself is what the test waits for.
    status = wait_for("restart for the hang", lambda: (s := cluster.status("llm")).get("lastFailure") and s)
    assert status["lastFailure"]["reason"] == "ProgressStalled"
    wait_for("attempt 1 exists", lambda: cluster.status("llm").get("attempt", 0) >= 1)
    progressing = cluster.condition("llm", "Progressing")
    assert progressing is None or progressing["reason"] in ("ProgressStalled", "ProgressReported")


def test_unsatisfiable_specs_get_conditions_and_other_jobs_keep_running(
    cluster: Cluster, s3: S3Server, s3_bucket: str
) -> None:
    cluster.add_nodes(racks=1, per_rack=2)
    ghost = cluster.manifest("ghost", pipeline=1, data=1, worker={"gpuTypes": ["B300-288GB"]})
    cluster.apply(ghost)
    nosecret = cluster.manifest("nosecret", pipeline=1, data=1, bucket=s3_bucket, s3=s3)
    nosecret["spec"]["checkpoint"]["credentialsSecret"] = "does-not-exist"
    cluster.apply(nosecret)
    cluster.apply(cluster.manifest("ok", pipeline=1, data=1))

    cluster.wait_phase("ok", "Running")
    unknown = wait_for("ghost condition", lambda: cluster.condition("ghost", "Schedulable"))
    assert unknown["status"] == "False" and unknown["reason"] == "UnknownGPUType"
    assert "B300-288GB" in unknown["message"]
    secret = wait_for("nosecret condition", lambda: cluster.condition("nosecret", "ConfigValid"))
    assert secret["status"] == "False" and secret["reason"] == "CheckpointSecretNotFound"
    assert "does-not-exist" in secret["message"]
    assert not cluster.pods("ghost") and not cluster.pods("nosecret")
    assert cluster.status("ok")["phase"] == "Running"
