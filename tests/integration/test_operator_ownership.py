"""Identity by owner UID on the testbed: a name is not an identity.

A TrainingJob deleted and re-created under the same name is another object
(another metadata.uid). Real API server, garbage collector and S3 server: the
re-created job neither adopts its namesake's terminating pods, nor takes over
a user's Service of its name, nor silently resumes the old run's checkpoints.
Old pods are held in Terminating by a test finalizer, as a slow kubelet would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from operator_support import Cluster, cluster_fixture, wait_for

from testbed.faults import fail_pod
from testbed.kube import Kube
from testbed.s3 import S3Server

pytestmark = pytest.mark.integration
HOLD = "test.topotrain.io/hold"  # keeps a deleted pod Terminating


@pytest.fixture
def cluster(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    yield from cluster_fixture(kube, namespace, tmp_path)


@pytest.fixture
def held(cluster: Cluster) -> Iterator[list[str]]:
    """Pods a test holds in Terminating; released afterwards."""
    names: list[str] = []
    yield names
    release(cluster, names)


def hold(cluster: Cluster, pods: list[Any], held: list[str]) -> None:
    for p in pods:
        cluster.kube.core.patch_namespaced_pod(p.metadata.name, cluster.namespace,
                                               {"metadata": {"finalizers": [HOLD]}})
        held.append(p.metadata.name)


def release(cluster: Cluster, names: list[str]) -> None:
    for name in names:
        try:
            cluster.kube.core.patch_namespaced_pod(name, cluster.namespace, {"metadata": {"finalizers": None}})
        except ApiException as exc:
            if exc.status != 404:
                raise


def uid(cluster: Cluster, job: str) -> str:
    return str(cluster.job(job)["metadata"]["uid"])


def delete_and_wait(cluster: Cluster, job: str) -> None:
    cluster.delete_job(job)

    def gone() -> bool:
        try:
            cluster.job(job)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for(f"{job} deleted", gone)


def owner_uid(pod: Any) -> str:
    refs = [r for r in pod.metadata.owner_references or [] if r.controller]
    return str(refs[0].uid) if refs else ""


def config_problem(cluster: Cluster, job: str, reason: str) -> dict[str, Any]:
    return wait_for(f"{job} ConfigValid=False {reason}", lambda: (
        c := cluster.condition(job, "ConfigValid")) and c["status"] == "False" and c["reason"] == reason and c)


def test_recreated_job_waits_for_its_namesakes_terminating_pods_and_never_adopts_them(
    cluster: Cluster, held: list[str]
) -> None:
    cluster.add_nodes(racks=1, per_rack=2)
    cluster.apply(cluster.manifest("llm", pipeline=1, data=2))
    old = wait_for("old gang Running", lambda: cluster.running_gang("llm", 0, 2))
    old_uid = uid(cluster, "llm")
    hold(cluster, old, held)
    delete_and_wait(cluster, "llm")
    wait_for("old pods Terminating", lambda: all(
        p.metadata.deletion_timestamp for p in cluster.pods("llm")) and cluster.pods("llm"))

    cluster.apply(cluster.manifest("llm", pipeline=1, data=2))
    new_uid = uid(cluster, "llm")
    waiting = config_problem(cluster, "llm", "ForeignObject")
    assert f"Pod {cluster.namespace}/llm-0-0 exists and is not owned by this TrainingJob" in waiting["message"]
    assert f"earlier TrainingJob llm (uid {old_uid})" in waiting["message"]
    status = cluster.status("llm")
    # the old gang is not this job's: no failure, no restart, no pod counted as its own
    assert status["phase"] == "Pending" and status.get("restarts", 0) == 0 and "lastFailure" not in status
    assert {owner_uid(p) for p in cluster.pods("llm")} == {old_uid}

    release(cluster, held)  # the old pods finish terminating
    gang = wait_for("new gang Running", lambda: cluster.running_gang("llm", 0, 2))
    assert {owner_uid(p) for p in gang} == {new_uid}
    status = cluster.wait_phase("llm", "Running")
    assert status.get("restarts", 0) == 0 and status["attempt"] == 0
    valid = cluster.condition("llm", "ConfigValid")
    assert valid is not None and valid["status"] == "True"


def test_recreated_job_starts_beside_its_namesakes_terminating_pods_without_counting_them(
    cluster: Cluster, held: list[str]
) -> None:
    nodes = cluster.add_nodes(racks=1, per_rack=3)
    cluster.apply(cluster.manifest("llm", pipeline=1, data=1))
    for attempt in (0, 1):  # the old job reaches attempt 2: its pod names differ from a new job's
        gang = wait_for(f"attempt {attempt} Running", lambda a=attempt: cluster.running_gang("llm", a, 1))
        fail_pod(cluster.kube.kubeconfig, cluster.namespace, gang[0].metadata.name, exit_code=1)
    old = wait_for("attempt 2 Running", lambda: cluster.running_gang("llm", 2, 1))
    wait_for("only attempt 2 left", lambda: len(cluster.pods("llm")) == 1)
    old_node = old[0].spec.node_name
    hold(cluster, old, held)
    delete_and_wait(cluster, "llm")
    wait_for("old pod Terminating", lambda: cluster.pods("llm") and all(
        p.metadata.deletion_timestamp for p in cluster.pods("llm")))

    cluster.apply(cluster.manifest("llm", pipeline=1, data=1))
    new_uid = uid(cluster, "llm")
    gang = wait_for("new gang Running", lambda: cluster.running_gang("llm", 0, 1))
    assert owner_uid(gang[0]) == new_uid
    # the terminating pod still holds its node's GPUs, so the new pod went elsewhere
    assert gang[0].spec.node_name in nodes and gang[0].spec.node_name != old_node
    status = cluster.wait_phase("llm", "Running")
    assert status["attempt"] == 0 and status.get("restarts", 0) == 0 and "lastFailure" not in status
    terminating = [p for p in cluster.pods("llm") if p.metadata.deletion_timestamp]
    assert [p.metadata.name for p in terminating] == ["llm-2-0"], "the old pod is left to its owner"


def test_a_users_service_of_the_jobs_name_is_not_taken_over(cluster: Cluster) -> None:
    cluster.add_nodes(racks=1, per_rack=1)
    ns = cluster.namespace
    cluster.kube.core.create_namespaced_service(ns, {
        "metadata": {"name": "llm", "labels": {"app": "mine"}},
        "spec": {"selector": {"app": "mine"}, "ports": [{"name": "http", "port": 80}]},
    })
    cluster.apply(cluster.manifest("llm", pipeline=1, data=1))
    config_problem(cluster, "llm", "ForeignObject")
    shown = yaml.safe_load(cluster.kube.kubectl("get", "tj", "llm", "-n", ns, "-o", "yaml").stdout)
    valid = next(c for c in shown["status"]["conditions"] if c["type"] == "ConfigValid")
    assert valid["message"] == (f"Service {ns}/llm exists and is not owned by this TrainingJob; "
                                "delete or rename it")
    assert shown["status"]["phase"] == "Pending" and not cluster.pods("llm")
    svc = cluster.kube.core.read_namespaced_service("llm", ns)
    assert svc.spec.selector == {"app": "mine"} and [p.port for p in svc.spec.ports] == [80]
    assert not svc.metadata.owner_references
    assert "topotrain" not in {f.manager for f in svc.metadata.managed_fields or []}

    cluster.kube.core.delete_namespaced_service("llm", ns)  # the user renames theirs
    cluster.wait_phase("llm", "Running")
    svc = wait_for("the job's Service", lambda: cluster.kube.core.read_namespaced_service("llm", ns))
    assert svc.spec.cluster_ip == "None" and svc.metadata.owner_references[0].uid == uid(cluster, "llm")


def env(pod: Any) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env if e.value is not None}


def test_recreated_job_resumes_its_namesakes_checkpoints_only_when_told_to(
    cluster: Cluster, s3: S3Server, s3_bucket: str
) -> None:
    cluster.add_nodes(racks=1, per_rack=1)
    cluster.create_secret(s3)
    store = cluster.store(s3, s3_bucket, "llm")
    manifest = cluster.manifest("llm", pipeline=1, data=1, bucket=s3_bucket, s3=s3)
    cluster.apply(manifest)
    wait_for("old gang Running", lambda: cluster.running_gang("llm", 0, 1))
    old_uid = uid(cluster, "llm")
    owner = store.read_owner()
    assert owner is not None and owner.uid == old_uid, "the operator records whose prefix it is"
    store.write_commit(100, {"tensor": 8, "pipeline": 1, "data": 1}, 1)  # as the old trainer would
    delete_and_wait(cluster, "llm")
    wait_for("old pods gone", lambda: not cluster.pods("llm"))

    cluster.apply(manifest)  # same name, same prefix
    refused = config_problem(cluster, "llm", "ForeignCheckpoints")
    assert f"up to step 100 written by another TrainingJob (uid {old_uid}" in refused["message"]
    assert "spec.checkpoint.resumePolicy: Always" in refused["message"]
    status = cluster.status("llm")
    assert status["phase"] == "Pending" and not cluster.pods("llm") and "checkpoint" not in status

    cluster.patch_spec("llm", {"checkpoint": {"resumePolicy": "Always"}})
    gang = wait_for("new gang Running", lambda: cluster.running_gang("llm", 0, 1))
    assert env(gang[0])["TOPOTRAIN_RESUME_STEP"] == "100"
    new_uid = uid(cluster, "llm")
    status = cluster.wait_phase("llm", "Running")
    assert status["resumedFrom"]["uid"] == old_uid and status["resumedFrom"]["step"] == 100
    assert status["checkpoint"]["step"] == 100
    owner = store.read_owner()
    assert owner is not None and owner.uid == new_uid and owner.resumed_uid == old_uid
    events = wait_for("a ResumedForeignCheckpoints Event", lambda: [
        e for e in cluster.kube.core.list_namespaced_event(cluster.namespace).items
        if e.reason == "ResumedForeignCheckpoints" and e.involved_object.uid == new_uid])
    assert "from step 100" in events[0].message


def test_a_status_write_meant_for_a_deleted_job_never_lands_on_its_namesake(cluster: Cluster) -> None:
    """The loop of a deleted job can still be finishing a pass when a job of the same name is
    created: its status write is made against the old object's uid and must be refused, leaving
    the new job's status alone (a merge patch of the status subresource ignores metadata.uid,
    so the operator writes a JSON patch that tests it)."""
    from topotrain.controller.kube import Kube as OperatorKube

    manifest = cluster.manifest("twin", pipeline=1, data=1, suspend=True)  # nothing to place
    cluster.apply(manifest)
    old_uid = uid(cluster, "twin")
    old_status = wait_for("the operator's first status", lambda: cluster.status("twin").get("phase") and cluster.status("twin"))
    delete_and_wait(cluster, "twin")
    cluster.apply(manifest)
    new_uid = uid(cluster, "twin")
    assert new_uid != old_uid
    new_status = wait_for("the new job's status", lambda: cluster.status("twin").get("phase") and cluster.status("twin"))
    operator = OperatorKube(cluster.kube.api)
    with pytest.raises(ApiException) as refused:
        operator.patch_status(cluster.namespace, "twin", old_status,
                              {**old_status, "phase": "Failed", "reason": "StaleLoop"}, old_uid)
    assert refused.value.status == 422
    assert cluster.status("twin").get("reason") != "StaleLoop"
    # The same write made for the object that holds the name now goes through.
    current = cluster.status("twin")
    operator.patch_status(cluster.namespace, "twin", current, {**current, "reason": "Ours"}, new_uid)
    assert cluster.status("twin")["reason"] == "Ours" and new_status["phase"]


def test_a_status_write_from_a_stale_view_of_the_phase_is_refused(cluster: Cluster) -> None:
    """Two replicas can act at once for a few seconds (the leader's peering keep-alive held up
    by an API server restart): the one whose view is stale must not move the job back. Each
    write tests the phase it started from; the real API server refuses the stale one."""
    from topotrain.controller.kube import Kube as OperatorKube

    cluster.apply(cluster.manifest("held", pipeline=1, data=1, suspend=True))  # nothing to place
    current = wait_for("the operator's status", lambda: cluster.status("held").get("phase") and cluster.status("held"))
    job_uid = uid(cluster, "held")
    stale = {**current, "phase": "Running" if current["phase"] != "Running" else "Pending"}
    operator = OperatorKube(cluster.kube.api)
    with pytest.raises(ApiException) as refused:
        operator.patch_status(cluster.namespace, "held", stale,
                              {**stale, "phase": "Recovering", "reason": "StaleReplica"}, job_uid)
    assert refused.value.status == 422
    after = cluster.status("held")
    assert after["phase"] == current["phase"] and after.get("reason") != "StaleReplica"


def test_a_gang_deleted_with_preconditions_gets_the_grace_the_operator_asked_for(
    kube: Kube, namespace: str
) -> None:
    """The operator deletes a gang's pods with preconditions (uid, resourceVersion) in the body and
    its own grace period (1 s for a gang with a rank on a lost node, whose SIGTERM save cannot
    commit). The real API server reads a delete's options from its body alone: a grace only in
    the query was ignored, and the kubelet gave the pods their own 30 s. Held Terminating by a
    test finalizer; the first version of the pod that is being deleted shows the grace it was
    given (KWOK, standing in for the kubelet, then shortens it to 0 to finish the deletion)."""
    from kubernetes import watch
    from topotrain.controller.kube import Kube as OperatorKube

    from testbed.binaries import KEEP_RUNNING_LABEL

    node = kube.core.list_node().items[0].metadata.name
    # Running until deleted: KWOK would complete it (a finished pod is deleted with no grace too)
    pod = kube.core.create_namespaced_pod(namespace, {
        "metadata": {"name": "graced", "finalizers": [HOLD], "labels": {KEEP_RUNNING_LABEL: "true"}},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 30,
                 "containers": [{"name": "c", "image": "busybox"}]},
    })  # fmt: skip
    # (a pod no kubelet has started yet is deleted with no grace, whatever the delete asks)
    running = wait_for("the pod Running", lambda: (p := kube.core.read_namespaced_pod("graced", namespace))
                       .status.phase == "Running" and p)  # fmt: skip
    seen = {"graced": (pod.metadata.uid, "")}  # (KWOK writes its status meanwhile)
    try:
        assert OperatorKube(kube.api).delete_pods(namespace, ["graced"], 1, seen) == []
        graces = []
        for event in watch.Watch().stream(kube.core.list_namespaced_pod, namespace,
                                          field_selector="metadata.name=graced", timeout_seconds=30,
                                          resource_version=running.metadata.resource_version):  # fmt: skip
            if event["object"].metadata.deletion_timestamp is not None:
                graces.append(event["object"].metadata.deletion_grace_period_seconds)
                break
        assert graces == [1], f"the first version being deleted had a grace of {graces}"
    finally:
        kube.core.patch_namespaced_pod("graced", namespace, {"metadata": {"finalizers": None}})
