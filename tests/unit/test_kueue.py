"""A TrainingJob as a Kueue Workload (kueue.x-k8s.io/v1beta2), and Kueue's decision read back."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from topotrain.api.spec import TrainingJobSpec
from topotrain.core.kueue import topology_manifest, workload_for, workload_name
from topotrain.core.kueue_admission import (
    Admission,
    QueueGate,
    admission_of,
    admitted_data,
    assigned_hosts,
    flavor_node_labels,
    gate,
    pending_message,
    release_status,
    within_assignment,
)
from topotrain.placement.topology import Inventory, TopologyLevels

LEVELS = TopologyLevels()
BLOCK, RACK, NVLINK = LEVELS.block, LEVELS.rack, LEVELS.nvlink


def spec(tensor: int = 8, pipeline: int = 4, data: int = 16, gpus: int = 8, **kw: Any) -> TrainingJobSpec:
    par: dict[str, Any] = {"tensor": tensor, "pipeline": pipeline, "data": data}
    par.update(kw.pop("parallelism", {}))
    body: dict[str, Any] = {"image": "trainer:1", "parallelism": par, "worker": {"gpusPerPod": gpus}}
    for key, value in kw.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return TrainingJobSpec.model_validate(body)


def workload(s: TrainingJobSpec, **kw: Any) -> dict[str, Any]:
    return workload_for("llm", "team", "uid-1", s, "team-queue", kw.pop("levels", LEVELS), **kw)


def pod_set(s: TrainingJobSpec, **kw: Any) -> dict[str, Any]:
    sets = workload(s, **kw)["spec"]["podSets"]
    assert [p["name"] for p in sets] == ["workers"]
    return dict(sets[0])


# --- what Kueue is asked for ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "s", "count", "min_count", "slice_"),
    [
        # TP=8 fits one 8-GPU pod: a pod never spans nodes, so no slice; 8*4*16/8 pods.
        ("tp fits a pod", spec(parallelism={"minData": 8}), 64, 32, None),
        ("not elastic", spec(), 64, None, None),
        # ... a Required pipeline keeps each replica's 4 one-pod stages in a rack.
        ("pipeline required", spec(topology={"pipeline": "Required"}), 64, None, (RACK, 4)),
        # A Required data degree keeps each stage's 16 data replicas (16 pods) in a rack.
        ("data required", spec(topology={"data": "Required"}), 64, None, (RACK, 16)),
        # TP=4 on 2-GPU pods: each TP group is 2 pods, required in one NVLink domain.
        ("tp spans pods", spec(tensor=4, pipeline=1, data=2, gpus=2), 4, None, (NVLINK, 2)),
        ("tp spans pods, preferred", spec(tensor=4, pipeline=2, data=2, gpus=2,
                                          topology={"tensor": "Preferred"}), 8, None, None),
        # Without a TP slice, a Required pipeline groups a whole replica (4*2/2 pods).
        ("tp preferred, pipeline required",
         spec(tensor=4, pipeline=2, data=2, gpus=2,
              topology={"tensor": "Preferred", "pipeline": "Required"}), 8, None, (RACK, 4)),
        # Kueue takes one slice layer: a multi-pod TP group wins over the rack.
        ("tp slice wins", spec(tensor=16, pipeline=2, data=4, gpus=8,
                               topology={"pipeline": "Required"}), 16, None, (NVLINK, 2)),
        # Two whole pipelines fit one pod: nothing to keep together across nodes.
        ("pipeline inside a pod", spec(tensor=2, pipeline=2, data=4, gpus=8,
                                       topology={"pipeline": "Required"}), 2, None, None),
        # A 6-GPU replica on 4-GPU pods: pods share replicas, 3 pods hold two whole ones.
        ("replicas straddle pods", spec(tensor=2, pipeline=3, data=4, gpus=4,
                                        topology={"pipeline": "Required"}), 6, None, (RACK, 3)),
        # Megatron order: a replica's stages are strided pods, still 4 of them.
        ("tp-dp-pp", spec(pipeline=4, data=4, rankOrder="tp-dp-pp",
                          topology={"pipeline": "Required"}), 16, None, (RACK, 4)),
    ],
)
def test_pod_set_counts_and_topology(
    case: str, s: TrainingJobSpec, count: int, min_count: int | None, slice_: tuple[str, int] | None,
) -> None:
    ps = pod_set(s)
    assert ps["count"] == count, case
    assert ps.get("minCount") == min_count, case
    request = ps["topologyRequest"]
    assert request["preferred"] == BLOCK, case
    assert set(request) <= {"preferred", "podSetSliceRequiredTopology", "podSetSliceSize"}, case
    got = (request.get("podSetSliceRequiredTopology"), request.get("podSetSliceSize"))
    assert got == (slice_ or (None, None)), case
    if slice_:
        assert count % slice_[1] == 0, case  # Kueue splits the count into whole slices


def test_workload_is_owned_queued_and_v1beta2() -> None:
    w = workload(spec())
    assert (w["apiVersion"], w["kind"]) == ("kueue.x-k8s.io/v1beta2", "Workload")
    meta = w["metadata"]
    assert (meta["name"], meta["namespace"]) == ("trainingjob-llm", "team")
    assert meta["labels"] == {"kueue.x-k8s.io/queue-name": "team-queue"}
    assert meta["ownerReferences"] == [{
        "apiVersion": "topotrain.io/v1alpha1", "kind": "TrainingJob", "name": "llm", "uid": "uid-1",
        "controller": True, "blockOwnerDeletion": True,
    }]
    assert w["spec"]["queueName"] == "team-queue"
    assert "priorityClassRef" not in w["spec"] and "priority" not in w["spec"]


def test_pod_template_carries_what_kueue_counts_and_matches() -> None:
    s = spec(worker={
        "gpusPerPod": 8, "gpuTypes": ["H100-80GB", "A100-80GB"],
        "resources": {"requests": {"cpu": "32", "memory": "512Gi"}, "limits": {"memory": "512Gi"}},
        "nodeSelector": {"pool": "training"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    })
    pod = pod_set(s)["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "trainer:1"
    assert container["resources"] == {
        "requests": {"cpu": "32", "memory": "512Gi", "nvidia.com/gpu": "8"},
        "limits": {"memory": "512Gi", "nvidia.com/gpu": "8"},
    }
    assert pod["nodeSelector"] == {"pool": "training"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"] == [{"matchExpressions": [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100-80GB", "A100-80GB"]},
    ]}]


def test_minimal_pod_template_has_only_gpus() -> None:
    pod = pod_set(spec())["template"]["spec"]
    assert set(pod) == {"restartPolicy", "containers"}
    assert pod["containers"][0]["resources"]["requests"] == {"nvidia.com/gpu": "8"}


def test_priority_class_needs_its_value() -> None:
    s = spec(worker={"priorityClassName": "research-high"})
    w = workload(s, priority=1000)
    assert w["spec"]["priorityClassRef"] == {
        "group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "research-high"}
    assert w["spec"]["priority"] == 1000
    assert w["spec"]["podSets"][0]["template"]["spec"]["priorityClassName"] == "research-high"
    with pytest.raises(ValueError, match=r"priorityClassName 'research-high'.*priority="):
        workload(s)


def test_custom_topology_labels_are_used() -> None:
    levels = TopologyLevels(block="cloud.example/block", rack="cloud.example/rack",
                            nvlink="cloud.example/clique", product="cloud.example/gpu")
    s = spec(tensor=4, pipeline=1, data=2, gpus=2, worker={"gpusPerPod": 2, "gpuTypes": ["B200"]})
    ps = pod_set(s, levels=levels)
    assert ps["topologyRequest"]["preferred"] == "cloud.example/block"
    assert ps["topologyRequest"]["podSetSliceRequiredTopology"] == "cloud.example/clique"
    term = ps["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "cloud.example/gpu"
    manifest = topology_manifest("gpu-topology", levels)
    assert [lvl["nodeLabel"] for lvl in manifest["spec"]["levels"]] == [
        "cloud.example/block", "cloud.example/rack", "cloud.example/clique", "kubernetes.io/hostname"]


# --- names ---------------------------------------------------------------------------------


def test_long_names_are_truncated_stable_and_distinct() -> None:
    base = "pretrain-llama-70b-with-a-very-long-descriptive-name-for-the-sweep"
    first, second = workload_name(base + "-a"), workload_name(base + "-b")
    assert len(first) == 63 and len(second) == 63
    assert first == workload_name(base + "-a")  # the same job always finds its Workload
    assert first != second
    assert first.startswith("trainingjob-pretrain-llama-70b")


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        ("llm", "trainingjob-llm"),
        ("a" * 51, "trainingjob-" + "a" * 51),  # exactly 63: kept as is
    ],
)
def test_short_names_are_readable(job: str, expected: str) -> None:
    assert workload_name(job) == expected


def test_dotted_names_become_dns_labels_without_colliding() -> None:
    dotted, dashed = workload_name("llm.v2"), workload_name("llm-v2")
    assert dashed == "trainingjob-llm-v2"
    assert dotted.startswith("trainingjob-llm-v2-") and "." not in dotted
    assert dotted != dashed


# --- the Topology object -------------------------------------------------------------------


def test_topology_levels_outermost_first() -> None:
    manifest = topology_manifest("topotrain", LEVELS)
    assert (manifest["apiVersion"], manifest["kind"]) == ("kueue.x-k8s.io/v1beta2", "Topology")
    assert manifest["metadata"] == {"name": "topotrain"}
    assert manifest["spec"]["levels"] == [
        {"nodeLabel": "topology.topotrain.io/block"}, {"nodeLabel": "topology.topotrain.io/rack"},
        {"nodeLabel": "nvidia.com/gpu.clique"}, {"nodeLabel": "kubernetes.io/hostname"},
    ]


def test_topology_without_cliques_lists_the_hostname_once() -> None:
    levels = TopologyLevels(nvlink="kubernetes.io/hostname")
    labels = [lvl["nodeLabel"] for lvl in topology_manifest("t", levels)["spec"]["levels"]]
    assert labels == ["topology.topotrain.io/block", "topology.topotrain.io/rack", "kubernetes.io/hostname"]


# --- Kueue's decision read back ------------------------------------------------------------

TIME = "2026-05-04T10:00:00Z"


def condition(kind: str, status: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": TIME, "observedGeneration": 1}


def admitted(count: int | None = 64) -> dict[str, Any]:
    """A Workload as Kueue v0.17 leaves it after admitting it through TAS."""
    w = workload(spec(parallelism={"minData": 8}))
    assignment: dict[str, Any] = {
        "name": "workers",
        "flavors": {"nvidia.com/gpu": "h100-tas", "cpu": "default-flavor"},
        "resourceUsage": {"nvidia.com/gpu": str(8 * (count or 64))},
        "topologyAssignment": {
            "levels": ["kubernetes.io/hostname"],
            "slices": [{"domainCount": 2, "podCounts": {"universal": 1},
                        "valuesPerLevel": [{"individual": {"prefix": "gpu-", "roots": ["0", "1"]}}]}],
        },
    }
    if count is not None:
        assignment["count"] = count
    w["status"] = {
        "conditions": [
            condition("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue gpu-cq"),
            condition("Admitted", "True", "Admitted", "The workload is admitted"),
        ],
        "admission": {"clusterQueue": "gpu-cq", "podSetAssignments": [assignment]},
    }
    return w


def test_admitted_workload_gives_flavor_queue_and_count() -> None:
    assert admission_of(admitted()) == Admission(
        admitted=True, quota_reserved=True, cluster_queue="gpu-cq", flavors=("h100-tas",), count=64,
        evicted=False, reason="Admitted", message="The workload is admitted",
    )


@pytest.mark.parametrize(("count", "expected"), [(40, 40), (None, 64)])
def test_admitted_count(count: int | None, expected: int) -> None:
    """Partial admission gives fewer pods; an assignment without count admits the podSet's count."""
    got = admission_of(admitted(count))
    assert got is not None and got.count == expected


def test_preempted_workload_is_evicted_with_reason() -> None:
    w = admitted()
    message = ("Preempted to accommodate a workload (UID: wl-2, JobUID: job-2) due to prioritization "
               "in the ClusterQueue; preemptor path: /gpu-cq; preemptee path: /gpu-cq")
    w["status"]["conditions"] += [
        condition("Evicted", "True", "Preempted", message),
        condition("Preempted", "True", "InClusterQueue", message),
    ]
    got = admission_of(w)
    assert got is not None
    assert (got.evicted, got.reason, got.message) == (True, "Preempted", message)


def test_evicted_with_distinct_preemption_detail_keeps_both() -> None:
    w = admitted()
    w["status"]["conditions"] += [
        condition("Evicted", "True", "Preempted", "Preempted"),
        condition("Preempted", "True", "InCohortReclamation", "reclaimed by the cohort"),
    ]
    got = admission_of(w)
    assert got is not None and got.message == "Preempted; reclaimed by the cohort"


def test_pending_workload() -> None:
    w = workload(spec())
    w["status"] = {"conditions": [condition(
        "QuotaReserved", "False", "Pending",
        "couldn't assign flavors to pod set workers: insufficient unused quota for nvidia.com/gpu "
        "in flavor h100-tas, 64 more needed")]}
    got = admission_of(w)
    assert got is not None
    assert (got.admitted, got.quota_reserved, got.cluster_queue, got.flavors, got.count, got.evicted) == (
        False, False, None, (), None, False)
    assert got.reason == "Pending"
    assert pending_message(w) == (
        "waiting for Kueue admission in LocalQueue team-queue: couldn't assign flavors to pod set "
        "workers: insufficient unused quota for nvidia.com/gpu in flavor h100-tas, 64 more needed")


def test_no_status_means_no_decision_yet() -> None:
    w = workload(spec())
    assert admission_of(w) is None
    assert pending_message(w) == "waiting for Kueue admission in LocalQueue team-queue: not yet considered by Kueue"


@pytest.mark.parametrize(
    ("message", "where"),
    [
        ("ClusterQueue gpu-cq doesn't exist", "ClusterQueue gpu-cq"),
        ("ClusterQueue gpu-cq is inactive", "ClusterQueue gpu-cq"),
        ("LocalQueue team-queue doesn't exist", "LocalQueue team-queue"),
        # English, not a name:
        ("Workload is inadmissible because the ClusterQueue is stopped", "LocalQueue team-queue"),
    ],
)
def test_pending_message_names_the_queue_at_fault(message: str, where: str) -> None:
    w = workload(spec())
    w["status"] = {"conditions": [condition("QuotaReserved", "False", "Inadmissible", message)]}
    assert pending_message(w) == f"waiting for Kueue admission in {where}: {message}"


def test_reserved_but_not_admitted_says_what_is_missing() -> None:
    w = copy.deepcopy(admitted())
    w["status"]["conditions"][1] = condition(
        "Admitted", "False", "UnsatisfiedChecks", "The workload has not all checks ready")
    got = admission_of(w)
    assert got is not None and (got.admitted, got.quota_reserved) == (False, True)
    assert got.reason == "UnsatisfiedChecks"
    assert pending_message(w) == (
        "waiting for Kueue admission in ClusterQueue gpu-cq: Quota reserved in ClusterQueue gpu-cq; "
        "The workload has not all checks ready")


# --- acting on the decision ------------------------------------------------------------------


def preempted() -> dict[str, Any]:
    w = admitted()
    w["metadata"]["generation"] = 1
    w["status"]["conditions"] += [
        condition("Evicted", "True", "Preempted", "Preempted to accommodate a workload"),
        condition("Preempted", "True", "InClusterQueue", "Preempted to accommodate a workload"),
    ]
    return w


def test_gate_says_whether_the_gang_may_run_and_why() -> None:
    assert gate(admitted()) == QueueGate(
        admitted=True, message="admitted by Kueue in ClusterQueue gpu-cq (flavor h100-tas, 64 pods)")
    evicted = gate(preempted())
    assert evicted.evicted and evicted.holds and evicted.reason == "Preempted"
    assert evicted.message.startswith("evicted by Kueue from ClusterQueue gpu-cq (Preempted: ")
    waiting = gate(workload(spec()))
    assert waiting.holds and not waiting.evicted
    assert waiting.message.startswith("waiting for Kueue admission in LocalQueue team-queue")


@pytest.mark.parametrize(("pods", "data"), [(None, 16), (64, 16), (40, 10), (32, 8), (31, None)])
def test_admitted_data_is_the_largest_allowed_degree_that_fits(pods: int | None, data: int | None) -> None:
    """tp8 pp4 on 8-GPU pods: 4 pods per data replica; minData 8 (32 pods)."""
    assert admitted_data(spec(parallelism={"minData": 8}), pods) == data


def test_release_gives_back_quota_and_requeues_a_preempted_workload() -> None:
    patch = release_status(preempted(), "2026-05-04T10:05:00Z")["status"]
    assert patch["admission"] is None
    kinds = {c["type"]: c for c in patch["conditions"]}
    assert (kinds["QuotaReserved"]["status"], kinds["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert kinds["QuotaReserved"]["lastTransitionTime"] == "2026-05-04T10:05:00Z"
    assert (kinds["Admitted"]["status"], kinds["Admitted"]["reason"]) == ("False", "NoReservation")
    assert (kinds["Requeued"]["status"], kinds["Requeued"]["reason"]) == ("True", "Preempted")
    assert kinds["Evicted"]["status"] == "True", "Kueue clears Evicted when it admits again"
    assert kinds["QuotaReserved"]["observedGeneration"] == 1


def test_release_after_a_deactivation_does_not_requeue() -> None:
    w = admitted()
    w["status"]["conditions"] += [condition("Evicted", "True", "Deactivated", "The workload is deactivated")]
    kinds = {c["type"]: c for c in release_status(w, TIME)["status"]["conditions"]}
    assert kinds["Requeued"]["status"] == "False"


def test_flavor_node_labels_restrict_the_plan() -> None:
    flavor = {"metadata": {"name": "h100"}, "spec": {"nodeLabels": {"topotrain.io/pool": "h100"},
                                                     "topologyName": "gpus"}}
    assert flavor_node_labels([flavor]) == {"topotrain.io/pool": "h100"}
    assert flavor_node_labels([{"spec": {}}]) == {}


def test_pending_message_names_the_local_queues_cluster_queue_when_kueue_does_not() -> None:
    w = workload(spec())
    w["status"] = {"conditions": [condition(
        "QuotaReserved", "False", "Pending",
        "couldn't assign flavors to pod set workers: insufficient unused quota for nvidia.com/gpu "
        "in flavor h100, 2 more needed")]}
    assert pending_message(w, "gpu-cq").startswith("waiting for Kueue admission in ClusterQueue gpu-cq: ")
    assert gate(w, cluster_queue="gpu-cq").message == pending_message(w, "gpu-cq")


# --- following the topology assignment --------------------------------------------------------


def with_assignment(topology: dict[str, Any]) -> dict[str, Any]:
    w = admitted(4)
    w["status"]["admission"]["podSetAssignments"][0]["topologyAssignment"] = topology
    return w


def test_assigned_hosts_reads_the_compact_v1beta2_form() -> None:
    w = with_assignment({
        "levels": [RACK, "kubernetes.io/hostname"],
        "slices": [{"domainCount": 3, "podCounts": {"individual": [2, 1, 1]},
                    "valuesPerLevel": [{"universal": "r1"},
                                       {"individual": {"prefix": "gpu-", "roots": ["0", "1", "2"]}}]}],
    })
    assert assigned_hosts(w, "kubernetes.io/hostname") == {"gpu-0": 2, "gpu-1": 1, "gpu-2": 1}
    assert assigned_hosts(w, "kubernetes.io/other") is None


def test_assigned_hosts_reads_domains_and_stops_above_the_node() -> None:
    w = with_assignment({"levels": ["kubernetes.io/hostname"],
                         "domains": [{"values": ["a"], "count": 3}, {"values": ["b"], "count": 1}]})
    assert assigned_hosts(w, "kubernetes.io/hostname") == {"a": 3, "b": 1}
    assert assigned_hosts(with_assignment({"levels": [RACK], "domains": [{"values": ["r1"], "count": 4}]}),
                          "kubernetes.io/hostname") is None
    assert assigned_hosts(workload(spec()), "kubernetes.io/hostname") is None


def test_within_assignment_keeps_the_assigned_nodes_with_room_for_their_pods() -> None:
    inventory = Inventory.from_snapshot([
        {"metadata": {"name": n, "labels": {LEVELS.product: "H100", BLOCK: "b", RACK: "r",
                                            "kubernetes.io/hostname": n}},
         "status": {"allocatable": {"nvidia.com/gpu": "8"}, "conditions": [{"type": "Ready", "status": "True"}]}}
        for n in ("a", "b", "c")
    ], levels=LEVELS)
    cut = within_assignment(inventory, {"a": 1, "b": 3}, gpus_per_pod=2)
    assert {n: i.free for n, i in cut.nodes.items()} == {"a": 2, "b": 6}
    assert cut.excluded["c"] == "not in Kueue's topology assignment"


def test_the_kueue_example_queues_the_example_job_on_a_topology_of_our_levels() -> None:
    from pathlib import Path

    import yaml

    here = Path(__file__).resolve().parents[2] / "examples" / "kueue"
    objects = {o["kind"]: o for o in yaml.safe_load_all((here / "queues.yaml").read_text())}
    job = yaml.safe_load((here / "job.yaml").read_text())
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == objects["LocalQueue"]["metadata"]["name"]
    assert objects["Topology"]["spec"] == topology_manifest("t", LEVELS)["spec"]
    assert objects["ResourceFlavor"]["spec"]["topologyName"] == objects["Topology"]["metadata"]["name"]
