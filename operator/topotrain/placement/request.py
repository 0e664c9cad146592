"""What a gang asks for (`GangRequest`) and the communication structure of its pods (`Mesh`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from topotrain.api.validation import limits_for
from topotrain.contract import RANK_ORDERS, rank_coords, rank_of
from topotrain.degrees import DataLimits, DegreeRule

if TYPE_CHECKING:
    from topotrain.api.spec import TrainingJobSpec

Requirement = Literal["Required", "Preferred"]
REQUIREMENTS = ("Required", "Preferred")


class RequestError(ValueError):
    """The gang cannot be described: names the field and the rule."""


@dataclass(frozen=True)
class GangRequest:
    """A 3D-parallel gang: degrees, pod size, acceptable pools and topology requirements."""

    tensor: int
    pipeline: int
    data: int
    gpus_per_pod: int
    min_data: int | None = None
    gpu_types: tuple[str, ...] = ()
    rank_order: str = "tp-pp-dp"
    tensor_topology: Requirement = "Required"
    pipeline_topology: Requirement = "Preferred"
    data_topology: Requirement = "Preferred"
    limits: DataLimits = field(default_factory=DataLimits)  # what the trainer needs of the data degree

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "data", "gpus_per_pod"):
            if getattr(self, name) < 1:
                raise RequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_data is not None and not 1 <= self.min_data <= self.data:
            raise RequestError(f"minData ({self.min_data}) must be in [1, data={self.data}]")
        if self.rank_order not in RANK_ORDERS:
            raise RequestError(f"rankOrder {self.rank_order!r} must be one of {RANK_ORDERS}")
        if self.gpus_per_pod % self.tensor and self.tensor % self.gpus_per_pod:
            raise RequestError(
                f"tensor ({self.tensor}) must divide gpusPerPod ({self.gpus_per_pod}) or be a multiple of it"
            )
        for dim in ("tensor", "pipeline", "data"):
            if getattr(self, f"{dim}_topology") not in REQUIREMENTS:
                raise RequestError(f"topology.{dim} must be Required or Preferred")

    @property
    def lowest_data(self) -> int:
        return self.data if self.min_data is None else self.min_data

    def pods(self, data: int | None = None) -> int:
        return self.tensor * self.pipeline * (self.data if data is None else data) // self.gpus_per_pod

    def whole_replicas(self, pods: int) -> bool:
        """`pods` pods hold a whole, non-zero number of model replicas."""
        gpus, per_replica = pods * self.gpus_per_pod, self.tensor * self.pipeline
        return gpus >= per_replica and gpus % per_replica == 0

    def fits_pods(self, data: int) -> bool:
        """Whole pods at this data degree."""
        return (self.tensor * self.pipeline * data) % self.gpus_per_pod == 0

    @property
    def rule(self) -> DegreeRule:
        return DegreeRule(self.tensor, self.pipeline, self.gpus_per_pod, self.limits)

    def allows(self, data: int) -> bool:
        """An allowed data degree (topotrain.degrees): whole pods and what the trainer needs."""
        return self.rule.allows(data)

    def at_data(self, data: int) -> GangRequest:
        return replace(self, data=data, min_data=min(self.lowest_data, data))

    @classmethod
    def from_spec(cls, spec: TrainingJobSpec) -> GangRequest:
        """From the validated API model."""
        par, worker, topo = spec.parallelism, spec.worker, spec.topology
        return cls(
            tensor=par.tensor,
            pipeline=par.pipeline,
            data=par.data,
            min_data=par.min_data,
            gpus_per_pod=worker.gpus_per_pod,
            gpu_types=tuple(worker.gpu_types),
            rank_order=spec.rank_order,
            tensor_topology=topo.tensor,
            pipeline_topology=topo.pipeline,
            data_topology=topo.data,
            limits=limits_for(spec),
        )

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> GangRequest:
        """From a camelCase TrainingJob `spec` dict (validated through the API model)."""
        from topotrain.api.spec import TrainingJobSpec

        return cls.from_spec(TrainingJobSpec.model_validate(dict(spec)))


@dataclass(frozen=True)
class Mesh:
    """Pods of a gang at one data degree and who talks to whom.

    pp_pairs: (pod a, pod b, multiplicity) for pipeline neighbours on different pods;
    dp_groups: (distinct pods, multiplicity) for data-parallel groups;
    tp_units: pods that must share one NVLink domain (a tensor-parallel group);
    rack_units: tp units that must share one rack (Required pipeline/data).
    """

    request: GangRequest
    pods: int
    coords: tuple[tuple[int, int], ...]
    pp_pairs: tuple[tuple[int, int, int], ...]
    dp_groups: tuple[tuple[tuple[int, ...], int], ...]
    tp_units: tuple[tuple[int, ...], ...]
    rack_units: tuple[tuple[int, ...], ...]

    @property
    def unit_size(self) -> int:
        return len(self.tp_units[0])

    @classmethod
    def build(cls, request: GangRequest, data: int | None = None, *, tp_together: bool = True) -> Mesh:
        req = request if data is None else request.at_data(data)
        t, p, d, g = req.tensor, req.pipeline, req.data, req.gpus_per_pod
        if not req.fits_pods(d):
            raise RequestError(f"gpusPerPod ({g}) must divide tensor*pipeline*data ({t * p * d})")
        order = req.rank_order
        pods = t * p * d // g
        coords = tuple(rank_coords(i * g, t, p, d, order)[1:] for i in range(pods))
        pairs: Counter[tuple[int, int]] = Counter()
        groups: Counter[tuple[int, ...]] = Counter()
        for tp in range(t):
            for dp in range(d):
                prev = rank_of(tp, 0, dp, t, p, d, order) // g
                for pp in range(1, p):
                    cur = rank_of(tp, pp, dp, t, p, d, order) // g
                    if cur != prev:
                        pairs[(min(prev, cur), max(prev, cur))] += 1
                    prev = cur
            for pp in range(p):
                members = {rank_of(tp, pp, dp, t, p, d, order) // g for dp in range(d)}
                groups[tuple(sorted(members))] += 1
        union = _UnionFind(pods)
        if tp_together:
            for first in range(0, t * p * d, t):
                union.join_all(range(first // g, (first + t - 1) // g + 1))
        tp_units = union.groups()
        if req.pipeline_topology == "Required":
            for tp in range(t):
                for dp in range(d):
                    union.join_all(rank_of(tp, pp, dp, t, p, d, order) // g for pp in range(p))
        if req.data_topology == "Required":
            for group in groups:
                union.join_all(group)
        return cls(
            request=req,
            pods=pods,
            coords=coords,
            pp_pairs=tuple((a, b, m) for (a, b), m in sorted(pairs.items())),
            dp_groups=tuple(sorted(groups.items())),
            tp_units=tp_units,
            rack_units=union.groups(),
        )


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join_all(self, items: Any) -> None:
        it = iter(items)
        first = next(it, None)
        if first is None:
            return
        root = self.find(first)
        for item in it:
            other = self.find(item)
            if other != root:
                self.parent[max(other, root)] = min(other, root)
                root = min(other, root)

    def groups(self) -> tuple[tuple[int, ...], ...]:
        out: dict[int, list[int]] = {}
        for x in range(len(self.parent)):
            out.setdefault(self.find(x), []).append(x)
        return tuple(tuple(v) for _, v in sorted(out.items()))
