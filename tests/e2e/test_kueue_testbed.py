"""Kueue with topology-aware scheduling, and JobSet, as testbed processes (testbed/kueue.py).

On the shared testbed's tiny fleet (two racks of two 8-GPU H100 nodes): a Workload asking
for four one-GPU pods required inside one rack is admitted with a topology assignment in
one rack; a JobSet asking the same through Kueue's annotation is admitted, and its pods are
ungated by Kueue, bound by the real kube-scheduler and Running on KWOK nodes of one rack.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from testbed.binaries import KEEP_RUNNING_LABEL
from testbed.kube import Kube
from testbed.kueue import QUEUE_LABEL, KueueStack
from testbed.kueue_queues import KueueQueues, assigned_domains, queue_manifests
from testbed.procs import wait_until
from testbed.topology import HOSTNAME_LABEL, RACK_LABEL, parse_topology
from tests.conftest import TESTBED_TOPOLOGY

PODS = 4
REQUIRED_RACK = "kueue.x-k8s.io/podset-required-topology"


pytestmark = pytest.mark.kueue  # the `kueue` fixture: tests/conftest.py


@pytest.fixture
def queues(kueue: KueueStack, namespace: str) -> Iterator[KueueQueues]:
    prefix = f"tb-{uuid.uuid4().hex[:6]}"
    made = queue_manifests(parse_topology(TESTBED_TOPOLOGY), namespace, prefix=prefix,
                           pools=["tiny-h100"])  # fmt: skip
    kueue.apply(made.manifests())
    kueue.wait_cluster_queue_active(made.cluster_queue)
    yield made
    kinds = "clusterqueues.kueue.x-k8s.io,resourceflavors.kueue.x-k8s.io,topologies.kueue.x-k8s.io"
    names = [made.cluster_queue, made.topology, *(made.flavor_name(f) for f in made.flavors)]
    kueue._kubectl("delete", kinds, *names, "--ignore-not-found", "--wait=false", check=False)


def _get(kube: Kube, *args: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(kube.kubectl("get", *args, "-o", "json").stdout)
    return found


def _node_racks(kube: Kube, hosts: set[str]) -> set[str]:
    nodes = _get(kube, "nodes")["items"]
    return {n["metadata"]["labels"][RACK_LABEL] for n in nodes if n["metadata"]["name"] in hosts}


def _admission(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    workload = _get(kube, "-n", namespace, "workloads.kueue.x-k8s.io", name)
    admission: dict[str, Any] | None = workload.get("status", {}).get("admission")
    return admission


def test_a_workload_required_in_a_rack_is_assigned_one_rack(
    kube: Kube, kueue: KueueStack, queues: KueueQueues, namespace: str
) -> None:
    name = "tas-rack"
    container = {"name": "w", "image": "testbed.invalid/worker:0",
                 "resources": {"requests": {"nvidia.com/gpu": "1"},
                               "limits": {"nvidia.com/gpu": "1"}}}  # fmt: skip
    kueue.apply([{
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"queueName": queues.local_queue, "podSets": [{
            "name": "workers", "count": PODS,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
            "topologyRequest": {"required": RACK_LABEL},
        }]},
    }])  # fmt: skip
    try:
        wait_until(lambda: _admission(kube, namespace, name) is not None, timeout=30,
                   what="the Workload admitted")  # fmt: skip
    except TimeoutError:
        shown = kube.kubectl("-n", namespace, "get", "workloads.kueue.x-k8s.io", name, "-o", "yaml")
        pytest.fail(f"not admitted:\n{shown.stdout}\n{kueue.log_tail()}")
    admission = _admission(kube, namespace, name)
    assert admission is not None
    assignment = admission["podSetAssignments"][0]["topologyAssignment"]
    assert assignment["levels"][-1] == HOSTNAME_LABEL
    domains = assigned_domains(assignment)
    assert sum(pods for _, pods in domains) == PODS
    assert len(_node_racks(kube, {values[-1] for values, _ in domains})) == 1


def _jobset(name: str, queue: str) -> dict[str, Any]:
    container = {"name": "w", "image": "testbed.invalid/worker:0",
                 "resources": {"requests": {"nvidia.com/gpu": "1"},
                               "limits": {"nvidia.com/gpu": "1"}}}  # fmt: skip
    # KWOK completes a Job's Running pods at once unless they carry KEEP_RUNNING_LABEL.
    template = {"metadata": {"annotations": {REQUIRED_RACK: RACK_LABEL},
                             "labels": {KEEP_RUNNING_LABEL: "true"}},
                "spec": {"restartPolicy": "Never", "containers": [container]}}  # fmt: skip
    job = {"parallelism": PODS, "completions": PODS, "backoffLimit": 0, "template": template}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: queue}},
        "spec": {"suspend": True,
                 "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": job}}]},
    }  # fmt: skip


def test_a_jobset_required_in_a_rack_runs_in_one_rack(
    kube: Kube, kueue: KueueStack, queues: KueueQueues, namespace: str
) -> None:
    name = "tas-js"
    manifest = _jobset(name, queues.local_queue)
    manifest["metadata"]["namespace"] = namespace
    kueue.apply([manifest])
    selector = f"jobset.sigs.k8s.io/jobset-name={name}"

    def running() -> list[dict[str, Any]]:
        pods = _get(kube, "-n", namespace, "pods", "-l", selector)["items"]
        up = [p for p in pods if p.get("status", {}).get("phase") == "Running"]
        return up if len(up) == PODS else []

    try:
        wait_until(lambda: bool(running()), timeout=60, what="the JobSet's pods Running")
    except TimeoutError:
        shown = kube.kubectl("-n", namespace, "get", "jobsets,workloads,pods", "-o", "wide")
        pytest.fail(f"not running:\n{shown.stdout}\n{kueue.log_tail()}")
    pods = running()
    for pod in pods:
        assert not pod["spec"].get("schedulingGates"), "Kueue's topology gate was removed"
    assert len(_node_racks(kube, {p["spec"]["nodeName"] for p in pods})) == 1
