"""The placement objective and its incremental form for local search.

Levels and weights: NVLink domain = 1, rack = 4, block = 16. Each pair of
pipeline neighbours (same tp and dp, stages s and s+1) adds the weight of every
level at which their nodes' domains differ; each data-parallel group (same tp
and pp) adds, per level, weight x (distinct domains it spans - 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from topotrain.placement.request import Mesh
from topotrain.placement.topology import NodeInfo

LEVELS = ("nvlink", "rack", "block")
WEIGHTS = (1, 4, 16)


class DomainIndex:
    """Integer domain ids per node for the cost model (a node list of one pool)."""

    def __init__(self, nodes: Sequence[NodeInfo]) -> None:
        self.nodes = list(nodes)
        self.names = [n.name for n in self.nodes]
        # A domain's key is its path prefix (NodeInfo.nvlink, .rack, .block), sliced here
        # without the properties' calls: a 50,000-node pool is indexed on every plan.
        paths = [n.path for n in self.nodes]
        keys: list[list[object]] = [[p[:3] for p in paths], [p[:2] for p in paths], [p[0] for p in paths]]
        self.dom: list[list[int]] = []
        for level_keys in keys:
            table: dict[object, int] = {}
            self.dom.append([table.setdefault(k, len(table)) for k in level_keys])
        self.clique, self.rack, self.block = self.dom
        self.rack_free: dict[int, int] = {}  # free GPUs per rack id
        # fill.Tree's domain structure per pod size (the index's nodes do not change)
        self.trees: dict[int, tuple[list[int], dict[int, list[int]], dict[int, list[int]], dict[int, list[int]]]] = {}
        for rack, node in zip(self.rack, self.nodes, strict=True):
            self.rack_free[rack] = self.rack_free.get(rack, 0) + node.free

    def distance(self, a: int, b: int) -> int:
        if a == b:
            return 0
        return (
            (self.clique[a] != self.clique[b]) * 1
            + (self.rack[a] != self.rack[b]) * 4
            + (self.block[a] != self.block[b]) * 16
        )


@dataclass(frozen=True)
class Cost:
    """The objective, by level and by kind of traffic."""

    nvlink: int = 0
    rack: int = 0
    block: int = 0
    pipeline: int = 0
    data: int = 0

    @property
    def total(self) -> int:
        return self.nvlink + self.rack + self.block

    def as_dict(self) -> dict[str, int]:
        return {
            "total": self.total, "nvlink": self.nvlink, "rack": self.rack, "block": self.block,
            "pipeline": self.pipeline, "data": self.data,
        }


def evaluate(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> Cost:
    """Cost of an assignment pod -> node position in `index`."""
    by_level = [0, 0, 0]
    pipeline = 0
    for a, b, mult in mesh.pp_pairs:
        na, nb = assign[a], assign[b]
        for level in range(3):
            dom = index.dom[level]
            if dom[na] != dom[nb]:
                by_level[level] += WEIGHTS[level] * mult
                pipeline += WEIGHTS[level] * mult
    data = 0
    for members, mult in mesh.dp_groups:
        for level in range(3):
            dom = index.dom[level]
            extra = len({dom[assign[p]] for p in members}) - 1
            by_level[level] += WEIGHTS[level] * extra * mult
            data += WEIGHTS[level] * extra * mult
    return Cost(nvlink=by_level[0], rack=by_level[1], block=by_level[2], pipeline=pipeline, data=data)


class CostState:
    """An assignment with per-group domain counts so that moving one pod costs O(its degree)."""

    def __init__(self, mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> None:
        self.index = index
        self.assign = list(assign)
        self.pairs: list[list[tuple[int, int]]] = [[] for _ in range(mesh.pods)]
        for a, b, mult in mesh.pp_pairs:
            self.pairs[a].append((b, mult))
            self.pairs[b].append((a, mult))
        self.groups_of: list[list[int]] = [[] for _ in range(mesh.pods)]
        self.group_mult = [mult for _, mult in mesh.dp_groups]
        self.counts: list[list[dict[int, int]]] = []
        for g, (members, _) in enumerate(mesh.dp_groups):
            per_level: list[dict[int, int]] = [{}, {}, {}]
            for p in members:
                self.groups_of[p].append(g)
                for level in range(3):
                    dom = index.dom[level][self.assign[p]]
                    per_level[level][dom] = per_level[level].get(dom, 0) + 1
            self.counts.append(per_level)
        self.total = evaluate(mesh, index, self.assign).total

    def move(self, pod: int, node: int) -> int:
        """Put `pod` on `node`; returns the change in total cost."""
        old = self.assign[pod]
        if old == node:
            return 0
        dist = self.index.distance
        delta = 0
        for other, mult in self.pairs[pod]:
            where = self.assign[other]
            delta += mult * (dist(node, where) - dist(old, where))
        dom = self.index.dom
        for g in self.groups_of[pod]:
            mult = self.group_mult[g]
            per_level = self.counts[g]
            for level in range(3):
                before, after = dom[level][old], dom[level][node]
                if before == after:
                    continue
                counts = per_level[level]
                left = counts[before] - 1
                if left:
                    counts[before] = left
                else:
                    del counts[before]
                    delta -= WEIGHTS[level] * mult
                if after in counts:
                    counts[after] += 1
                else:
                    counts[after] = 1
                    delta += WEIGHTS[level] * mult
        self.assign[pod] = node
        self.total += delta
        return delta
