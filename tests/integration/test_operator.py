"""The operator on the testbed: placement, gang start, concurrency, completion, deletion.

Real API server, scheduler and controller manager; KWOK GPU nodes private to
each test (see operator_support); the operator runs as `topotrain run`.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
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


def finish_pods(cluster: Cluster, job: str) -> None:
    """Report every pod of the job Succeeded, as the kubelet (the testbed harness) would."""
    for pod in cluster.pods(job):
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cluster.kube.core.patch_namespaced_pod_status(pod.metadata.name, cluster.namespace, {"status": {
            "phase": "Succeeded",
            "containerStatuses": [{
                "name": "trainer", "image": "topotrain/trainer:test", "imageID": "", "ready": False,
                "restartCount": 0, "started": False,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now,
                                         "finishedAt": now}},
            }],
        }})


def test_apply_places_gang_on_planned_nodes_and_runs(cluster: Cluster) -> None:
    nodes = cluster.add_nodes(racks=2, per_rack=2)
    # TP=8 over 4-GPU pods: each tensor group spans two pods, which must share an NVLink domain
    cluster.apply(cluster.manifest("llm", tensor=8, pipeline=2, data=2, gpus_per_pod=4))
    status = cluster.wait_phase("llm", "Running")
    pods = cluster.pods("llm")
    assert len(pods) == 8 and all(p.status.phase == "Running" for p in pods)
    for pod in pods:  # the real scheduler bound each pod to the node the plan chose
        assert pod.spec.node_name == pod.metadata.annotations["topotrain.io/node"]
        assert pod.spec.node_name in nodes
        assert pod.spec.scheduling_gates in (None, [])
    by_index = {int(p.metadata.labels["topotrain.io/index"]): p.spec.node_name for p in pods}
    for group in range(4):  # ranks 8g..8g+7 live on pods 2g and 2g+1
        assert by_index[2 * group] == by_index[2 * group + 1], "a TP group left its NVLink domain"
    assert status["placement"]["nodes"] == 4 and status["parallelism"]["data"] == 2
    assert status["selector"] == "topotrain.io/job=llm" and status["attempt"] == 0
    ready = cluster.condition("llm", "Ready")
    assert ready is not None and ready["status"] == "True"
    env = {e.name: e.value for e in pods[3].spec.containers[0].env}
    assert env["MASTER_ADDR"] == f"llm-0-0.llm.{cluster.namespace}.svc" and env["NODE_RANK"] == "3"
    assert env["WORLD_SIZE"] == "32" and env["TOPOTRAIN_ATTEMPT"] == "0"
    svc = cluster.kube.core.read_namespaced_service("llm", cluster.namespace)
    assert svc.spec.cluster_ip == "None"
    table = cluster.kube.core.read_namespaced_config_map("llm-ranks", cluster.namespace)
    assert table.data["attempt"] == "0" and len(table.data["ranks.tsv"].splitlines()) == 33
    owner = pods[0].metadata.owner_references[0]
    assert owner.kind == "TrainingJob" and owner.controller is True
    # The first pass waited for kopf's finalizer write: no pass was refused for a stale version
    # (each such pass planned for nothing and delayed the start by about half a second).
    log = cluster.operator.log.read_text(errors="replace")
    assert "pass ended before acting" not in log, log[-3000:]


def test_two_jobs_share_a_tight_cluster_and_a_third_waits_for_capacity(cluster: Cluster) -> None:
    cluster.add_nodes(racks=1, per_rack=3)  # 24 GPUs: exactly jobs a (16) and b (8)
    cluster.apply(cluster.manifest("a", tensor=8, pipeline=1, data=2))
    cluster.apply(cluster.manifest("b", tensor=8, pipeline=1, data=1))
    cluster.wait_phase("a", "Running")
    cluster.wait_phase("b", "Running")
    used = [p.spec.node_name for p in cluster.pods()]
    assert len(used) == 3 and len(set(used)) == 3, f"a GPU was double-booked: {used}"

    cluster.apply(cluster.manifest("c", tensor=8, pipeline=1, data=1))
    waiting = wait_for("c unschedulable", lambda: (c := cluster.condition("c", "Schedulable"))
                       and c["status"] == "False" and c)
    assert waiting["reason"] == "InsufficientCapacity" and "c" not in {
        p.metadata.labels["topotrain.io/job"] for p in cluster.pods()}
    assert cluster.status("c")["phase"] == "Pending"

    finish_pods(cluster, "b")
    done = cluster.wait_phase("b", "Succeeded")
    assert done["conditions"] and cluster.condition("b", "Succeeded")["status"] == "True"  # type: ignore[index]
    cluster.wait_phase("c", "Running")
    wait_for("b's pods deleted", lambda: not cluster.pods("b"))


def test_deleting_a_job_removes_children_and_keeps_checkpoints(
    cluster: Cluster, s3: S3Server, s3_bucket: str
) -> None:
    cluster.add_nodes(racks=1, per_rack=2)
    cluster.create_secret(s3)
    store = cluster.store(s3, s3_bucket, "gone")
    store.write_commit(100, {"tensor": 8, "pipeline": 1, "data": 2}, 1)
    cluster.apply(cluster.manifest("gone", tensor=8, pipeline=1, data=2, bucket=s3_bucket, s3=s3,
                                   checkpoint={"resumePolicy": "Always"}))  # seeded above
    status = cluster.wait_phase("gone", "Running")
    assert status["checkpoint"]["step"] == 100
    cluster.delete_job("gone")
    # the garbage collector (real kube-controller-manager) follows the owner references
    wait_for("children collected", lambda: not cluster.pods("gone") and not [
        s for s in cluster.kube.core.list_namespaced_service(cluster.namespace).items
        if s.metadata.name == "gone"])
    assert [c.step for c in store.list_committed()] == [100]


@pytest.fixture
def idle(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    """The operator with a ten-minute idle re-check: only events move a job along."""
    yield from cluster_fixture(kube, namespace, tmp_path, TOPOTRAIN_RECONCILE_INTERVAL="600")


def test_a_spec_change_is_acted_on_without_waiting_for_the_idle_recheck(idle: Cluster) -> None:
    """A suspended job is Suspended and its loop idles (nothing to wait for); un-suspending it
    is a spec change only, which must wake the loop: before, it waited for the next idle
    re-check (reconcile_interval, 10 s by default), and a job re-created with resumePolicy
    patched in sat on its refusal until then."""
    idle.add_nodes(racks=1, per_rack=1)
    idle.apply(idle.manifest("llm", pipeline=1, data=1, suspend=True))
    idle.wait_phase("llm", "Suspended")
    idle.patch_spec("llm", {"suspend": False})
    wait_for("the gang Running long before the idle re-check", lambda: idle.running_gang("llm", 0, 1),
             timeout=120)
    status = idle.wait_phase("llm", "Running")
    assert status["observedGeneration"] == 2


@pytest.fixture
def binding(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    yield from cluster_fixture(kube, namespace, tmp_path, TOPOTRAIN_POD_BINDING="operator")


def test_with_operator_binding_gangs_start_on_their_planned_nodes_without_the_scheduler(binding: Cluster) -> None:
    """`--pod-binding operator` (docs/operator.md, "Who binds a pod"): a gang on free nodes is
    created bound to its planned nodes, so kube-scheduler never binds it (no Scheduled event);
    the restart after a failure, whose nodes still hold the old gang's healthy pod, is created
    gated and bound by the scheduler once they are gone, on its planned nodes too."""
    cluster = binding
    nodes = cluster.add_nodes(racks=1, per_rack=2)
    cluster.apply(cluster.manifest("llm", tensor=8, pipeline=1, data=2))
    gang = wait_for("attempt 0 Running", lambda: cluster.running_gang("llm", 0, 2))
    for pod in gang:
        assert pod.spec.node_name == pod.metadata.annotations["topotrain.io/node"] and pod.spec.node_name in nodes
        assert pod.spec.scheduling_gates in (None, [])
    fail_pod(cluster.kube.kubeconfig, cluster.namespace, gang[1].metadata.name, exit_code=1)
    again = wait_for("attempt 1 Running", lambda: cluster.running_gang("llm", 1, 2))
    assert all(p.spec.node_name == p.metadata.annotations["topotrain.io/node"] for p in again)
    events = cluster.kube.core.list_namespaced_event(cluster.namespace).items
    scheduled = sorted(e.involved_object.name for e in events if e.reason == "Scheduled")
    assert scheduled == ["llm-1-0", "llm-1-1"], f"kube-scheduler bound {scheduled}"
