"""An alpha-beta model of one training step of a TP x PP x DP gang on a placement.

Inputs are those of `cost.evaluate` (a `Mesh`, a `DomainIndex`, pod -> node position) plus
the workload (model, batch) and the GPU product; tables and assumptions are in
`steptime_tables.py`. Per micro-batch, on each rank (bf16 activations and gradients):

- compute: 6 x params x tokens FLOPs, split over the tp x pp ranks of a replica, at
  `utilisation` of the GPU's peak dense BF16;
- tensor parallel: 4 ring all-reduces of the activation A (micro-batch x seqLen x hidden) per
  layer of the stage (2 forward, 2 backward, as Megatron's layers): 2(t-1) hops of A/t;
- pipeline: the activation forward and its gradient backward between consecutive stages,
  each TP rank sending its 1/t slice on its own link;
- the bubble: (p - 1) micro-batch slots of compute + TP + PP (1F1B or GPipe alike), so a
  fraction (p - 1)/(m + p - 1) of the pipeline's time;
- data parallel, once a step: a reduce-scatter of the gradient and an all-gather of the
  parameters of the rank's shard (params / (t x pp)), each a ring over the d replicas in
  topology order (it leaves each domain it spans once): 2(d-1) hops of shard/d.

A hop costs alpha + bytes / bandwidth at the level of the innermost domain its two nodes share
(`LinkTable`); a hop that leaves a rack (or a block) also shares that domain's uplink with the
gang's other flows leaving it in the same phase (`Fabric`). All hops of a phase run at once and
the slowest sets the pace (the step is synchronous). Nothing overlaps:
step = compute + TP + PP + bubble + DP.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from topotrain.placement.cost import DomainIndex
from topotrain.placement.model import Plan
from topotrain.placement.request import GangRequest, Mesh
from topotrain.placement.steptime_tables import Assumptions, LinkTable, StepTimeError, Workload
from topotrain.placement.topology import NodeInfo

LEVEL_NAMES = ("nvlink", "rack", "block", "cross-block")
BYTES = 2  # bf16 activations, gradients and parameters on the wire
TP_ALL_REDUCES_PER_LAYER = 4  # forward: after attention and after the MLP; backward: the same two

__all__ = ["LEVEL_NAMES", "Fabric", "StepTime", "StepTimeError", "predict", "predict_plan", "ring_hops", "span_level"]


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by term; `levels` names the slowest link each kind of traffic uses."""

    compute: float
    tp: float
    pp: float
    dp: float
    bubble: float
    microbatches: float
    levels: dict[str, str] = field(default_factory=dict)
    basis: str = ""  # the workload and GPU it assumed, in words

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.pp + self.dp + self.bubble

    def as_dict(self) -> dict[str, object]:
        """The `stepTime` of `topotrain plan --output json` (seconds)."""
        return {
            "seconds": self.total, "compute": self.compute, "tensor": self.tp, "pipeline": self.pp,
            "data": self.dp, "bubble": self.bubble, "microbatches": self.microbatches,
            "levels": dict(self.levels), "basis": self.basis,
        }

    def describe(self) -> str:
        """One line: total and breakdown, with the level of the slowest link each kind of traffic
    crosses (the innermost domain its two ends share: nvlink, rack, block; else cross-block)."""
        lv = self.levels
        return (
            f"step {_ms(self.total)} = compute {_ms(self.compute)} + TP {_ms(self.tp)} ({lv.get('tensor', '-')})"
            f" + PP {_ms(self.pp)} ({lv.get('pipeline', '-')}) + bubble {_ms(self.bubble)}"
            f" + DP {_ms(self.dp)} ({lv.get('data', '-')}); {self.microbatches:g} micro-batches"
        )


def _ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def span_level(index: DomainIndex, nodes: Iterable[int]) -> int:
    """The slowest link among these nodes: 0 one NVLink domain, 1 one rack, 2 one block, 3 more."""
    members = set(nodes)
    if len({index.block[n] for n in members}) > 1:
        return 3
    if len({index.rack[n] for n in members}) > 1:
        return 2
    return 1 if len({index.clique[n] for n in members}) > 1 else 0


Hop = tuple[int, int, int]  # (from node, to node, flows: rank pairs sending at once)


class Fabric:
    """The links a placement's traffic crosses: a GPU's own (NVLink, its NIC) and the uplinks of
    its rack and block. The gang owns its GPUs' share of an uplink (the table's per-GPU figure
    x its GPUs under it, as if every other GPU there used its own share), split evenly among the
    gang's flows through it in one phase: fewer crossings, faster flows."""

    def __init__(self, index: DomainIndex, assign: Sequence[int], gpus_per_pod: int, links: LinkTable) -> None:
        self.index, self.links = index, links
        self.doms = (index.rack, index.block)
        self.gpus: tuple[Counter[int], Counter[int]] = (Counter(), Counter())  # per rack id, per block id
        for node in assign:
            self.gpus[0][index.rack[node]] += gpus_per_pod
            self.gpus[1][index.block[node]] += gpus_per_pod

    def slowest(self, hops: Sequence[Hop], size: float) -> tuple[float, int]:
        """(seconds, level) of the slowest of these simultaneous hops of `size` bytes a flow; an
        NVLink hop at least (ranks of one pod talk over NVLink)."""
        level_of = [span_level(self.index, (a, b)) for a, b, _ in hops]
        out: tuple[Counter[int], Counter[int]] = (Counter(), Counter())
        into: tuple[Counter[int], Counter[int]] = (Counter(), Counter())
        for (a, b, flows), level in zip(hops, level_of, strict=True):
            for up in range(level - 1):  # a block hop leaves its rack; a cross-block one its block too
                out[up][self.doms[up][a]] += flows
                into[up][self.doms[up][b]] += flows
        nvlink = self.links.nvlink
        worst, worst_level = nvlink.latency_s + size / nvlink.bytes_per_s, 0
        for (a, b, _), level in zip(hops, level_of, strict=True):
            bandwidth = (nvlink if level == 0 else self.links.rack).bytes_per_s
            for up in range(level - 1):
                share = (self.links.block, self.links.cross_block)[up].bytes_per_s
                for dom in (self.doms[up][a], self.doms[up][b]):
                    bandwidth = min(bandwidth, self.gpus[up][dom] * share / max(out[up][dom], into[up][dom]))
            seconds = self.links.at(level).latency_s + size / bandwidth
            if seconds > worst:
                worst, worst_level = seconds, level
        return worst, worst_level


def ring_hops(index: DomainIndex, nodes: Iterable[int], flows: int) -> list[Hop]:
    """A ring through these nodes in topology order: it leaves each domain it spans once."""
    order = sorted(set(nodes), key=lambda n: (index.block[n], index.rack[n], index.clique[n], n))
    if len(order) < 2:
        return []
    return [(a, order[(i + 1) % len(order)], flows) for i, a in enumerate(order)]


def predict(
    mesh: Mesh, index: DomainIndex, assign: Sequence[int], workload: Workload, product: str,
    assumptions: Assumptions | None = None,
) -> StepTime:
    """The step time of `mesh` with pod i on node `assign[i]` of `index`."""
    _check(mesh, index, assign)
    table = assumptions or Assumptions()
    req = mesh.request
    t, p, d = req.tensor, req.pipeline, req.data
    shape = workload.shape
    m = workload.microbatches(d)
    tokens = workload.micro_batch * workload.seq_len
    compute = 6.0 * shape.params * tokens / (t * p) / (table.peak(product) * 1e12 * table.utilisation)
    activation = float(tokens * shape.dim * BYTES)
    fabric = Fabric(index, assign, req.gpus_per_pod, table.links)
    levels: dict[str, int] = {}
    tp = pp = dp = 0.0
    if t > 1:  # a ring all-reduce: reduce-scatter + all-gather, 2(t-1) hops of activation/t
        hop, levels["tensor"] = fabric.slowest(_tp_hops(mesh, index, assign), activation / t)
        tp = TP_ALL_REDUCES_PER_LAYER * -(-shape.layers // p) * 2 * (t - 1) * hop
    if p > 1:  # forward and backward; each TP rank sends its 1/t slice
        pairs = [(assign[a], assign[b], flows) for a, b, flows in mesh.pp_pairs]
        hop, levels["pipeline"] = fabric.slowest(pairs, activation / t)
        pp = 2 * hop
    if d > 1:  # reduce-scatter + all-gather of the rank's shard, 2(d-1) hops of shard/d
        rings = [h for members, flows in mesh.dp_groups for h in ring_hops(index, (assign[i] for i in members), flows)]
        hop, levels["data"] = fabric.slowest(rings, shape.params / (t * p) * BYTES / d)
        dp = 2 * (d - 1) * hop
    return StepTime(
        compute=m * compute, tp=m * tp, pp=m * pp, dp=dp, bubble=(p - 1) * (compute + tp + pp),
        microbatches=m, levels={k: LEVEL_NAMES[v] for k, v in levels.items()},
        basis=f"model {workload.model}, seqLen {workload.seq_len}, globalBatch {workload.global_batch}, "
        f"microBatch {workload.micro_batch}; {product} at {table.utilisation:.0%} of {table.peak(product):g} "
        "dense BF16 TFLOPS",
    )


def _tp_hops(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> list[Hop]:
    """The TP rings' hops between pods: a group of t > gpusPerPod ranks is t/g consecutive pods
    (tp is the innermost dimension of both rank orders); a smaller one is inside a pod."""
    t, g = mesh.request.tensor, mesh.request.gpus_per_pod
    if t <= g:
        return []
    k = t // g
    return [h for i in range(0, mesh.pods, k) for h in ring_hops(index, assign[i:i + k], 1)]


def _check(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> None:
    if len(assign) != mesh.pods:
        raise StepTimeError(f"the placement has {len(assign)} pods; tp x pp x dp / gpusPerPod needs {mesh.pods}")
    for pod, node in enumerate(assign):
        if not 0 <= node < len(index.names):
            raise StepTimeError(f"pod {pod}: node position {node} is not in the pool's {len(index.names)} nodes")


def predict_plan(
    plan: Plan, request: GangRequest, pool: Sequence[NodeInfo], workload: Workload,
    assumptions: Assumptions | None = None,
) -> StepTime:
    """The step time of a planner's `Plan` on `pool` (the nodes of `plan.pool`)."""
    if not plan.feasible or plan.parallelism is None or not plan.assignments:
        raise StepTimeError(f"no placement to predict: {plan.reason or 'the plan places no pod'}")
    mesh = Mesh.build(request, plan.parallelism["data"])
    index = DomainIndex(pool)
    position = {name: i for i, name in enumerate(index.names)}
    assign: list[int] = []
    for pod in sorted(plan.assignments, key=lambda a: a.index):
        if pod.node not in position:
            raise StepTimeError(f"pod {pod.index}: node {pod.node} is not in pool {plan.pool}")
        assign.append(position[pod.node])
    return predict(mesh, index, assign, workload, plan.pool or "", assumptions)
