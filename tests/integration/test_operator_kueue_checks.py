"""The operator as a Kueue citizen, against the real Kueue (v0.17, as a testbed process): a
ClusterQueue whose admission check (ProvisioningRequest-style, its controller played by the
test) leaves podSetUpdates on the Workload: Kueue admits the job only once the check is Ready,
and every pod of the gang carries the updates; once the gang runs the Workload says PodsReady
as Kueue's own integrations do. KWOK pods, no trainer (operator_support.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from operator_support import TEST_NODES_LABEL, Cluster, cluster_fixture, wait_for
from topotrain.core.kueue import KUEUE_API_VERSION, topology_manifest
from topotrain.placement.topology import TopologyLevels

from testbed.kube import Kube
from testbed.kueue import QUEUE_LABEL, KueueStack
from testbed.topology import HOSTNAME_LABEL

pytestmark = [pytest.mark.integration, pytest.mark.kueue]

CHECK_CONTROLLER = "test.topotrain.io/provisioning"
PROVISIONED = "test.topotrain.io/provisioned"  # a label the check's nodes carry
UPDATE = {
    "name": "workers", "labels": {"provisioned-by": "check"},
    "annotations": {"autoscaling.x-k8s.io/consume-provisioning-request": "req-1"},
    "tolerations": [{"key": "provisioned", "operator": "Exists", "effect": "NoSchedule"}],
}  # fmt: skip


@pytest.fixture
def cluster(kueue: KueueStack, kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    yield from cluster_fixture(kube, namespace, tmp_path)  # Kueue first: the operator watches Workloads


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def queue(kueue: KueueStack, cluster: Cluster) -> Iterator[str]:
    """A TAS flavor over this test's nodes, an AdmissionCheck (Active: the test is its
    controller), a ClusterQueue using both, and a LocalQueue; returns the LocalQueue."""
    prefix = f"ck-{uuid.uuid4().hex[:6]}"
    node_labels = {TEST_NODES_LABEL: cluster.namespace}
    objects: list[dict[str, Any]] = [
        topology_manifest(f"{prefix}-topology", TopologyLevels(nvlink=HOSTNAME_LABEL)),
        {"apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": prefix},
         "spec": {"nodeLabels": node_labels, "topologyName": f"{prefix}-topology"}},
        {"apiVersion": KUEUE_API_VERSION, "kind": "AdmissionCheck", "metadata": {"name": prefix},
         "spec": {"controllerName": CHECK_CONTROLLER}},
        {"apiVersion": KUEUE_API_VERSION, "kind": "ClusterQueue", "metadata": {"name": prefix},
         "spec": {"namespaceSelector": {}, "admissionChecksStrategy": {"admissionChecks": [{"name": prefix}]},
                  "resourceGroups": [{
             "coveredResources": ["nvidia.com/gpu"],
             "flavors": [{"name": prefix, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "4"}]}]}]}},
        {"apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
         "metadata": {"name": prefix, "namespace": cluster.namespace}, "spec": {"clusterQueue": prefix}},
    ]  # fmt: skip
    kueue.apply(objects)
    active = {"status": {"conditions": [{"type": "Active", "status": "True", "reason": "Active",
                                         "message": "the test plays its controller",
                                         "lastTransitionTime": _now()}]}}
    cluster.kube.kubectl("patch", "admissionchecks.kueue.x-k8s.io", prefix, "--subresource=status",
                         "--type=merge", "-p", json.dumps(active))
    kueue.wait_cluster_queue_active(prefix)
    yield prefix
    cluster.kube.kubectl("delete", "clusterqueues.kueue.x-k8s.io,resourceflavors.kueue.x-k8s.io,"
                         "admissionchecks.kueue.x-k8s.io,topologies.kueue.x-k8s.io", prefix, prefix,
                         prefix, f"{prefix}-topology", "--ignore-not-found", "--wait=false", check=False)


def _workload(cluster: Cluster, name: str) -> dict[str, Any] | None:
    out = cluster.kube.kubectl("-n", cluster.namespace, "get", f"workloads.kueue.x-k8s.io/trainingjob-{name}",
                               "-o", "json", "--ignore-not-found", check=False).stdout
    return json.loads(out) if out.strip() else None


def _condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def test_admission_check_pod_set_updates_are_on_every_pod_and_pods_ready_is_said(
    cluster: Cluster, queue: str,
) -> None:
    for node in cluster.add_nodes(racks=1, per_rack=2, gpus=2):
        cluster.kube.kubectl("label", "node", node, f"{PROVISIONED}=yes")
    manifest = cluster.manifest("llm", tensor=1, pipeline=1, data=4, gpus_per_pod=1)
    manifest["metadata"]["labels"] = {QUEUE_LABEL: queue}
    cluster.apply(manifest)
    # Quota reserved, the check still Pending: Kueue does not admit, the operator starts nothing.
    wait_for("quota reserved, the check pending", lambda: (w := _workload(cluster, "llm"))
             and _condition(w, "QuotaReserved").get("status") == "True" and w)
    assert _condition(_workload(cluster, "llm"), "Admitted").get("status") != "True"
    assert not cluster.pods("llm")
    # The check's controller (this test) says Ready, with podSetUpdates.
    ready = {"status": {"admissionChecks": [{"name": queue, "state": "Ready", "message": "provisioned",
                                             "lastTransitionTime": _now(), "podSetUpdates": [
                                                 {**UPDATE, "nodeSelector": {PROVISIONED: "yes"}}]}]}}
    cluster.kube.kubectl("-n", cluster.namespace, "patch", "workloads.kueue.x-k8s.io", "trainingjob-llm",
                         "--subresource=status", "--type=merge", "-p", json.dumps(ready))
    gang = wait_for("the gang Running", lambda: cluster.running_gang("llm", 0, 4))
    for pod in gang:
        assert pod.metadata.labels["provisioned-by"] == "check", pod.metadata.labels
        assert pod.metadata.annotations["autoscaling.x-k8s.io/consume-provisioning-request"] == "req-1"
        assert any(t.key == "provisioned" and t.operator == "Exists" for t in pod.spec.tolerations or [])
        assert pod.spec.node_selector[PROVISIONED] == "yes", pod.spec.node_selector
    admitted = cluster.condition("llm", "Admitted")
    assert admitted is not None and admitted["status"] == "True", cluster.status("llm")
    # The Workload says the pods are ready, as Kueue's own integrations do (waitForPodsReady reads it).
    workload = wait_for("PodsReady True", lambda: (w := _workload(cluster, "llm"))
                        and _condition(w, "PodsReady").get("status") == "True" and w)
    assert _condition(workload, "PodsReady")["reason"] == "Started"
    assert _condition(workload, "Evicted").get("status") != "True"
