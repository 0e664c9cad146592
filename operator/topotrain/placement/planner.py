"""The gang planner: pool, data degree and pod -> node assignment, all or nothing.

1. Pool: the first of `gpuTypes` that fits the full data degree, else the one
   that fits the largest degree (ties: earlier in `gpuTypes`).
2. Data degree: the largest in [minData, data] whose pods fit.
3. Assignment: hierarchical best-fit choice of domains; every candidate unit
   order (rank order, stage-major, Hilbert, rack-sized tiles) filled into them,
   plus the BestFit-like baseline's own placement when it meets the hard
   constraints; the cheapest (then least fragmenting) wins and local search
   improves it; then each rack's NVLink domains of several nodes are refilled stage-major
   or in rank order where that costs no more and the step-time model predicts a faster
   step (pairing.py). Everything is deterministic: no clock, no unseeded randomness.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from topotrain.placement import fill as fill_mod
from topotrain.placement import model, orders
from topotrain.placement.baselines import bestfit_assign
from topotrain.placement.cost import CostState, DomainIndex, evaluate
from topotrain.placement.model import Plan
from topotrain.placement.pairing import faster_pairing
from topotrain.placement.reasons import capacity_reason, pods_reason, racked_reason
from topotrain.placement.request import GangRequest, Mesh
from topotrain.placement.search import FULL_NEIGHBOURHOOD, improve
from topotrain.placement.topology import Inventory, NodeInfo

SEARCH_BUDGET_LARGE = 3000
SEARCH_BUDGET_SMALL = 200_000


@dataclass
class PoolView:
    """One pool's nodes with their domain ids."""

    name: str
    index: DomainIndex

    @classmethod
    def of(cls, name: str, nodes: Sequence[NodeInfo]) -> PoolView:
        return cls(name, DomainIndex(nodes))


def plan(request: GangRequest, inventory: Inventory) -> Plan:
    """Choose pool and data degree, then place the gang."""
    pools = inventory.pools()
    wanted = list(request.gpu_types) or list(pools)
    # The common case first: the first pool that holds the gang at its full degree is planned
    # there once, optimised (a feasibility check at that degree would place the gang twice);
    # the pools after it are never indexed.
    views: dict[str, PoolView] = {}
    tried: dict[str, str] = {}
    for name in wanted:
        if name not in pools:
            continue
        view = views[name] = PoolView.of(name, pools[name])
        if request.allows(request.data) and _slots(request, view) >= request.pods(request.data):
            full = plan_in_pool(request, view, request.data)
            if full.feasible:
                return full
            tried[name] = full.reason or ""
    best: tuple[int, PoolView] | None = None
    reasons: list[str] = []
    for name in wanted:
        if name not in views:
            reasons.append(f"pool {name}: no usable node (Ready, schedulable, tolerated, matching nodeSelector)")
            continue
        view = views[name]
        degree, why = largest_degree(request, view, full_reason=tried.get(name))
        if degree is None:
            reasons.append(why)
        elif best is None or degree > best[0]:
            best = (degree, view)  # below the full degree: that was tried above
    if best is None:
        return Plan.infeasible("; ".join(reasons) or "no pool with GPUs")
    return plan_in_pool(request, best[1], best[0])


def _slots(request: GangRequest, view: PoolView) -> int:
    return sum(n.free // request.gpus_per_pod for n in view.index.nodes)


def largest_degree(request: GangRequest, view: PoolView, *,
                   full_reason: str | None = None) -> tuple[int | None, str]:
    """The largest feasible data degree in [minData, data] in this pool, or why even the
    smallest one tried does not fit. `full_reason`: the full degree was already tried (and
    did not fit, for this reason)."""
    reason = ""
    short_of_pods: int | None = None
    slots = _slots(request, view)
    for degree in range(request.data, request.lowest_data - 1, -1):
        if not request.allows(degree):
            continue
        if slots < request.pods(degree):
            short_of_pods = degree
            continue
        if degree == request.data and full_reason is not None:
            reason, short_of_pods = full_reason, None
            continue
        assign, reason = place(request, view, degree, optimise=False)
        if assign is not None:
            return degree, ""
        short_of_pods = None
    if short_of_pods is not None:
        # arithmetic: building the mesh of a gang that cannot fit would enumerate its ranks
        reason = pods_reason(view.name, view.index, request.pods(short_of_pods), request.gpus_per_pod) or ""
    if not reason:
        reason = request.rule.explain(request.lowest_data, request.data)
    return None, reason


def plan_in_pool(request: GangRequest, view: PoolView, degree: int) -> Plan:
    """Place at a fixed pool and data degree."""
    assign, why, mesh, strategy = _place_full(request, view, degree)
    if assign is None:
        return Plan.infeasible(why)
    return finish(mesh, view, assign, strategy)


def finish(mesh: Mesh, view: PoolView, assign: Sequence[int], strategy: str) -> Plan:
    return Plan(
        feasible=True,
        pool=view.name,
        parallelism=model.parallelism(mesh),
        assignments=model.assignments(mesh, view.index, assign),
        cost=evaluate(mesh, view.index, assign),
        fragmentation=model.fragmentation(mesh, view.index, assign),
        strategy=strategy,
    )


def place(request: GangRequest, view: PoolView, degree: int, *, optimise: bool) -> tuple[list[int] | None, str]:
    assign, why, _, _ = _place_full(request, view, degree, optimise=optimise)
    return assign, why


def _place_full(
    request: GangRequest, view: PoolView, degree: int, *, optimise: bool = True
) -> tuple[list[int] | None, str, Mesh, str]:
    mesh = Mesh.build(request, degree)
    assign, why, strategy = _place_mesh(mesh, view, optimise)
    if assign is None and request.tensor_topology == "Preferred" and mesh.unit_size > 1:
        loose = Mesh.build(request, degree, tp_together=False)
        assign, _, strategy = _place_mesh(loose, view, optimise)
        if assign is not None:
            return assign, "", loose, strategy + " (tensor groups split: topology.tensor=Preferred)"
    return assign, why, mesh, strategy


def _place_mesh(mesh: Mesh, view: PoolView, optimise: bool) -> tuple[list[int] | None, str, str]:
    req = mesh.request
    tree = fill_mod.Tree.build(view.index, req.gpus_per_pod, mesh.unit_size)
    units = len(mesh.tp_units)
    # Every selection reads the same untouched tree: its capacities are summed once (a
    # 50,000-node pool's cliques, once instead of five times).
    caps = tree.capacities()
    if sum(caps.clique.values()) < units:
        return None, capacity_reason(view.name, view.index, mesh), ""
    racked = any(len(g) > mesh.unit_size for g in mesh.rack_units)
    selections: list[list[tuple[int, int]] | None] = [None]
    if not racked:
        found = [fill_mod.select(tree, units, how, caps)
                 for how in fill_mod.SELECTIONS[: 1 if not optimise else None]]  # fmt: skip
        selections = [s for i, s in enumerate(found) if s is not None and s not in found[:i]]
    candidates: list[tuple[str, list[int]]] = []
    for number, chosen in enumerate(selections):
        slots = [] if chosen is None else fill_mod.unit_slots(tree, chosen)
        for name, key in orders.candidate_keys(mesh, _targets(tree, chosen)):
            order = orders.unit_order(mesh, key)
            assign = fill_mod.fill_racked(tree, mesh, order) if chosen is None else fill_mod.fill_sequence(mesh, order, slots)
            if fill_mod.placed(assign) and assign is not None:
                candidates.append((f"{name}@{number}", assign))
                if not optimise:
                    return assign, "", name
    if not candidates:
        return None, racked_reason(view.name, tree, mesh), ""
    baseline = bestfit_assign(mesh, view.index)
    if baseline is not None and meets_constraints(mesh, view.index, baseline):
        candidates.append(("bestfit", baseline))
    return _best(mesh, view, tree, candidates)


def _best(
    mesh: Mesh, view: PoolView, tree: fill_mod.Tree, candidates: list[tuple[str, list[int]]]
) -> tuple[list[int], str, str]:
    scored = sorted(
        candidates,
        key=lambda c: (evaluate(mesh, view.index, c[1]).total, _frag_key(mesh, view, c[1]), c[0]),
    )
    small = len(mesh.tp_units) * len(tree.clique_nodes) <= FULL_NEIGHBOURHOOD
    distinct: list[tuple[str, list[int]]] = []
    for name, assign in scored:
        if all(assign != other for _, other in distinct):
            distinct.append((name, assign))
    starts = distinct[:8] if small else distinct[:1]
    best_assign, best_name, best_key = scored[0][1], scored[0][0], None
    for name, assign in starts:
        left = tree.copy()
        for node in assign:
            left.slots[node] -= 1
        state = CostState(mesh, view.index, assign)
        moves = improve(mesh, left, state, SEARCH_BUDGET_SMALL if small else SEARCH_BUDGET_LARGE)
        key = (state.total, _frag_key(mesh, view, state.assign))
        if best_key is None or key < best_key:
            best_key = key
            best_assign = state.assign
            best_name = f"{name}+search({moves} moves)" if moves else name
    refilled = faster_pairing(mesh, view.index, best_assign)
    if refilled is not None:  # NVLink domains refilled (pairing.py): the strategy names how
        return refilled[0], "", f"{best_name}+domains {refilled[1]}"
    return best_assign, "", best_name


def _frag_key(mesh: Mesh, view: PoolView, assign: Sequence[int]) -> tuple[int, int]:
    frag = model.fragmentation(mesh, view.index, assign)
    return (frag.on_used_nodes, frag.in_used_racks)


def _targets(tree: fill_mod.Tree, chosen: list[tuple[int, int]] | None) -> list[int]:
    """Typical units per rack and per block of the selection (tile sizes)."""
    index = tree.index
    per_rack: dict[int, int] = {}
    per_block: dict[int, int] = {}
    if chosen:
        for clique, count in chosen:
            node = tree.clique_nodes[clique][0]
            per_rack[index.rack[node]] = per_rack.get(index.rack[node], 0) + count
            per_block[index.block[node]] = per_block.get(index.block[node], 0) + count
    else:
        for block, racks in tree.block_racks.items():
            for rack in racks:
                per_rack[rack] = tree.rack_cap(rack)
            per_block[block] = tree.block_cap(block)
    targets = [int(statistics.median(v.values())) for v in (per_rack, per_block) if v]
    return [t for t in targets if t > 1]


def meets_constraints(mesh: Mesh, index: DomainIndex, assign: Sequence[int]) -> bool:
    """Every TP unit inside one NVLink domain and every rack unit inside one rack."""
    if any(node < 0 for node in assign):
        return False
    if any(len({index.clique[assign[p]] for p in unit}) > 1 for unit in mesh.tp_units):
        return False
    return all(len({index.rack[assign[p]] for p in group}) <= 1 for group in mesh.rack_units)
