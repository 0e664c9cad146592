"""Baseline placement policies, small reimplementations of documented schedulers.

None of them knows the gang's parallel structure: they place pods, in pod index
(rank) order. The benchmark scores them with the same cost model.

- spread: kube-scheduler NodeResourcesFit LeastAllocated: each pod to the node
  with the highest free fraction after placing it.
- pack: NodeResourcesFit MostAllocated: each pod to the fullest node that fits.
- bestfit: Kueue topology-aware scheduling, BestFit profile: the lowest-level
  single domain that fits with the least spare capacity, else domains in
  descending free capacity (the last one the best fit for the remainder),
  level by level; pods filled in rank order. When a tensor-parallel group
  spans pods, each group is a pod-set slice required in one NVLink domain (as
  Kueue's `podset-slice-required-topology` allows), so its placements keep the
  tensor constraint.
- random: each pod to a uniformly random node with room (seeded).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

from topotrain.placement.cost import DomainIndex
from topotrain.placement.fill import Tree, fill_sequence, select, unit_slots
from topotrain.placement.request import Mesh

Baseline = Callable[[Mesh, DomainIndex], "list[int] | None"]


def bestfit_assign(mesh: Mesh, index: DomainIndex) -> list[int] | None:
    """Kueue TAS BestFit with pod-set slices of one tensor-parallel group required in one
    NVLink domain (`podset-slice-required-topology`), pods in rank order."""
    tree = Tree.build(index, mesh.request.gpus_per_pod, mesh.unit_size)
    chosen = select(tree, len(mesh.tp_units))
    if chosen is None:
        return None
    return fill_sequence(mesh, range(len(mesh.tp_units)), unit_slots(tree, chosen))


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
