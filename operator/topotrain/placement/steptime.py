"""An alpha-beta model of one training step of a TP x PP x DP gang on a placement.

Inputs are those of `cost.evaluate` (a `Mesh`, a `DomainIndex`, pod -> node position) plus
the workload (model, batch) and the GPU product; tables and assumptions are in
`steptime_tables.py`. Per micro-batch, on each rank (bf16 activations and gradients):

- compute: 6 x params x tokens FLOPs, split over the tp x pp ranks of a replica, at
  `utilisation` of the GPU's peak dense BF16;
- tensor parallel: 4 ring all-reduces of the activation (micro-batch x seqLen x hidden) per
  layer of the stage (2 forward, 2 backward, as Megatron's layers), each over the slowest
  link of the slowest TP group: 2(t-1) x (alpha + S / (t x bandwidth));
- pipeline: the activation forward and its gradient backward between consecutive stages,
  each TP rank sending its 1/t slice on its own link, across the slowest stage boundary;
- the bubble: (p - 1) micro-batch slots of compute + TP + PP (1F1B or GPipe alike), so a
  fraction (p - 1)/(m + p - 1) of the pipeline's time;
- data parallel, once a step and not overlapped: a reduce-scatter of the gradient and an
  all-gather of the parameters of the rank's shard (params / (t x pp)), each a ring over the
  d replicas, (d-1) x (alpha + shard / (d x bandwidth)), at the slowest link of the slowest
  DP group (the ring visits the domains it spans once each, so its slowest hop sets the pace).

Nothing else overlaps: step = compute + TP + PP + bubble + DP.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from topotrain.placement.cost import DomainIndex
from topotrain.placement.model import Plan
from topotrain.placement.request import GangRequest, Mesh
from topotrain.placement.steptime_tables import Assumptions, Link, StepTimeError, Workload
from topotrain.placement.topology import NodeInfo

LEVEL_NAMES = ("nvlink", "rack", "block", "cross-block")
BYTES = 2  # bf16 activations, gradients and parameters on the wire
TP_ALL_REDUCES_PER_LAYER = 4  # forward: after attention and after the MLP; backward: the same two

__all__ = ["LEVEL_NAMES", "StepTime", "StepTimeError", "predict", "predict_plan", "span_level"]


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


def ring_phase(size: float, ranks: int, link: Link) -> float:
    """A reduce-scatter or an all-gather of `size` bytes over a ring of `ranks`."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * (link.latency_s + size / ranks / link.bytes_per_s)


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
    levels: dict[str, int] = {}
    tp = 0.0
    if t > 1:
        levels["tensor"] = _tp_level(mesh, index, assign)
        per_stage = -(-shape.layers // p)
        all_reduce = 2 * ring_phase(activation, t, table.links.at(levels["tensor"]))
        tp = TP_ALL_REDUCES_PER_LAYER * per_stage * all_reduce
    pp = 0.0
    if p > 1:
        levels["pipeline"] = max((span_level(index, (assign[a], assign[b])) for a, b, _ in mesh.pp_pairs), default=0)
        link = table.links.at(levels["pipeline"])
        pp = 2 * (link.latency_s + activation / t / link.bytes_per_s)
    dp = 0.0
    if d > 1:
        levels["data"] = max(span_level(index, (assign[i] for i in members)) for members, _ in mesh.dp_groups)
        shard = shape.params / (t * p) * BYTES
        dp = 2 * ring_phase(shard, d, table.links.at(levels["data"]))
    return StepTime(
        compute=m * compute, tp=m * tp, pp=m * pp, dp=dp, bubble=(p - 1) * (compute + tp + pp),
        microbatches=m, levels={k: LEVEL_NAMES[v] for k, v in levels.items()},
        basis=f"model {workload.model}, seqLen {workload.seq_len}, globalBatch {workload.global_batch}, "
        f"microBatch {workload.micro_batch}; {product} at {table.utilisation:.0%} of {table.peak(product):g} "
        "dense BF16 TFLOPS",
    )


def _tp_level(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> int:
    """The slowest link inside any TP group: a group of t > gpusPerPod ranks is t/g consecutive
    pods (tp is the innermost dimension of both rank orders); a smaller one is inside a pod."""
    t, g = mesh.request.tensor, mesh.request.gpus_per_pod
    if t <= g:
        return 0
    per_group = t // g
    return max(span_level(index, assign[i:i + per_group]) for i in range(0, mesh.pods, per_group))


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
