"""Re-planning after failures: keep healthy pods, replace lost ones nearby, else re-plan.

The inventory must not count this job's own pods as using GPUs (build it with
`ignore_pods_of=<the job's pod labels>`): healthy pods are charged here, from
`current`, so their GPUs are neither lost nor double-booked.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field, replace
from typing import Literal

from topotrain.placement.cost import CostState
from topotrain.placement.fill import Tree
from topotrain.placement.model import Plan
from topotrain.placement.planner import PoolView, finish, plan
from topotrain.placement.request import GangRequest, Mesh, RequestError
from topotrain.placement.topology import Inventory

Mode = Literal["incremental", "full"]


@dataclass(frozen=True)
class RecoveryPlan:
    """How the gang comes back: `incremental` moves only `moved`; `full` re-places everything."""

    mode: Mode
    plan: Plan
    moved: tuple[int, ...] = ()
    kept: tuple[int, ...] = field(default=())

    @property
    def feasible(self) -> bool:
        return self.plan.feasible


def replan_recovery(
    request: GangRequest, inventory: Inventory, current: Mapping[int, str], lost_nodes: Set[str]
) -> RecoveryPlan:
    """Keep pods on healthy nodes; replace the others, preferring the lost node's NVLink domain, then rack."""
    if not current:
        fresh = plan(request, inventory.without(lost_nodes))
        return RecoveryPlan(mode="full", plan=fresh, moved=tuple(fresh.nodes))
    degree = _degree_of(request, len(current))
    return _recover(request, inventory, dict(current), set(lost_nodes), degree)


def plan_shrink(
    request: GangRequest, inventory: Inventory, current: Mapping[int, str], lost_nodes: Set[str], data: int
) -> RecoveryPlan:
    """Re-plan at a smaller data degree, keeping the replicas with the most healthy pods in place."""
    if not request.lowest_data <= data <= request.data or not request.allows(data):
        raise RequestError(f"cannot shrink to data={data}: outside [{request.lowest_data}, {request.data}]")
    old_degree = _degree_of(request, len(current))
    kept = _surviving_replicas(request, current, set(lost_nodes), inventory, old_degree, data)
    return _recover(request, inventory, kept, set(lost_nodes), data)


def _recover(
    request: GangRequest, inventory: Inventory, current: dict[int, str], lost: set[str], degree: int
) -> RecoveryPlan:
    req = replace(request, data=degree, min_data=degree)
    usable = inventory.without(lost)
    mesh = Mesh.build(req)
    pools = {usable.pool_of(node) for node in current.values()} - {None}
    if len(pools) == 1:
        pool = next(iter(pools))
        assert pool is not None
        result = _incremental(mesh, usable, pool, current)
        if result is not None:
            return result
    wanted = tuple(dict.fromkeys([*sorted(p for p in pools if p), *req.gpu_types]))
    full = plan(replace(req, gpu_types=wanted), usable)
    moved = tuple(i for i, a in enumerate(full.assignments) if current.get(i) != a.node)
    kept = tuple(i for i, a in enumerate(full.assignments) if current.get(i) == a.node)
    return RecoveryPlan(mode="full", plan=full, moved=moved if full.feasible else (), kept=kept)


def _incremental(mesh: Mesh, usable: Inventory, pool: str, current: Mapping[int, str]) -> RecoveryPlan | None:
    view = PoolView.of(pool, usable.known_in_pool(pool))
    position = {name: i for i, name in enumerate(view.index.names)}
    tree = Tree.build(view.index, mesh.request.gpus_per_pod, 1)
    assign = [-1] * mesh.pods
    lost: list[int] = []
    for pod in range(mesh.pods):
        node = position.get(current.get(pod, ""), -1)
        if node >= 0 and tree.slots[node] > 0 and usable.nodes.get(view.index.names[node]) is not None:
            tree.slots[node] -= 1
            assign[pod] = node
        else:
            lost.append(pod)
            assign[pod] = node  # placeholder: the lost node, when known, anchors proximity
    if not lost:
        return RecoveryPlan(mode="incremental", plan=finish(mesh, view, assign, "unchanged"), kept=tuple(range(mesh.pods)))
    anchors = {pod: assign[pod] for pod in lost}
    placeholder = next((n for n in assign if n >= 0), 0)
    state = CostState(mesh, view.index, [n if n >= 0 else placeholder for n in assign])
    lost_set = set(lost)
    for pod in lost:
        target = _best_slot(mesh, view, tree, state, pod, anchors[pod], lost_set)
        if target is None:
            return None
        tree.slots[target] -= 1
        state.move(pod, target)
        lost_set.discard(pod)
    plan_ = finish(mesh, view, state.assign, "incremental")
    kept = tuple(p for p in range(mesh.pods) if p not in anchors)
    return RecoveryPlan(mode="incremental", plan=plan_, moved=tuple(lost), kept=kept)


def _best_slot(
    mesh: Mesh, view: PoolView, tree: Tree, state: CostState, pod: int, anchor: int, unplaced: set[int]
) -> int | None:
    """The free node nearest the lost node that keeps the constraints; ties by cost, then best fit."""
    index = view.index
    placed_mates = [
        state.assign[p] for p in _mates(mesh.tp_units, pod) if p != pod and p not in unplaced
    ]
    rack_mates = [state.assign[p] for p in _mates(mesh.rack_units, pod) if p != pod and p not in unplaced]
    unit_need = sum(1 for p in _mates(mesh.tp_units, pod) if p in unplaced)
    rack_need = sum(1 for p in _mates(mesh.rack_units, pod) if p in unplaced)
    clique_room = {c: sum(tree.slots[n] for n in nodes) for c, nodes in tree.clique_nodes.items()}
    rack_room: dict[int, int] = {}
    for c, room in clique_room.items():
        rack = index.rack[tree.clique_nodes[c][0]]
        rack_room[rack] = rack_room.get(rack, 0) + room
    best: tuple[tuple[int, int, int, int], int] | None = None
    for node in range(len(index.nodes)):
        if tree.slots[node] <= 0:
            continue
        if clique_room[index.clique[node]] < unit_need or rack_room[index.rack[node]] < rack_need:
            continue
        if any(index.clique[node] != index.clique[m] for m in placed_mates):
            continue
        if any(index.rack[node] != index.rack[m] for m in rack_mates):
            continue
        near = 3 if anchor < 0 else _proximity(index.dom, node, anchor)
        before = state.assign[pod]
        delta = state.move(pod, node)
        state.move(pod, before)
        key = (near, delta, tree.slots[node], node)
        if best is None or key < best[0]:
            best = (key, node)
    return None if best is None else best[1]


def _proximity(dom: list[list[int]], node: int, anchor: int) -> int:
    for level in range(3):  # 0: same NVLink domain, 1: same rack, 2: same block
        if dom[level][node] == dom[level][anchor]:
            return level
    return 3


def _mates(groups: tuple[tuple[int, ...], ...], pod: int) -> tuple[int, ...]:
    for group in groups:
        if pod in group:
            return group
    return (pod,)


def _degree_of(request: GangRequest, pods: int) -> int:
    per_replica = request.tensor * request.pipeline
    degree, rest = divmod(pods * request.gpus_per_pod, per_replica)
    if rest or degree < 1:
        raise RequestError(f"{pods} pods of {request.gpus_per_pod} GPUs is not a whole number of replicas")
    return degree


def _surviving_replicas(
    request: GangRequest, current: Mapping[int, str], lost: set[str], inventory: Inventory, old: int, new: int
) -> dict[int, str]:
    """New pod index -> node for the `new` replicas with the most healthy pods (when pods hold whole replicas)."""
    old_pods = request.pods(old)
    if request.rank_order != "tp-pp-dp" or old_pods % old:
        return {i: n for i, n in current.items() if i < request.pods(new)}
    per = old_pods // old
    healthy = [
        sum(1 for i in range(r * per, (r + 1) * per) if current.get(i) in inventory.nodes and current.get(i) not in lost)
        for r in range(old)
    ]
    ranked = sorted(range(old), key=lambda r: (-healthy[r], r))[:new]
    out: dict[int, str] = {}
    for j, r in enumerate(sorted(ranked)):
        for offset in range(per):
            node = current.get(r * per + offset)
            if node is not None:
                out[j * per + offset] = node
    return out
