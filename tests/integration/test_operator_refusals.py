"""Pods the real API server refuses, and pods that never start, on the testbed.

The refusals come from the API server itself (ResourceQuota admission, pod
validation); the Unschedulable pods from the real kube-scheduler. The tests
check what a user sees: the job's phase, its conditions and `kubectl get tj`,
and that no half-created gang is left holding quota.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from operator_support import Cluster, cluster_fixture, wait_for

from testbed.kube import Kube

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    yield from cluster_fixture(kube, namespace, tmp_path)


def _live(cluster: Cluster, job: str) -> list[str]:
    return [p.metadata.name for p in cluster.pods(job) if p.metadata.deletion_timestamp is None]


def _quota(cluster: Cluster, gpus: int) -> None:
    body = {"metadata": {"name": "gpus"}, "spec": {"hard": {"requests.nvidia.com/gpu": str(gpus)}}}
    core = cluster.kube.core
    if core.list_namespaced_resource_quota(cluster.namespace).items:
        core.patch_namespaced_resource_quota("gpus", cluster.namespace, body)
    else:
        core.create_namespaced_resource_quota(cluster.namespace, body)


def test_quota_refusal_is_in_status_holds_nothing_and_clears_when_quota_grows(cluster: Cluster) -> None:
    cluster.add_nodes(racks=1, per_rack=4)
    _quota(cluster, 16)  # the gang needs 4 pods x 8 GPUs
    wait_for("quota status", lambda: cluster.kube.core.read_namespaced_resource_quota(
        "gpus", cluster.namespace).status.hard)
    cluster.apply(cluster.manifest("llm"))
    cond = wait_for("PodsCreated=False", lambda: (c := cluster.condition("llm", "PodsCreated"))
                    and c["status"] == "False" and c)
    assert cond["reason"] == "QuotaExceeded" and "exceeded quota" in cond["message"], cond
    status = cluster.status("llm")
    assert status["phase"] == "Pending" and status["reason"] == "QuotaExceeded"
    table = cluster.kube.kubectl("get", "tj", "llm", "-n", cluster.namespace).stdout
    assert "QuotaExceeded" in table, table
    # Never half a gang holding quota: the pods that were admitted are taken back.
    wait_for("no pod left holding quota", lambda: not _live(cluster, "llm") or None)
    _quota(cluster, 64)
    wait_for("gang Running once quota allows", lambda: cluster.running_gang("llm", 0, 4), 60)
    # The condition is written after the pass's pod calls return, and its pods may be Running
    # before that: a fresh-clone CI read it still False with the whole gang Running.
    created = wait_for("PodsCreated=True once the gang exists", lambda: (
        c := cluster.condition("llm", "PodsCreated")) and c["status"] == "True" and c)
    assert created["reason"] != "QuotaExceeded", created


def test_invalid_pod_is_refused_with_the_api_servers_words(cluster: Cluster) -> None:
    cluster.add_nodes(racks=1, per_rack=4)
    cluster.apply(cluster.manifest("llm", worker={"resources": {"requests": {"memory": "lots"}}}))
    cond = wait_for("PodsCreated=False", lambda: (c := cluster.condition("llm", "PodsCreated"))
                    and c["status"] == "False" and c)
    assert cond["reason"] == "PodSpecInvalid" and "quantities must match" in cond["message"], cond
    assert not _live(cluster, "llm")
    described = cluster.kube.kubectl("describe", "tj", "llm", "-n", cluster.namespace).stdout
    assert "PodSpecInvalid" in described


def test_unschedulable_pods_say_why_then_their_nodes_are_avoided_until_nothing_else_fits(
    cluster: Cluster,
) -> None:
    cluster.add_nodes(racks=1, per_rack=2)
    cluster.apply(cluster.manifest(
        "llm", pipeline=1,  # 2 pods
        worker={"resources": {"requests": {"cpu": "100000"}}},  # more CPU than any node has
        # (every attempt's pods are Unschedulable again: the Ready condition says so in each
        # attempt, so the poll below races no deadline)
        failurePolicy={"schedulingTimeoutSeconds": 20, "nodeFailureThreshold": 1},
    ))
    ready = wait_for("Ready says Unschedulable", lambda: (c := cluster.condition("llm", "Ready"))
                     and "Unschedulable" in c["message"] and c)
    assert "Insufficient cpu" in ready["message"], ready
    failure = wait_for("PodsNotStarting", lambda: (s := cluster.status("llm")).get("lastFailure")
                       and s["lastFailure"]["reason"] == "PodsNotStarting" and s["lastFailure"])
    assert "schedulingTimeoutSeconds" in failure["message"]

    # Both nodes reach the threshold; nothing else fits the gang, so the re-plan uses them again
    # (the job never waits forever on an empty pool) and says so in an Event.
    def reasons() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for e in cluster.kube.core.list_namespaced_event(cluster.namespace).items:
            if e.involved_object.name == "llm":
                out.setdefault(e.reason or "", []).append(e.message or "")
        return out

    seen = wait_for("NodeAvoided then NodesForgiven Events", lambda: (r := reasons())
                    and len(r.get("NodeAvoided", [])) >= 2 and r.get("NodesForgiven") and r)
    for node in cluster.nodes:
        assert any(node in m for m in seen["NodeAvoided"]), seen["NodeAvoided"]
        assert any(node in m for m in seen["NodesForgiven"]), seen["NodesForgiven"]
    status = wait_for("the restarted gang's pods",
                      lambda: (s := cluster.status("llm")).get("attempt", 0) >= 1
                      and len(cluster.pods("llm")) == 2 and s)  # fmt: skip
    assert status["restartsByClass"]["infrastructure"] >= 1 and status["restartsByClass"]["application"] == 0
