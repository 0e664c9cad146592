"""An elastic job's resizes in Kueue's accounting, against the real Kueue (v0.17, a testbed process
with ElasticJobsViaWorkloadSlices on): a job annotated kueue.x-k8s.io/elastic-job that is scaled
down gives the GPUs it no longer uses to a job Kueue kept waiting; scaled back up, it keeps its
smaller size until Kueue admits the slice for the larger one, then grows. KWOK pods, no trainer
(operator_support.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_support import TEST_NODES_LABEL, Cluster, cluster_fixture, wait_for
from topotrain.core.kueue import KUEUE_API_VERSION, topology_manifest
from topotrain.core.kueue_slices import slice_names
from topotrain.placement.topology import TopologyLevels

from testbed.kube import Kube
from testbed.kueue import QUEUE_LABEL, KueueStack
from testbed.topology import HOSTNAME_LABEL

pytestmark = [pytest.mark.integration, pytest.mark.kueue]

QUOTA = 4  # GPUs: the elastic job at 4 replicas, or 2 replicas and the other job's 2
FIRST, SECOND = slice_names("elastic")


@pytest.fixture
def cluster(kueue: KueueStack, kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    yield from cluster_fixture(kube, namespace, tmp_path)  # Kueue first: the operator watches Workloads


@pytest.fixture
def queue(kueue: KueueStack, cluster: Cluster) -> Iterator[str]:
    """A TAS flavor over this test's nodes, a ClusterQueue of QUOTA GPUs and a LocalQueue."""
    prefix = f"el-{uuid.uuid4().hex[:6]}"
    objects: list[dict[str, Any]] = [
        topology_manifest(f"{prefix}-topology", TopologyLevels(nvlink=HOSTNAME_LABEL)),
        {"apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": prefix},
         "spec": {"nodeLabels": {TEST_NODES_LABEL: cluster.namespace}, "topologyName": f"{prefix}-topology"}},
        {"apiVersion": KUEUE_API_VERSION, "kind": "ClusterQueue", "metadata": {"name": prefix},
         "spec": {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
             {"name": prefix, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": str(QUOTA)}]}]}]}},
        {"apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
         "metadata": {"name": prefix, "namespace": cluster.namespace}, "spec": {"clusterQueue": prefix}},
    ]  # fmt: skip
    kueue.apply(objects)
    kueue.wait_cluster_queue_active(prefix)
    yield prefix
    cluster.kube.kubectl("delete", "clusterqueues.kueue.x-k8s.io,resourceflavors.kueue.x-k8s.io,"
                         "topologies.kueue.x-k8s.io", prefix, prefix, f"{prefix}-topology",
                         "--ignore-not-found", "--wait=false", check=False)


def _workload(cluster: Cluster, name: str) -> dict[str, Any] | None:
    out = cluster.kube.kubectl("-n", cluster.namespace, "get", f"workloads.kueue.x-k8s.io/{name}",
                               "-o", "json", "--ignore-not-found", check=False).stdout
    return json.loads(out) if out.strip() else None


def _status(workload: dict[str, Any] | None, kind: str) -> str | None:
    conditions = ((workload or {}).get("status") or {}).get("conditions") or []
    return next((c.get("status") for c in conditions if c["type"] == kind), None)


def _count(workload: dict[str, Any] | None) -> int | None:
    return int(workload["spec"]["podSets"][0]["count"]) if workload else None


def _running(cluster: Cluster, job: str) -> int:
    """Running pods of the job's newest attempt (none of an older one left)."""
    pods = [p for p in cluster.pods(job) if p.metadata.deletion_timestamp is None]
    attempts = {p.metadata.labels.get("topotrain.io/attempt") for p in pods}
    if len(attempts) != 1:
        return 0
    return sum(p.status.phase == "Running" for p in pods)


def test_a_scaled_down_elastic_job_frees_its_quota_and_grows_back_on_a_slice_kueue_admits(
    cluster: Cluster, queue: str,
) -> None:
    cluster.add_nodes(racks=2, per_rack=4, gpus=1)  # room for both gangs, and the grown one
    elastic = cluster.manifest("elastic", tensor=1, pipeline=1, data=4, min_data=1, gpus_per_pod=1)
    elastic["metadata"].update(labels={QUEUE_LABEL: queue}, annotations={"kueue.x-k8s.io/elastic-job": "true"})
    cluster.apply(elastic)
    wait_for("the elastic job Running at 4 pods", lambda: _running(cluster, "elastic") == 4)
    other = cluster.manifest("other", tensor=1, pipeline=1, data=2, gpus_per_pod=1)
    other["metadata"]["labels"] = {QUEUE_LABEL: queue}
    cluster.apply(other)
    wait_for("the other job queued, the quota taken", lambda: _status(
        _workload(cluster, "trainingjob-other"), "QuotaReserved") == "False")

    # kubectl scale to 2: Kueue's accounting follows and the other job is admitted on the freed quota
    cluster.patch_spec("elastic", {"parallelism": {"data": 2}})
    wait_for("the elastic Workload lowered to 2", lambda: _count(_workload(cluster, FIRST)) == 2)
    wait_for("the other job Running on the freed GPUs", lambda: _running(cluster, "other") == 2)
    wait_for("the elastic job Running at 2 pods", lambda: _running(cluster, "elastic") == 2)

    # back to 4: the quota is taken, so the slice for 4 waits and the job stays at 2
    cluster.patch_spec("elastic", {"parallelism": {"data": 4}})
    pending = wait_for("a slice for 4 pods", lambda: _workload(cluster, SECOND))
    assert pending["metadata"]["annotations"]["kueue.x-k8s.io/workload-slice-replacement-for"] == \
        f"{cluster.namespace}/{FIRST}"
    assert _count(pending) == 4
    wait_for("the condition naming the slice", lambda: SECOND in str(
        (cluster.condition("elastic", "Admitted") or {}).get("message")))
    assert _status(_workload(cluster, SECOND), "QuotaReserved") != "True"
    assert _running(cluster, "elastic") == 2

    # the other job goes: Kueue admits the slice (the difference), replaces the old Workload,
    # and the job grows
    cluster.delete_job("other")
    wait_for("the elastic job Running at 4 pods again", lambda: _running(cluster, "elastic") == 4)
    admitted = wait_for("the slice admitted", lambda: (w := _workload(cluster, SECOND))
                        and _status(w, "Admitted") == "True" and w)
    assert _count(admitted) == 4
    wait_for("the replaced Workload deleted", lambda: _workload(cluster, FIRST) is None)
