"""The job API of issue 36 on the testbed's API server: templates, failure rules, the deadline,
the time to live. One namespace, one operator and one set of KWOK nodes serve the whole module; the pods
run no processes (KWOK), their failures and evictions are injected (testbed/faults.py, the
Eviction API), and each test's job has names of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from operator_support import Cluster, cluster_fixture, wait_for

from testbed.faults import fail_pod
from testbed.kube import Kube
from testbed.s3 import S3Server

pytestmark = pytest.mark.integration
HOLD = "test.topotrain.io/hold"  # a finalizer of the test's: keeps an evicted pod Terminating


@pytest.fixture(scope="module")
def cluster(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    name = f"t-job-api-{int(time.time() * 1000) % 10**8}"
    kube.core.create_namespace({"metadata": {"name": name, "labels": {"topotrain.io/test": "1"}}})
    wait_for("the default ServiceAccount", lambda: kube.core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items, 60)
    stack = cluster_fixture(kube, name, tmp_path_factory.mktemp("job-api"))
    shared = next(stack)
    try:
        shared.add_nodes(racks=1, per_rack=6)
        yield shared
    finally:
        next(stack, None)  # the operator stopped, the nodes deleted
        kube.delete_namespace(name)


def job(cluster: Cluster, name: str, **spec: Any) -> dict[str, Any]:
    return cluster.manifest(name, tensor=8, pipeline=1, data=2, **spec)


class Templates:
    """TrainingJobTemplates (cluster-scoped) made by a test, named after its namespace and
    deleted when it ends."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.names: list[str] = []

    def name(self, stem: str) -> str:
        return f"{self.cluster.namespace}-{stem}"

    def create(self, stem: str, spec: dict[str, Any]) -> str:
        name = self.name(stem)
        self.cluster.custom.create_cluster_custom_object("topotrain.io", "v1alpha1", "trainingjobtemplates", {
            "apiVersion": "topotrain.io/v1alpha1", "kind": "TrainingJobTemplate",
            "metadata": {"name": name}, "spec": spec})
        self.names.append(name)
        return name

    def patch(self, name: str, spec: dict[str, Any]) -> None:
        self.cluster.custom.patch_cluster_custom_object(
            "topotrain.io", "v1alpha1", "trainingjobtemplates", name, {"spec": spec})

    def cleanup(self) -> None:
        for name in self.names:
            try:
                self.cluster.custom.delete_cluster_custom_object(
                    "topotrain.io", "v1alpha1", "trainingjobtemplates", name)
            except ApiException as exc:
                if exc.status != 404:
                    raise


@pytest.fixture
def templates(cluster: Cluster) -> Iterator[Templates]:
    made = Templates(cluster)
    yield made
    made.cleanup()


def templated(cluster: Cluster, name: str, template: str, **ref: Any) -> dict[str, Any]:
    """A short job: no image of its own (the template's), its mesh and the test's nodes."""
    manifest = job(cluster, name, templateRef={"name": template, **ref})
    del manifest["spec"]["image"], manifest["spec"]["command"]
    return manifest


def images(cluster: Cluster, job_name: str) -> set[str]:
    return {p.spec.containers[0].image for p in cluster.pods(job_name) if p.metadata.deletion_timestamp is None}


def test_a_job_naming_a_missing_template_waits_with_a_condition_then_starts(
        cluster: Cluster, templates: Templates) -> None:
    name = templates.name("later")
    cluster.apply(templated(cluster, "waits", name))
    cond = wait_for("ConfigValid=False", lambda: (c := cluster.condition("waits", "ConfigValid"))
                    and c["status"] == "False" and c)
    assert cond["reason"] == "TemplateNotFound" and f"spec.templateRef.name: TrainingJobTemplate {name!r}" in cond["message"]
    assert cluster.status("waits").get("phase", "Pending") == "Pending" and not cluster.pods("waits")
    templates.create("later", {"image": "platform/trainer:1"})
    wait_for("attempt 0 Running", lambda: cluster.running_gang("waits", 0, 2))
    assert images(cluster, "waits") == {"platform/trainer:1"}
    assert cluster.status("waits")["jobTemplate"]["name"] == name
    cluster.delete_job("waits")


def test_a_template_edit_does_not_touch_a_running_job(cluster: Cluster, templates: Templates) -> None:
    name = templates.create("pinned", {"image": "platform/trainer:1", "failurePolicy": {"maxRestarts": 3}})
    cluster.apply(templated(cluster, "pinned", name))
    before = {p.metadata.name for p in wait_for("attempt 0 Running", lambda: cluster.running_gang("pinned", 0, 2))}
    status = cluster.status("pinned")
    assert (status["jobTemplate"]["name"], status["jobTemplate"]["generation"]) == (name, 1)
    templates.patch(name, {"image": "platform/trainer:2"})
    # A pass after the edit: the job's own spec changes (no pod field), and the operator says it saw it.
    cluster.patch_spec("pinned", {"failurePolicy": {"backoffSeconds": 1}})
    generation = cluster.job("pinned")["metadata"]["generation"]
    wait_for("the job's edit observed", lambda: cluster.status("pinned").get("observedGeneration") == generation)
    status = cluster.status("pinned")
    assert status["jobTemplate"]["generation"] == 1 and status["attempt"] == 0 and status["phase"] == "Running"
    assert {p.metadata.name for p in cluster.running_gang("pinned", 0, 2) or []} == before
    assert images(cluster, "pinned") == {"platform/trainer:1"}
    cluster.delete_job("pinned")


def gone(cluster: Cluster, name: str) -> bool:
    try:
        cluster.job(name)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def test_a_fail_rule_ends_the_job_at_once_and_the_ttl_removes_it_keeping_checkpoints(
        cluster: Cluster, s3: S3Server, s3_bucket: str) -> None:
    cluster.create_secret(s3)
    store = cluster.store(s3, s3_bucket, "fatal")
    store.write_commit(100, {"tensor": 8, "pipeline": 1, "data": 2}, 10)
    cluster.apply(job(cluster, "fatal", bucket=s3_bucket, s3=s3, checkpoint={"resumePolicy": "Always"},
                      failurePolicy={"maxRestarts": 5, "rules": [
                          {"name": "bad-data", "action": "Fail",
                           "onExitCodes": {"containerName": "trainer", "values": [3]}}]}))
    gang = wait_for("attempt 0 Running", lambda: cluster.running_gang("fatal", 0, 2))
    fail_pod(cluster.kube.kubeconfig, cluster.namespace, gang[1].metadata.name, exit_code=3)
    status = cluster.wait_phase("fatal", "Failed")
    assert status["reason"] == "FailedByRule" and status["restarts"] == 0
    assert "spec.failurePolicy.rules[0] 'bad-data' (Fail) matched" in status["message"]
    assert status["lastFailure"]["exitCode"] == 3

    # Finished: a time to live set now deletes it, and its pods with it; its checkpoints stay.
    cluster.patch_spec("fatal", {"ttlSecondsAfterFinished": 0})
    wait_for("the finished job deleted", lambda: gone(cluster, "fatal"))
    wait_for("its pods deleted", lambda: not cluster.pods("fatal"))
    kept = store.latest_committed()
    assert kept is not None and kept.step == 100


def test_a_disruption_restarted_without_counting_leaves_the_budgets_untouched(cluster: Cluster) -> None:
    cluster.apply(job(cluster, "disrupted", failurePolicy={"maxInfrastructureRestarts": 0, "rules": [
        {"name": "disruptions-are-free", "action": "RestartWithoutCounting",
         "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}))
    gang = wait_for("attempt 0 Running", lambda: cluster.running_gang("disrupted", 0, 2))
    victim = gang[0].metadata.name
    core = cluster.kube.core
    core.patch_namespaced_pod(victim, cluster.namespace, {"metadata": {"finalizers": [HOLD]}})
    try:
        # The Eviction API sets DisruptionTarget and deletes the pod (held Terminating by HOLD, so
        # the operator sees the condition, as it would while a kubelet stops the containers).
        core.create_namespaced_pod_eviction(victim, cluster.namespace, client.V1Eviction(
            metadata=client.V1ObjectMeta(name=victim, namespace=cluster.namespace)))
        status = wait_for("a restart of the disrupted gang", lambda: (
            s := cluster.status("disrupted")).get("attempt", 0) >= 1 and s)
    finally:
        core.patch_namespaced_pod(victim, cluster.namespace, {"metadata": {"finalizers": None}})
    assert status["restartsByClass"] == {"application": 0, "infrastructure": 0, "uncounted": 1}
    assert status["restarts"] == 0 and status["phase"] != "Failed"
    assert status["lastFailure"]["reason"] == "PodDeleted"
    wait_for("attempt 1 Running", lambda: cluster.running_gang("disrupted", 1, 2))
    cluster.delete_job("disrupted")


def test_a_deadline_fails_the_job(cluster: Cluster) -> None:
    cluster.apply(job(cluster, "bounded", activeDeadlineSeconds=4))
    status = cluster.wait_phase("bounded", "Failed")
    assert status["reason"] == "DeadlineExceeded"
    assert "spec.activeDeadlineSeconds (4s)" in status["message"]
    wait_for("its pods deleted", lambda: not cluster.pods("bounded"))
    cluster.delete_job("bounded")
