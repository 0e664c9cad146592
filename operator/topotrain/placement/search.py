"""Local improvement: relocate or swap whole units while the cost drops.

Moves keep every hard constraint: a unit always lands inside one NVLink domain
with room for all its pods, and a unit whose rack group (Required pipeline or
data) has other members never leaves their rack. Small instances search the
full neighbourhood until no move helps; large ones look only at domains near a
unit's communication partners, under a fixed evaluation budget (deterministic,
never a clock).
"""

from __future__ import annotations

from topotrain.placement.cost import CostState
from topotrain.placement.fill import Tree
from topotrain.placement.request import Mesh

FULL_NEIGHBOURHOOD = 600  # units x cliques at or below which every move is tried
NEAR_CLIQUES = 24
PAIR_NEIGHBOURHOOD = 64  # units x cliques at or below which pairs of moves are tried


class LocalSearch:
    def __init__(self, mesh: Mesh, tree: Tree, state: CostState) -> None:
        self.mesh, self.tree, self.state = mesh, tree, state
        self.index = tree.index
        self.units = mesh.tp_units
        self.clique_of_unit = [self.index.clique[state.assign[u[0]]] for u in self.units]
        self.members: dict[int, set[int]] = {}
        for u, clique in enumerate(self.clique_of_unit):
            self.members.setdefault(clique, set()).add(u)
        unit_of_pod = {p: u for u, unit in enumerate(self.units) for p in unit}
        self.unit_of_pod = unit_of_pod
        self.rack_group: list[list[int]] = [[] for _ in self.units]
        for group in mesh.rack_units:
            units = sorted({unit_of_pod[p] for p in group})
            for u in units:
                self.rack_group[u] = units
        self.clique_rack = {c: self.index.rack[nodes[0]] for c, nodes in tree.clique_nodes.items()}
        self.rack_cliques = tree.rack_cliques
        self.evals = 0

    def run(self, budget: int) -> int:
        """Improve in place; returns the number of accepted moves."""
        accepted = 0
        full = len(self.units) * len(self.tree.clique_nodes) <= FULL_NEIGHBOURHOOD
        improved = True
        while improved and self.evals < budget:
            improved = False
            for u in range(len(self.units)):
                if self.evals >= budget:
                    break
                cliques = sorted(self.tree.clique_nodes) if full else self._near(u)
                if self._try_unit(u, cliques):
                    accepted += 1
                    improved = True
        return accepted

    def _near(self, u: int) -> list[int]:
        racks: set[int] = set()
        assign, index = self.state.assign, self.index
        for pod in self.units[u]:
            for other, _ in self.state.pairs[pod]:
                racks.add(index.rack[assign[other]])
            for g in self.state.groups_of[pod]:
                racks.update(self.state.counts[g][1])
        out: list[int] = []
        for rack in sorted(racks):
            out.extend(self.rack_cliques.get(rack, []))
            if len(out) >= NEAR_CLIQUES:
                break
        return out

    def _try_unit(self, u: int, cliques: list[int]) -> bool:
        here = self.clique_of_unit[u]
        for clique in cliques:
            if clique == here or not self._may_enter(u, clique):
                continue
            if self.tree.clique_cap(clique) >= 1 and self._relocate(u, clique):
                return True
            for v in sorted(self.members.get(clique, ())):
                if self._may_enter(v, here) and self._swap(u, v):
                    return True
        return False

    def _may_enter(self, u: int, clique: int) -> bool:
        group = self.rack_group[u]
        if len(group) <= 1:
            return True
        rack = self.clique_rack[clique]
        assign = self.state.assign
        return all(self.index.rack[assign[self.units[v][0]]] == rack for v in group if v != u)

    def _relocate(self, u: int, clique: int) -> bool:
        self.evals += 1
        moved = self._apply(u, clique)
        if moved is None:
            return False
        if moved[0] < 0:
            return True
        self._undo(u, moved[1])
        return False

    def _apply(self, u: int, clique: int) -> tuple[int, list[int]] | None:
        """Relocate unit u into `clique`: (cost change, its old nodes), or None without room."""
        old_nodes = [self.state.assign[p] for p in self.units[u]]
        for node in old_nodes:
            self.tree.slots[node] += 1
        taken = self.tree.take_units(clique, 1)
        if not taken:
            for node in old_nodes:
                self.tree.slots[node] -= 1
            return None
        delta = sum(self.state.move(p, n) for p, n in zip(self.units[u], taken[0], strict=True))
        self._moved(u, clique)
        return delta, old_nodes

    def _undo(self, u: int, old_nodes: list[int]) -> None:
        for p, n in zip(self.units[u], old_nodes, strict=True):
            self.tree.slots[self.state.assign[p]] += 1
            self.state.move(p, n)
            self.tree.slots[n] -= 1
        self._moved(u, self.index.clique[old_nodes[0]])

    def pair_pass(self) -> bool:
        """Relocate two units at once (tiny gangs only): escapes single-move local optima."""
        cliques = sorted(self.tree.clique_nodes)
        for u in range(len(self.units)):
            for c1 in cliques:
                if c1 == self.clique_of_unit[u] or not self._may_enter(u, c1):
                    continue
                first = self._apply(u, c1)
                if first is None:
                    continue
                if self._second(u, first[0], cliques):
                    return True
                self._undo(u, first[1])
        return False

    def _second(self, u: int, delta: int, cliques: list[int]) -> bool:
        for v in range(len(self.units)):
            if v == u:
                continue
            for c2 in cliques:
                if c2 == self.clique_of_unit[v] or not self._may_enter(v, c2):
                    continue
                self.evals += 1
                second = self._apply(v, c2)
                if second is None:
                    continue
                if delta + second[0] < 0:
                    return True
                self._undo(v, second[1])
        return False

    def _swap(self, u: int, v: int) -> bool:
        self.evals += 1
        nodes_u = [self.state.assign[p] for p in self.units[u]]
        nodes_v = [self.state.assign[p] for p in self.units[v]]
        delta = sum(self.state.move(p, n) for p, n in zip(self.units[u], nodes_v, strict=True))
        delta += sum(self.state.move(p, n) for p, n in zip(self.units[v], nodes_u, strict=True))
        if delta < 0:
            cu, cv = self.clique_of_unit[u], self.clique_of_unit[v]
            self._moved(u, cv)
            self._moved(v, cu)
            return True
        for p, n in zip(self.units[u], nodes_u, strict=True):
            self.state.move(p, n)
        for p, n in zip(self.units[v], nodes_v, strict=True):
            self.state.move(p, n)
        return False

    def _moved(self, u: int, clique: int) -> None:
        self.members[self.clique_of_unit[u]].discard(u)
        self.members.setdefault(clique, set()).add(u)
        self.clique_of_unit[u] = clique


def improve(mesh: Mesh, tree: Tree, state: CostState, budget: int) -> int:
    """Local search on `state` (tree.slots must be the slots left after the placement)."""
    search = LocalSearch(mesh, tree, state)
    moves = search.run(budget)
    if len(search.units) * len(tree.clique_nodes) <= PAIR_NEIGHBOURHOOD:
        while search.evals < budget and search.pair_pass():
            moves += 2 + search.run(budget)
    return moves
