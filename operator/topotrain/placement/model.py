"""Planner outputs: `Plan`, `PodAssignment`, `Fragmentation`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from topotrain.placement.cost import Cost, DomainIndex
from topotrain.placement.request import Mesh


@dataclass(frozen=True)
class PodAssignment:
    """Pod `index` runs global ranks first..last on `node`."""

    index: int
    node: str
    ranks: tuple[int, int]


@dataclass(frozen=True)
class Fragmentation:
    """Free GPUs the gang leaves stranded: on the nodes it shares, and in the racks it uses."""

    on_used_nodes: int = 0
    in_used_racks: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"onUsedNodes": self.on_used_nodes, "inUsedRacks": self.in_used_racks}


@dataclass(frozen=True)
class Plan:
    """All or nothing: feasible with one assignment per pod, or infeasible with a reason."""

    feasible: bool
    reason: str | None = None
    pool: str | None = None
    parallelism: dict[str, int] | None = None
    assignments: tuple[PodAssignment, ...] = ()
    cost: Cost = field(default_factory=Cost)
    fragmentation: Fragmentation = field(default_factory=Fragmentation)
    strategy: str = ""

    @property
    def nodes(self) -> dict[int, str]:
        return {a.index: a.node for a in self.assignments}

    @property
    def data(self) -> int | None:
        return None if self.parallelism is None else self.parallelism["data"]

    def to_json(self) -> dict[str, Any]:
        """The `topotrain plan --output json` document."""
        return {
            "feasible": self.feasible,
            "reason": self.reason,
            "pool": self.pool,
            "parallelism": self.parallelism,
            "pods": [{"index": a.index, "node": a.node, "ranks": list(a.ranks)} for a in self.assignments],
            "cost": {**self.cost.as_dict(), "fragmentation": self.fragmentation.as_dict()} if self.feasible else {},
        }

    @classmethod
    def infeasible(cls, reason: str) -> Plan:
        return cls(feasible=False, reason=reason)


def assignments(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> tuple[PodAssignment, ...]:
    g = mesh.request.gpus_per_pod
    return tuple(
        PodAssignment(index=i, node=index.names[node], ranks=(i * g, i * g + g - 1)) for i, node in enumerate(assign)
    )


def fragmentation(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> Fragmentation:
    used: dict[int, int] = {}
    for node in assign:
        used[node] = used.get(node, 0) + mesh.request.gpus_per_pod
    racks = {index.rack[n] for n in used}
    on_nodes = sum(index.nodes[n].free - gpus for n, gpus in used.items())
    # every used node lies in one of `racks`: what those racks had free, less what the gang takes
    in_racks = sum(index.rack_free[r] for r in racks) - sum(used.values())
    return Fragmentation(on_used_nodes=on_nodes, in_used_racks=in_racks)


def parallelism(mesh: Mesh) -> dict[str, int]:
    req = mesh.request
    return {"tensor": req.tensor, "pipeline": req.pipeline, "data": req.data}
