"""Which neighbours share an NVLink domain of several nodes: the planner's last step.

The cost model counts a pipeline pair split across NVLink domains and a data-parallel group
spread over one more domain alike, so on a pool whose domains hold two nodes (HGX boards
paired on one NVLink switch) it often ties between two fillings of the same nodes: pipeline
neighbours (consecutive stages of a replica) together, or data-parallel neighbours (the same
stage of consecutive replicas). The step-time model (steptime.py) does not tie: a step's
gradient reduce-scatter and all-gather move a rank's whole parameter shard, the pipeline's
sends one activation slice a micro-batch. So the planner also tries the stage-major and the
rank-order fillings of each rack's nodes (the same pods on each rack, so no rack or block
crossing changes; local search can end on a mix of the two that costs the same and is
slower) and keeps the faster when it costs no more and the step-time model predicts a faster
step than the search's for a reference workload (`REFERENCE_*`: the Llama 3 8B shape, 4,096
tokens a micro-batch, 16 micro-batches a replica; the compute is the same for every filling,
so the GPU does not matter). docs/placement.md, "Algorithm", step 6.
"""

from __future__ import annotations

from collections.abc import Sequence

from topotrain.placement.cost import DomainIndex, evaluate
from topotrain.placement.request import Mesh
from topotrain.placement.steptime import predict
from topotrain.placement.steptime_tables import Workload

REFERENCE_MODEL, REFERENCE_SEQ_LEN, REFERENCE_MICROBATCHES = "8B", 4096, 16
REFERENCE_PRODUCT = "H100-80GB"  # the compute term is the same for every filling of one pool

__all__ = [
    "REFERENCE_MICROBATCHES", "REFERENCE_MODEL", "REFERENCE_SEQ_LEN", "faster_pairing", "replica_paired",
    "stage_order", "stage_paired",
]


def stage_order(mesh: Mesh) -> dict[int, int] | None:
    """Each pod's position stage-major (a stage's pods of consecutive replicas side by side);
    None when a pod holds more than one stage."""
    stages = [p for members, _ in mesh.dp_groups for p in members]
    if sorted(stages) != list(range(mesh.pods)):
        return None
    return {pod: position for position, pod in enumerate(stages)}


def stage_paired(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> list[int] | None:
    """The same pods on each rack's same nodes, the nodes (in NVLink-domain order) filled
    stage-major. None when a pod holds more than one stage or a tensor group spans pods (the
    filling would have to keep them)."""
    order = stage_order(mesh)
    if order is None or mesh.unit_size > 1:
        return None
    return _refill(index, assign, order)


def replica_paired(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> list[int] | None:
    """The same, filled in rank order: a replica's consecutive stages side by side."""
    if mesh.unit_size > 1:
        return None
    return _refill(index, assign, {pod: pod for pod in range(mesh.pods)})


def _refill(index: DomainIndex, assign: Sequence[int], order: dict[int, int]) -> list[int]:
    pods_by_rack: dict[int, list[int]] = {}
    for pod, node in enumerate(assign):
        pods_by_rack.setdefault(index.rack[node], []).append(pod)
    out = list(assign)
    for pods in pods_by_rack.values():
        nodes = sorted((assign[p] for p in pods), key=lambda n: (index.clique[n], n))
        for pod, node in zip(sorted(pods, key=order.__getitem__), nodes, strict=True):
            out[pod] = node
    return out


def faster_pairing(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> tuple[list[int], str] | None:
    """Of the stage-major and rank-order fillings, the one with the fastest predicted step for
    the reference workload, with its name ("stage-major" or "rank-order"), when it costs no
    more than `assign` and is faster; else None."""
    if len({index.clique[n] for n in assign}) == len(set(assign)):
        return None  # no domain holds two of the gang's nodes
    cost, current = evaluate(mesh, index, assign).total, list(assign)
    named = (("stage-major", stage_paired(mesh, index, assign)), ("rank-order", replica_paired(mesh, index, assign)))
    fillings = [(name, f) for name, f in named
                if f is not None and f != current and evaluate(mesh, index, f).total <= cost]  # fmt: skip
    if not fillings:
        return None
    workload = Workload(REFERENCE_MODEL, REFERENCE_SEQ_LEN, REFERENCE_MICROBATCHES * mesh.request.data, 1)
    before = predict(mesh, index, assign, workload, REFERENCE_PRODUCT).total
    step, best = min((predict(mesh, index, f, workload, REFERENCE_PRODUCT).total, i) for i, (_, f) in enumerate(fillings))
    return (fillings[best][1], fillings[best][0]) if step < before * (1 - 1e-9) else None

