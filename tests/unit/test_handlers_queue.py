"""The job's Workload as the operator reads and writes it (controller/queue_link.py QueueLink), against an
in-memory stand-in for the API server (a unit-test fake of `Kube`'s Kueue calls)."""

from __future__ import annotations

import copy
from typing import Any

from topotrain.api.spec import TrainingJobSpec
from topotrain.controller.queue_link import QueueLink
from topotrain.placement.topology import TopologyLevels

SPEC = TrainingJobSpec.model_validate({
    "image": "trainer:1", "parallelism": {"tensor": 1, "pipeline": 1, "data": 2},
    "worker": {"gpusPerPod": 1},
})  # fmt: skip
BODY = {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1",
                     "labels": {"kueue.x-k8s.io/queue-name": "lq"}}}  # fmt: skip


class FakeKube:
    """Workloads, LocalQueues, ResourceFlavors and PriorityClasses in dicts; records patches."""

    def __init__(self) -> None:
        self.workloads: dict[str, dict[str, Any]] = {}
        self.queues = {"lq": {"spec": {"clusterQueue": "cq"}}}
        self.flavors = {"h100": {"spec": {"nodeLabels": {"pool": "h100"}}}}
        self.priorities: dict[str, int] = {}
        self.patches: list[tuple[str, dict[str, Any], bool]] = []
        self.deleted: list[tuple[str, str]] = []

    def workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.workloads.get(name)
        return copy.deepcopy(found) if found else None

    def create_workload(self, manifest: dict[str, Any]) -> dict[str, Any]:
        made = copy.deepcopy(manifest)
        made["metadata"]["uid"] = "wl-uid"
        self.workloads[made["metadata"]["name"]] = made
        return copy.deepcopy(made)

    def local_queue(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.queues.get(name)

    def resource_flavor(self, name: str) -> dict[str, Any] | None:
        return self.flavors.get(name)

    def priority_value(self, name: str) -> int | None:
        return self.priorities.get(name)

    def patch_workload(self, namespace: str, name: str, patch: dict[str, Any], status: bool = False) -> None:
        self.patches.append((name, patch, status))

    def delete_workload(self, namespace: str, name: str, uid: str) -> None:
        self.deleted.append((name, uid))
        self.workloads.pop(name, None)


def link(kube: FakeKube) -> QueueLink:
    return QueueLink(kube, ("team", "llm"), "uid-1", TopologyLevels())  # type: ignore[arg-type]


def admit(kube: FakeKube, count: int = 2, hosts: tuple[str, ...] = ("n1",)) -> None:
    wl = kube.workloads["trainingjob-llm"]
    wl["status"] = {
        "conditions": [{"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"}],
        "admission": {"clusterQueue": "cq", "podSetAssignments": [{
            "name": "workers", "flavors": {"nvidia.com/gpu": "h100"}, "count": count,
            "topologyAssignment": {"levels": ["kubernetes.io/hostname"],
                                   "domains": [{"values": [h], "count": count // len(hosts)} for h in hosts]},
        }]},
    }  # fmt: skip


def test_the_workload_is_created_once_and_the_job_waits_naming_the_cluster_queue() -> None:
    kube = FakeKube()
    view = link(kube).observe(BODY, SPEC)
    assert view is not None and not view.gate.admitted
    assert view.gate.message.startswith("waiting for Kueue admission in ClusterQueue cq")
    assert list(kube.workloads) == ["trainingjob-llm"]
    owner = kube.workloads["trainingjob-llm"]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"]) == ("TrainingJob", "uid-1")
    link(kube).observe(BODY, SPEC)
    assert len(kube.workloads) == 1


def test_an_admitted_job_gets_the_flavors_nodes_its_size_and_kueues_hosts() -> None:
    kube = FakeKube()
    link(kube).observe(BODY, SPEC)
    admit(kube)
    view = link(kube).observe(BODY, SPEC)
    assert view is not None and view.gate.admitted and not view.gate.evicted
    assert (dict(view.node_labels), view.data, dict(view.hosts or {})) == ({"pool": "h100"}, 2, {"n1": 2})


def test_a_missing_flavor_or_priority_class_keeps_the_job_waiting_and_says_which() -> None:
    kube = FakeKube()
    link(kube).observe(BODY, SPEC)
    admit(kube)
    kube.flavors.clear()
    view = link(kube).observe(BODY, SPEC)
    assert view is not None and not view.gate.admitted and "ResourceFlavor h100 does not exist" in view.gate.message
    other = FakeKube()
    spec = SPEC.model_copy(update={"worker": SPEC.worker.model_copy(update={"priority_class_name": "gone"})})
    view = link(other).observe(BODY, spec)
    assert view is not None and "PriorityClass gone does not exist" in view.gate.message and not other.workloads


def test_a_namesakes_workload_is_deleted_and_anyone_elses_left_alone() -> None:
    kube = FakeKube()
    kube.workloads["trainingjob-llm"] = {"metadata": {"name": "trainingjob-llm", "uid": "old", "ownerReferences": [
        {"kind": "TrainingJob", "name": "llm", "uid": "uid-0", "controller": True}]}}
    view = link(kube).observe(BODY, SPEC)
    assert view is not None and not view.gate.admitted and kube.deleted == [("trainingjob-llm", "old")]
    kube.workloads["trainingjob-llm"] = {"metadata": {"name": "trainingjob-llm", "uid": "x", "ownerReferences": [
        {"kind": "JobSet", "name": "llm", "uid": "js", "controller": True}]}}
    view = link(kube).observe(BODY, SPEC)
    assert view is not None and "belongs to JobSet llm" in view.gate.message
    assert "trainingjob-llm" in kube.workloads


def test_suspend_deactivates_the_workload_and_a_finished_job_creates_none() -> None:
    kube = FakeKube()
    suspended = SPEC.model_copy(update={"suspend": True})
    link(kube).observe(BODY, suspended)
    assert kube.patches == [("trainingjob-llm", {"spec": {"active": False}}, False)]
    fresh = FakeKube()
    view = link(fresh).observe(BODY, SPEC, finished=True)
    assert view is not None and view.workload is None and not fresh.workloads
    assert link(fresh).observe({"metadata": {"name": "llm"}}, SPEC) is None  # no queue label


def test_an_evicted_workload_is_released_once_and_handed_back_only_while_admitted() -> None:
    """The quota goes back in one patch: a Workload with no admission left is not written again
    (each write's Workload event woke the job for another pass that wrote it again, every ~2 s
    until Kueue readmitted the job). A hand-back evicts only a Workload still admitted."""
    kube = FakeKube()
    q = link(kube)
    q.observe(BODY, SPEC)
    admit(kube)
    view = q.observe(BODY, SPEC)
    assert view is not None and view.gate.admitted
    q.hand_back(view, "node n1 (not Ready) of Kueue's topology assignment is lost ...")
    (workload_name, patch, status), = kube.patches
    evicted = [c for c in patch["status"]["conditions"] if c["type"] == "Evicted"]
    assert workload_name == "trainingjob-llm" and status and evicted[0]["reason"] == "NodeFailures" and "n1 (not Ready)" in evicted[0]["message"]
    wl = kube.workloads["trainingjob-llm"]
    wl["status"]["conditions"] = patch["status"]["conditions"]  # as the API server applies it
    view = q.observe(BODY, SPEC)
    assert view is not None and view.gate.evicted
    q.hand_back(view, "again")
    assert len(kube.patches) == 1, "an evicted Workload is not handed back twice"
    q.release(view)
    assert len(kube.patches) == 2 and kube.patches[1][1]["status"]["admission"] is None
    wl["status"] = {**wl["status"], **kube.patches[1][1]["status"]}
    wl["status"].pop("admission")
    view = q.observe(BODY, SPEC)
    assert view is not None and view.gate.evicted
    q.release(view)
    assert len(kube.patches) == 2, "released once; nothing to give back any more"
