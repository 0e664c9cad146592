"""Kueue citizenship (core/kueue_pods.py): the Workload's PodsReady condition as Kueue's own
integrations set it, and the admission checks' podSetUpdates on every pod of the gang.
The real Kueue checks both in tests/e2e/test_under_kueue.py."""

from __future__ import annotations

from typing import Any

from topotrain.api.spec import TrainingJobSpec
from topotrain.controller.queue_link import QueueView, admitted_spec
from topotrain.core.kueue_admission import QueueGate
from topotrain.core.kueue_pods import PodSetUpdate, pod_set_updates, pods_ready, pods_ready_status
from topotrain.core.manifests import JobMeta, PodPlan, pod

from tests.unit.test_handlers_queue import BODY, SPEC, FakeKube, admit, link


def workload(*conditions: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": "9", "generation": 1}, "status": {"conditions": list(conditions)}}


ADMITTED = {"type": "Admitted", "status": "True"}


def test_pods_ready_follows_the_gang_as_kueues_job_framework_does() -> None:
    assert pods_ready(workload(), running=False) is None, "nothing said before admission"
    assert pods_ready(workload(ADMITTED), running=False) == (False, "WaitForStart", "Not all pods are ready or succeeded")
    started = pods_ready(workload(ADMITTED), running=True)
    assert started is not None and started[:2] == (True, "Started")
    ready = {"type": "PodsReady", "status": "True", "reason": "Started"}
    assert pods_ready(workload(ADMITTED, ready), running=False)[:2] == (False, "WaitForRecovery")  # type: ignore[index]
    recovering = {"type": "PodsReady", "status": "False", "reason": "WaitForRecovery"}
    assert pods_ready(workload(ADMITTED, recovering), running=False)[:2] == (False, "WaitForRecovery")  # type: ignore[index]
    assert pods_ready(workload(ADMITTED, recovering), running=True)[:2] == (True, "Recovered")  # type: ignore[index]
    # Evicted and given back (no longer admitted): waiting to start again.
    assert pods_ready(workload(ready), running=False)[:2] == (False, "WaitForStart")  # type: ignore[index]


def test_the_condition_is_written_only_when_it_changes_and_onto_the_version_read() -> None:
    patch = pods_ready_status(workload(ADMITTED), True, "t1")
    assert patch is not None and patch["metadata"] == {"resourceVersion": "9"}
    conditions = patch["status"]["conditions"]
    assert conditions[0] == ADMITTED
    assert conditions[1] == {"type": "PodsReady", "status": "True", "reason": "Started", "observedGeneration": 1,
                             "message": "All pods reached readiness and the workload is running",
                             "lastTransitionTime": "t1"}
    assert pods_ready_status(workload(*conditions), True, "t2") is None
    assert pods_ready_status(workload(), False, "t2") is None


def test_queue_link_writes_pods_ready_once_per_change() -> None:
    kube = FakeKube()
    q = link(kube)
    q.observe(BODY, SPEC)
    admit(kube)
    view = q.observe(BODY, SPEC)
    assert view is not None
    q.pods_ready(view, running=True)
    (_, patch, status), = kube.patches
    assert status and patch["status"]["conditions"][-1]["reason"] == "Started"
    kube.workloads["trainingjob-llm"]["status"]["conditions"] = patch["status"]["conditions"]
    view = q.observe(BODY, SPEC)
    assert view is not None
    q.pods_ready(view, running=True)
    assert len(kube.patches) == 1


CHECKS = [
    {"name": "prov", "state": "Ready", "podSetUpdates": [
        {"name": "workers", "labels": {"prov": "req-1"}, "annotations": {"autoscaling.x-k8s.io/consume": "req-1"},
         "nodeSelector": {"pool": "provisioned"},
         "tolerations": [{"key": "provisioned", "operator": "Exists", "effect": "NoSchedule"}]},
        {"name": "launcher", "labels": {"not": "ours"}},
    ]},
    {"name": "other", "state": "Ready", "podSetUpdates": [{"name": "workers", "labels": {"team": "a"}}]},
]


def test_pod_set_updates_of_every_check_for_the_workers_pod_set() -> None:
    found = pod_set_updates({"spec": {"podSets": [{"name": "workers"}, {"name": "launcher"}]},
                             "status": {"admissionChecks": CHECKS}})
    assert dict(found.labels) == {"prov": "req-1", "team": "a"}
    assert dict(found.annotations) == {"autoscaling.x-k8s.io/consume": "req-1"}
    assert dict(found.node_selector) == {"pool": "provisioned"}
    assert list(found.tolerations) == [{"key": "provisioned", "operator": "Exists", "effect": "NoSchedule"}]
    assert not pod_set_updates({"status": {}})


def test_every_pod_of_the_gang_carries_the_updates_on_top_of_the_workers_own() -> None:
    spec = TrainingJobSpec.model_validate({
        "image": "trainer:1", "parallelism": {"data": 2}, "worker": {
            "gpusPerPod": 1, "labels": {"team": "mine", "app": "llm"}, "nodeSelector": {"zone": "z1"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}]},
    })  # fmt: skip
    update = pod_set_updates({"status": {"admissionChecks": CHECKS}})
    built = admitted_spec(spec, QueueView(QueueGate(admitted=True), updates=update))
    assert admitted_spec(spec, QueueView(QueueGate(admitted=True), updates=PodSetUpdate())) is spec
    for index in range(2):
        p = pod(JobMeta("llm", "team", "uid-1"), built, PodPlan(attempt=0, index=index, node=f"n{index}", data=2,
                                                            resume_step=None))
        labels, annotations = p["metadata"]["labels"], p["metadata"]["annotations"]
        assert labels["prov"] == "req-1" and labels["team"] == "a" and labels["app"] == "llm"
        assert annotations["autoscaling.x-k8s.io/consume"] == "req-1"
        assert p["spec"]["nodeSelector"]["pool"] == "provisioned" and p["spec"]["nodeSelector"]["zone"] == "z1"
        keys = [t.get("key") for t in p["spec"]["tolerations"]]
        assert "provisioned" in keys and "gpu" in keys
