"""Elastic resizing on the testbed: shrink on node loss, grow back, follow `kubectl scale`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from operator_support import Cluster, cluster_fixture, wait_for

from testbed.kube import Kube
from testbed.nodes import delete_node

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    yield from cluster_fixture(kube, namespace, tmp_path)


def data_degree(cluster: Cluster, job: str, data: int) -> dict[str, object] | None:
    status = cluster.status(job)
    if status.get("phase") == "Running" and status.get("parallelism", {}).get("data") == data:
        return status
    return None


def test_node_loss_without_spare_shrinks_then_grows_back(cluster: Cluster) -> None:
    nodes = cluster.add_nodes(racks=1, per_rack=2)
    cluster.apply(cluster.manifest("llm", pipeline=1, data=2, min_data=1))
    gang = wait_for("data=2 Running", lambda: cluster.running_gang("llm", 0, 2))
    delete_node(cluster.kube.kubeconfig, gang[1].spec.node_name)  # no spare node exists

    shrunk = wait_for("shrunk to data=1", lambda: data_degree(cluster, "llm", 1))
    assert shrunk["recovery"]["mode"] == "shrink"  # type: ignore[index]
    assert len(wait_for("1 pod Running", lambda: cluster.running_gang("llm", 1, 1))) == 1
    shrink_events = [e for e in cluster.kube.core.list_namespaced_event(cluster.namespace).items
                     if e.reason == "ShrunkDataParallel"]
    assert shrink_events

    cluster.nodes.remove(gang[1].spec.node_name)
    cluster.add_nodes(racks=1, per_rack=1, prefix="new")  # capacity returns
    grown = wait_for("grew back to data=2", lambda: data_degree(cluster, "llm", 2))
    assert grown["recovery"]["mode"] == "grow" and grown["restarts"] == 1  # type: ignore[index]
    assert len(wait_for("2 pods Running", lambda: cluster.running_gang("llm", 2, 2))) == 2
    assert nodes[0] in {p.spec.node_name for p in cluster.pods("llm")}


def test_kubectl_scale_resizes_the_data_degree(cluster: Cluster) -> None:
    cluster.add_nodes(racks=1, per_rack=2)
    cluster.apply(cluster.manifest("llm", pipeline=1, data=2, min_data=1))
    wait_for("data=2 Running", lambda: data_degree(cluster, "llm", 2))
    cluster.kube.kubectl("-n", cluster.namespace, "scale", "tj/llm", "--replicas=1")
    wait_for("scaled to 1", lambda: data_degree(cluster, "llm", 1))
    assert len(wait_for("1 pod", lambda: cluster.running_gang("llm", 1, 1))) == 1
    cluster.kube.kubectl("-n", cluster.namespace, "scale", "tj/llm", "--replicas=2")
    wait_for("scaled back to 2", lambda: data_degree(cluster, "llm", 2))
    assert cluster.status("llm")["restarts"] == 0  # resizes are not failures
