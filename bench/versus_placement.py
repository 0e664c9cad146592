"""bench/versus.py's placement phase: each system places each job alone on the same
fragmented fleet, so the two placements of an instance see exactly the same free GPUs.

An instance is (a filler seed, one job shape). For each filler seed the filler pods are
replaced by that seed's; then, per shape, one job at a time with nothing else of either
system on the fleet:

- topotrain: the TrainingJob applied with the operator running, its pods all Running read
  as pod index -> node, the job deleted and its pods gone;
- Kueue TAS: a Workload with the podSet the JobSet of bench/versus_jobs.py produces (the
  same pod template, count and topology request), its admission's `topologyAssignment`
  read as nodes in assignment order (= rank order: Kueue's TAS gives JobSet pods the
  domains in that order by completion index), the Workload deleted.

Both costs come from the cost model of docs/placement.md, and both predicted step times from its
step-time model, on the nodes each system chose (`versus_jobs.placement_cost` maps Kueue's node
names back to the fleet's topology).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kubernetes import client
from scale_runner import OperatorRun, install_crd, make_namespace, remove_namespace
from scale_workload import JobShape
from topotrain.core.kueue import KUEUE_API_VERSION
from topotrain.core.manifests import INDEX_LABEL, JOB_LABEL
from versus_bench import Bench
from versus_jobs import FILLER_NAMESPACE, Placed, filler_pods, jobset_manifest, placement_cost
from versus_recovery import run_recovery
from versus_results import Instance, PlacementResult
from versus_watch import gang_running, pod_views

from testbed.kueue import QUEUE_LABEL, KueueStack
from testbed.kueue_queues import assigned_domains
from testbed.topology import HOSTNAME_LABEL

TOPOTRAIN_NAMESPACE = "versus-place-topotrain"
KUEUE_NAMESPACE = "versus-place-kueue"
GROUP, VERSION, PLURAL = "topotrain.io", "v1alpha1", "trainingjobs"


def _wait(check: Callable[[], Any], timeout: float, interval: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def workload_manifest(jobset: dict[str, Any], queue: str) -> dict[str, Any]:
    """The Workload Kueue's JobSet integration makes of `jobset`'s one replicated Job: one
    podSet of `parallelism` pods, the pod template, the topology request of its annotations."""
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    template = job["template"]
    annotations = template["metadata"].get("annotations") or {}
    request: dict[str, Any] = {}
    for key, value in annotations.items():
        field_name = {
            "kueue.x-k8s.io/podset-required-topology": "required",
            "kueue.x-k8s.io/podset-preferred-topology": "preferred",
            "kueue.x-k8s.io/podset-slice-required-topology": "podSetSliceRequiredTopology",
            "kueue.x-k8s.io/podset-slice-size": "podSetSliceSize",
        }.get(key)
        if field_name:
            request[field_name] = int(value) if field_name == "podSetSliceSize" else value
    request["podIndexLabel"] = "batch.kubernetes.io/job-completion-index"
    meta = jobset["metadata"]
    return {
        "apiVersion": KUEUE_API_VERSION, "kind": "Workload",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                     "labels": {QUEUE_LABEL: queue}},
        "spec": {"queueName": queue, "podSets": [{
            "name": "workers", "count": int(job["parallelism"]),
            "template": {"metadata": {"labels": dict(template["metadata"].get("labels") or {})},
                         "spec": template["spec"]},
            "topologyRequest": request,
        }]},
    }  # fmt: skip


def assignment_nodes(workload: dict[str, Any]) -> list[str] | None:
    """The nodes of the admission's topology assignment, one per pod, in assignment order."""
    admission = (workload.get("status") or {}).get("admission") or {}
    for assignment in admission.get("podSetAssignments") or []:
        topology = assignment.get("topologyAssignment") or {}
        levels = list(topology.get("levels") or [])
        if HOSTNAME_LABEL not in levels:
            continue
        at = levels.index(HOSTNAME_LABEL)
        return [values[at] for values, pods in assigned_domains(topology) for _ in range(pods)]
    return None


class Placer:
    def __init__(self, bench: Bench, instance_timeout: float,
                 make_job: Callable[..., dict[str, Any]]) -> None:  # fmt: skip
        self.bench, self.make_job = bench, make_job
        self.custom = client.CustomObjectsApi(bench.api)
        self.core = bench.core
        self.timeout = instance_timeout

    # --- fillers ---
    def set_fillers(self, pods: Sequence[dict[str, Any]]) -> None:
        self.core.delete_collection_namespaced_pod(FILLER_NAMESPACE, grace_period_seconds=0)
        _wait(lambda: not self.core.list_namespaced_pod(FILLER_NAMESPACE).items, 120, 0.5)
        self.bench.create_pods(pods)
        _wait(lambda: len(self.core.list_namespaced_pod(FILLER_NAMESPACE).items) >= len(pods),
              60, 0.5)  # fmt: skip
        time.sleep(3.0)  # both systems' informers see the new fillers

    # --- topotrain ---
    def topotrain(self, shape: JobShape) -> tuple[Placed | None, str]:
        name = shape.name
        body = self.make_job(shape, self.bench.name, TOPOTRAIN_NAMESPACE)
        self.custom.create_namespaced_custom_object(GROUP, VERSION, TOPOTRAIN_NAMESPACE, PLURAL,
                                                    body)  # fmt: skip
        least = self.bench.least[name]

        def running() -> dict[int, str] | None:
            pods = self.core.list_namespaced_pod(
                TOPOTRAIN_NAMESPACE, label_selector=f"{JOB_LABEL}={name}"
            ).items
            views = pod_views(pods, JOB_LABEL, INDEX_LABEL)
            return gang_running(views, least) if views else None

        nodes = _wait(running, self.timeout)
        note = ""
        if nodes is None:
            job = self.custom.get_namespaced_custom_object(GROUP, VERSION, TOPOTRAIN_NAMESPACE,
                                                           PLURAL, name)  # fmt: skip
            status = job.get("status") or {}
            note = str(status.get("message") or status.get("phase") or "not Running")[:160]
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, TOPOTRAIN_NAMESPACE, PLURAL,
                                                    name)  # fmt: skip
        _wait(lambda: not self.core.list_namespaced_pod(
            TOPOTRAIN_NAMESPACE, label_selector=f"{JOB_LABEL}={name}").items, 120)  # fmt: skip
        if nodes is None:
            return None, note
        placed = placement_cost(shape, nodes, self.bench.pools)
        return placed, "" if placed else f"pods on {sorted(set(nodes.values()))[:3]}..."

    # --- Kueue ---
    def kueue(self, shape: JobShape, queue: str, levels: Any) -> tuple[Placed | None, str]:
        jobset = jobset_manifest(shape, KUEUE_NAMESPACE, self.bench.name, queue, levels)
        body = workload_manifest(jobset, queue)
        args = ("kueue.x-k8s.io", KUEUE_API_VERSION.split("/")[1], KUEUE_NAMESPACE, "workloads")
        self.custom.create_namespaced_custom_object(*args, body)
        name = shape.name

        def admitted() -> dict[str, Any] | None:
            workload = self.custom.get_namespaced_custom_object(*args, name)
            return workload if (workload.get("status") or {}).get("admission") else None

        workload = _wait(admitted, self.timeout)
        note = ""
        if workload is None:
            last = self.custom.get_namespaced_custom_object(*args, name)
            conditions = (last.get("status") or {}).get("conditions") or []
            note = "; ".join(f"{c.get('reason')}: {c.get('message')}" for c in conditions)[:200]
        self.custom.delete_namespaced_custom_object(*args, name)
        _wait(lambda: not any(w["metadata"]["name"] == name for w in
                              self.custom.list_namespaced_custom_object(*args)["items"]), 60)  # fmt: skip
        time.sleep(0.5)
        if workload is None:
            return None, note or "not admitted"
        nodes = assignment_nodes(workload)
        if nodes is None:
            return None, "no node-level topology assignment"
        placed = placement_cost(shape, dict(enumerate(nodes)), self.bench.pools)
        return placed, "" if placed else "nodes outside one pool"


def run_placement(bench: Bench, seeds: int, instance_timeout: float,
                  make_job: Callable[..., dict[str, Any]],
                  recovery_timeout: float | None = None) -> PlacementResult:  # fmt: skip
    """Every (filler seed, job shape) instance, placed by each system alone; the stream's
    fillers (seed `bench.args.seed`) are on the fleet again at the end. With
    `recovery_timeout`, then the recovery phase (bench/versus_recovery.py) on those fillers:
    the stream's largest job alone under each system, a node of it lost."""
    start = time.monotonic()
    result = PlacementResult()
    base = bench.args.seed
    order = [base + k for k in range(1, seeds)] + [base]
    gpus = [(n.name, n.allocatable) for pool in bench.pools.values() for n in pool]
    placer = Placer(bench, instance_timeout, make_job)
    install_crd(bench.api)
    make_namespace(bench.api, TOPOTRAIN_NAMESPACE)
    make_namespace(bench.api, KUEUE_NAMESPACE)
    operator = OperatorRun(bench.bed, f"{TOPOTRAIN_NAMESPACE},{FILLER_NAMESPACE}", None, bench.args.pod_binding)
    stack = KueueStack(bench.bed, jobset=True)
    try:
        operator.start(timeout=300, listed=bench.listed())
        stack.start()
        queues = bench.queues(KUEUE_NAMESPACE)
        stack.apply(queues.manifests())
        for cluster_queue in queues.cluster_queues:
            stack.wait_cluster_queue_active(cluster_queue)
        for seed in order:
            if seed != base or len(order) > 1:
                placer.set_fillers(filler_pods(gpus, bench.args.used, seed))
            print(f"[placement] filler seed {seed}", file=sys.stderr, flush=True)
            for shape in bench.shapes:
                inst = Instance(seed, shape)
                inst.ours, inst.ours_note = placer.topotrain(shape)
                inst.theirs, inst.theirs_note = placer.kueue(
                    shape, queues.queue_for(shape.gpu_types), queues.levels
                )
                result.instances.append(inst)
            result.seeds.append(seed)
        result.seconds = time.monotonic() - start
        if recovery_timeout is not None and bench.shapes:
            began = time.monotonic()
            shape = max(bench.shapes, key=lambda s: s.pods)
            result.recovery = run_recovery(bench, shape, recovery_timeout, TOPOTRAIN_NAMESPACE,
                                           KUEUE_NAMESPACE, queues, make_job)  # fmt: skip
            result.recovery_seconds = time.monotonic() - began
    finally:
        operator.stop()
        with contextlib.suppress(Exception):
            remove_namespace(bench.api, TOPOTRAIN_NAMESPACE)
        with contextlib.suppress(client.ApiException):
            bench.core.delete_namespace(KUEUE_NAMESPACE)
        stack.stop()
    return result
