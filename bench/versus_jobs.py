"""bench/versus.py's jobs, pure: each benchmark job as a Kueue user writes it (a JobSet), the
filler pods that fragment the fleet, and the cost model and the step-time model evaluated on
the nodes a gang got.

A JobSet gets what `topotrain.core.kueue` asks of Kueue for the same TrainingJob, as annotations
on its pod template: the gang preferred inside one block
(`kueue.x-k8s.io/podset-preferred-topology`), and the one slice layer Kueue takes
(`podset-slice-required-topology` + `podset-slice-size`) where the parallelism needs one. One
replicated Job of `pods` completions, so pod index = completion index = the rank order
`tp-pp-dp` that topotrain uses (Kueue's TAS orders JobSet pods by that index too). The
acceptable GPU products are a required node affinity; their order is the ClusterQueue's
flavor order, so a job preferring another product than the first flavor's is sent to the
LocalQueue of a ClusterQueue that tries that flavor first (`KueueQueues.queue_for`). `minData` cannot be expressed either: a JobSet's
size is fixed.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from placement import scatter
from scale_workload import GPUS_PER_POD, JobShape
from topotrain.api.spec import TrainingJobSpec
from topotrain.core.kueue import topology_request
from topotrain.placement import GangRequest, Mesh, evaluate
from topotrain.placement.cost import DomainIndex
from topotrain.placement.pairing import stage_order
from topotrain.placement.steptime import predict
from topotrain.placement.steptime_tables import Workload
from topotrain.placement.topology import Inventory, NodeInfo, TopologyLevels

from testbed.binaries import KEEP_RUNNING_LABEL
from testbed.kueue import QUEUE_LABEL
from testbed.topology import GPU_RESOURCE, PRODUCT_LABEL, TOPOLOGY_LABEL

ANNOTATIONS = {
    "required": "kueue.x-k8s.io/podset-required-topology",
    "preferred": "kueue.x-k8s.io/podset-preferred-topology",
    "podSetSliceRequiredTopology": "kueue.x-k8s.io/podset-slice-required-topology",
    "podSetSliceSize": "kueue.x-k8s.io/podset-slice-size",
}
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
FILLER_NAMESPACE = "versus-filler"
FILLER_SIZES = (1, 2, 4, 8, 8, 8, 8)  # GPUs a filler pod holds: whole nodes 4 times in 7
# What each gang is taken to train when its step time is predicted (docs/placement.md,
# "Step-time model"; the bench's jobs run no trainer): a Llama 3 shape, 4,096 tokens a sample,
# one sample a micro-batch and a fixed number of micro-batches a replica, so the global batch
# grows with the data degree (weak scaling) and every gang does the same work per GPU. The
# first (8B, 16 micro-batches) is the per-job table's; the others put more of the step on the
# links (fewer tokens a replica per step, a bigger model's gradients): the summary shows each.
STEP_SEQ_LEN = 4096
STEP_WORKLOADS = (("8B", 16), ("8B", 4), ("70B", 4), ("70B", 1))
STEP_MODEL, STEP_MICROBATCHES = STEP_WORKLOADS[0]


def step_workload(data: int, model: str = STEP_MODEL, microbatches: int = STEP_MICROBATCHES) -> Workload:
    return Workload(model, STEP_SEQ_LEN, microbatches * data, 1)


def workload_label(model: str, microbatches: int) -> str:
    return f"{model}, {microbatches} micro-batch{'es' if microbatches > 1 else ''}"


def kueue_annotations(shape: JobShape, topology: str, levels: TopologyLevels) -> dict[str, str]:
    """`topotrain.core.kueue.topology_request` of the shape's TrainingJob, as JobSet annotations."""
    spec = TrainingJobSpec.model_validate(shape.manifest("ns", topology)["spec"])
    request = topology_request(spec, levels)
    return {ANNOTATIONS[key]: str(value) for key, value in request.items()}


def jobset_manifest(
    shape: JobShape, namespace: str, topology: str, queue: str, levels: TopologyLevels,
    restart_strategy: str = "Recreate",
) -> dict[str, Any]:  # fmt: skip
    """The JobSet for `shape`: suspended, queued, `shape.pods` pods of 8 GPUs."""
    gpus = str(GPUS_PER_POD)
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": PRODUCT_LABEL,
                                "operator": "In",
                                "values": list(shape.gpu_types),
                            }
                        ]
                    }
                ]
            }
        }
    }
    container = {
        "name": "trainer",
        "image": "topotrain/trainer:bench",
        "resources": {"requests": {GPU_RESOURCE: gpus}, "limits": {GPU_RESOURCE: gpus}},
    }
    template = {
        "metadata": {
            "annotations": kueue_annotations(shape, topology, levels),
            "labels": {KEEP_RUNNING_LABEL: "true"},
        },  # KWOK: no instant completion
        "spec": {
            "restartPolicy": "Never",
            "containers": [container],
            "affinity": affinity,
            "nodeSelector": {TOPOLOGY_LABEL: topology},
        },
    }
    job = {
        "parallelism": shape.pods,
        "completions": shape.pods,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": template,
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": shape.name, "namespace": namespace,
                     "labels": {QUEUE_LABEL: queue, "bench.topotrain.io/kind": shape.kind}},
        "spec": {
            "suspend": True,
            "failurePolicy": {"maxRestarts": 5, "restartStrategy": restart_strategy},
            "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": job}}],
        },
    }  # fmt: skip


def filler_pods(nodes: Sequence[tuple[str, int]], used: float, seed: int) -> list[dict[str, Any]]:
    """Pods bound straight to nodes ((name, GPUs) pairs) holding `used` of their GPUs, in
    seeded random sizes on random nodes with room: the fragmented cluster."""
    free = dict(nodes)
    held = scatter(free, int(used * sum(free.values())), FILLER_SIZES, random.Random(seed))
    pods: list[dict[str, Any]] = []
    for i, (node, size) in enumerate(held):
        pods.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"filler-{i}", "namespace": FILLER_NAMESPACE,
                         "labels": {"app.kubernetes.io/name": "versus-filler"}},
            "spec": {"nodeName": node, "automountServiceAccountToken": False,
                     "containers": [{"name": "hold", "image": "testbed.invalid/filler:0",
                                     "resources": {"requests": {GPU_RESOURCE: str(size)},
                                                   "limits": {GPU_RESOURCE: str(size)}}}]},
        })  # fmt: skip
    return pods


@dataclass(frozen=True)
class Placed:
    """Where one gang ran: node per pod index, the cost model on those nodes and, per workload of
    STEP_WORKLOADS (its `workload_label`), the predicted seconds of one training step there and
    the bound no placement of the gang in its pool is predicted faster than (`best_step`)."""

    nodes: tuple[str, ...]
    cost: int
    rack: int
    block: int
    steps: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def step(self) -> float | None:
        """The predicted step of the first workload (the per-job table's)."""
        first = self.steps.get(workload_label(*STEP_WORKLOADS[0]))
        return first[0] if first else None


def placement_cost(
    shape: JobShape, pod_nodes: Mapping[int, str], pools: Mapping[str, list[NodeInfo]]
) -> Placed | None:
    """docs/placement.md's cost and predicted step time of the gang on `pod_nodes` (pod index ->
    node, mapped back to the fleet's topology by name), at the data degree it got; None when
    the indices are not 0..n-1 of one pool in whole replicas."""
    count = len(pod_nodes)
    per_replica = shape.tensor * shape.pipeline // GPUS_PER_POD
    if not count or count % per_replica or sorted(pod_nodes) != list(range(count)):
        return None
    product, pool = next(((product, nodes) for product, nodes in pools.items()
                          if {n.name for n in nodes} >= set(pod_nodes.values())), ("", None))  # fmt: skip
    if pool is None:
        return None
    index = DomainIndex(pool)
    position = {name: i for i, name in enumerate(index.names)}
    request = GangRequest(tensor=shape.tensor, pipeline=shape.pipeline,
                          data=count // per_replica, gpus_per_pod=GPUS_PER_POD)  # fmt: skip
    assign = [position[pod_nodes[i]] for i in range(count)]
    mesh = Mesh.build(request)
    cost = evaluate(mesh, index, assign)
    domain = max(Counter(index.clique).values())
    steps = {}
    for model, microbatches in STEP_WORKLOADS:
        workload = step_workload(request.data, model, microbatches)
        steps[workload_label(model, microbatches)] = (
            predict(mesh, index, assign, workload, product).total, best_step(mesh, workload, product, domain))
    return Placed(tuple(pod_nodes[i] for i in range(count)), cost.total, cost.rack, cost.block, steps)


def best_step(mesh: Mesh, workload: Workload, product: str, domain_nodes: int) -> float:
    """A lower bound on the predicted step of any placement of `mesh` in a pool of whole-node
    pods whose NVLink domains are `domain_nodes` nodes (1 or 2, as the bench's fleets). Every
    pod in one rack, so no hop leaves it (the model's uplinks only ever slow a hop down); the
    domains filled with consecutive pods of a replica (pipeline neighbours) or with the same
    stage of consecutive replicas (data-parallel neighbours), each term (pipeline with its
    bubble; data) taken from the faster of the two. A pipeline (data) phase runs over NVLink
    only if each of its pairs (rings) fits one domain, which one of the two fillings achieves
    whenever any placement does; no placement need achieve both at once, so the bound can be
    a little below every placement's step (tp8 pp2 dp2: 0.4 % at the 8B workload)."""
    if domain_nodes > 2:
        raise ValueError(f"best_step: NVLink domains of {domain_nodes} nodes (only 1 or 2)")
    fillings = [list(range(mesh.pods))]
    if (order := stage_order(mesh)) is not None:  # pods holding one stage each
        fillings.append([order[pod] for pod in range(mesh.pods)])
    nodes = [NodeInfo(f"n{i}", product, GPUS_PER_POD, GPUS_PER_POD, ("b", "r", f"d{i // domain_nodes}", f"n{i}"))
             for i in range(mesh.pods)]  # fmt: skip
    index = DomainIndex(nodes)
    split = [predict(mesh, index, assign, workload, product) for assign in fillings]
    return split[0].compute + min(s.tp + s.pp + s.bubble for s in split) + min(s.dp for s in split)


def fleet_pools(node_dicts: Sequence[Mapping[str, Any]]) -> dict[str, list[NodeInfo]]:
    """The fleet's nodes by pool, as the cost model indexes them. Every node with GPUs counts,
    usable or not when listed (a node that was not Ready yet, or is cordoned, is still where
    it is in the topology); free GPUs do not matter."""
    inventory = Inventory.from_snapshot(node_dicts, [], TopologyLevels())
    return replace(inventory, nodes=inventory.known).pools()
