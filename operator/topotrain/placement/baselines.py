"""Baseline placement policies, small reimplementations of documented schedulers.

None of them knows the gang's parallel structure: they place pods, in pod index
(rank) order. The benchmark scores them with the same cost model.

- spread: kube-scheduler NodeResourcesFit LeastAllocated: each pod to the node
  with the highest free fraction after placing it.
- pack: NodeResourcesFit MostAllocated: each pod to the fullest node that fits.
- bestfit: Kueue topology-aware scheduling, BestFit profile: the lowest-level
  single domain that fits with the least spare capacity, else domains in
  descending free capacity (the last one the best fit for the remainder),
  level by level; pods filled in rank order.
- random: each pod to a uniformly random node with room (seeded).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

from topotrain.placement.cost import DomainIndex
from topotrain.placement.fill import Tree, select
from topotrain.placement.request import Mesh

Baseline = Callable[[Mesh, DomainIndex], "list[int] | None"]


def bestfit_assign(mesh: Mesh, index: DomainIndex) -> list[int] | None:
    tree = Tree.build(index, mesh.request.gpus_per_pod, 1)
    chosen = select(tree, mesh.pods)
    if chosen is None:
        return None
    slots: list[int] = []
    for clique, count in chosen:
        slots.extend(unit[0] for unit in tree.take_units(clique, count))
    return slots[: mesh.pods] if len(slots) >= mesh.pods else None


def _greedy(
    mesh: Mesh, index: DomainIndex, score: Callable[[int, int], float], seed: int = 0
) -> list[int] | None:
    """Pods in order, each to the node with the lowest score(free after, allocatable); ties
    broken at random, as kube-scheduler's selectHost picks among equally scored nodes."""
    g = mesh.request.gpus_per_pod
    rng = random.Random(seed)
    free = [n.free for n in index.nodes]
    heap = [(score(free[i] - g, n.allocatable), rng.random(), i) for i, n in enumerate(index.nodes) if free[i] >= g]
    heapq.heapify(heap)
    assign: list[int] = []
    for _ in range(mesh.pods):
        if not heap:
            return None
        _, _, node = heapq.heappop(heap)
        assign.append(node)
        free[node] -= g
        if free[node] >= g:
            heapq.heappush(heap, (score(free[node] - g, index.nodes[node].allocatable), rng.random(), node))
    return assign


def spread_assign(mesh: Mesh, index: DomainIndex) -> list[int] | None:
    return _greedy(mesh, index, lambda after, alloc: -after / alloc)


def pack_assign(mesh: Mesh, index: DomainIndex) -> list[int] | None:
    return _greedy(mesh, index, lambda after, alloc: after / alloc)


def random_assign(mesh: Mesh, index: DomainIndex, seed: int = 0) -> list[int] | None:
    g = mesh.request.gpus_per_pod
    rng = random.Random(seed)
    free = [n.free for n in index.nodes]
    room = [i for i, f in enumerate(free) if f >= g]
    assign: list[int] = []
    for _ in range(mesh.pods):
        if not room:
            return None
        pick = rng.randrange(len(room))
        node = room[pick]
        free[node] -= g
        assign.append(node)
        if free[node] < g:
            room[pick] = room[-1]
            room.pop()
    return assign


BASELINES: dict[str, Baseline] = {
    "bestfit": bestfit_assign,
    "spread": spread_assign,
    "pack": pack_assign,
    "random": random_assign,
}
