"""Domain selection (hierarchical best fit) and filling units into the chosen domains.

A *unit* is one tensor-parallel group's pods (or one pod when a pod holds whole
TP groups); it needs `k` pod slots inside one NVLink domain. Capacities below
are counted in units, so every selection is feasible for the TP constraint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from topotrain.placement.cost import DomainIndex
from topotrain.placement.request import Mesh


@dataclass
class Tree:
    """The pool's domain tree with free pod slots per node."""

    index: DomainIndex
    slots: list[int]
    k: int
    clique_nodes: dict[int, list[int]]
    rack_cliques: dict[int, list[int]]
    block_racks: dict[int, list[int]]

    @classmethod
    def build(cls, index: DomainIndex, gpus_per_pod: int, k: int) -> Tree:
        slots = [n.free // gpus_per_pod for n in index.nodes]
        clique_nodes: dict[int, list[int]] = {}
        rack_cliques: dict[int, list[int]] = {}
        block_racks: dict[int, list[int]] = {}
        for node in range(len(index.nodes)):
            clique, rack, block = index.clique[node], index.rack[node], index.block[node]
            if clique not in clique_nodes:
                rack_cliques.setdefault(rack, []).append(clique)
            clique_nodes.setdefault(clique, []).append(node)
            if rack not in block_racks.setdefault(block, []):
                block_racks[block].append(rack)
        for nodes in clique_nodes.values():
            nodes.sort(key=lambda n: (slots[n], n))  # best fit among hosts
        return cls(index, slots, k, clique_nodes, rack_cliques, block_racks)

    def clique_cap(self, clique: int) -> int:
        return sum(self.slots[n] for n in self.clique_nodes[clique]) // self.k

    def rack_cap(self, rack: int) -> int:
        return sum(self.clique_cap(c) for c in self.rack_cliques[rack])

    def block_cap(self, block: int) -> int:
        return sum(self.rack_cap(r) for r in self.block_racks[block])

    def total_cap(self) -> int:
        return sum(self.block_cap(b) for b in self.block_racks)

    def take_units(self, clique: int, count: int) -> list[list[int]]:
        """Reserve `count` units in a clique: each a list of k nodes (one per pod)."""
        units: list[list[int]] = []
        current: list[int] = []
        for node in self.clique_nodes[clique]:
            while self.slots[node] > 0 and len(units) < count:
                self.slots[node] -= 1
                current.append(node)
                if len(current) == self.k:
                    units.append(current)
                    current = []
        for node in current:  # a partial unit is never used: give its slots back
            self.slots[node] += 1
        return units

    def copy(self) -> Tree:
        return Tree(self.index, list(self.slots), self.k, self.clique_nodes, self.rack_cliques, self.block_racks)


def pick(children: Sequence[int], cap: Callable[[int], int], need: int) -> list[tuple[int, int]] | None:
    """Kueue-style best fit: the smallest child that fits, else fewest children (largest first,
    the last one the best fit for the remainder)."""
    caps = {c: cap(c) for c in children}
    fitting = [c for c in children if caps[c] >= need]
    if fitting:
        return [(min(fitting, key=lambda c: (caps[c], c)), need)]
    chosen: list[tuple[int, int]] = []
    used: set[int] = set()
    remaining = need
    for child in sorted(children, key=lambda c: (-caps[c], c)):
        if caps[child] <= 0:
            break
        if caps[child] >= remaining:
            tail = min((c for c in children if c not in used and caps[c] >= remaining), key=lambda c: (caps[c], c))
            chosen.append((tail, remaining))
            return chosen
        chosen.append((child, caps[child]))
        used.add(child)
        remaining -= caps[child]
    return None


def select(tree: Tree, need: int) -> list[tuple[int, int]] | None:
    """Ordered (clique, units) covering `need` units with the fewest, best-fitting domains."""
    out: list[tuple[int, int]] = []
    blocks = pick(list(tree.block_racks), tree.block_cap, need)
    if blocks is None:
        return None
    for block, in_block in blocks:
        for rack, in_rack in pick(tree.block_racks[block], tree.rack_cap, in_block) or []:
            out.extend(pick(tree.rack_cliques[rack], tree.clique_cap, in_rack) or [])
    return out


def fill_sequence(tree: Tree, mesh: Mesh, order: Sequence[int], chosen: list[tuple[int, int]]) -> list[int] | None:
    """Units in `order` into the chosen cliques in sequence: pod -> node."""
    work = tree.copy()
    slots: list[list[int]] = []
    for clique, count in chosen:
        slots.extend(work.take_units(clique, count))
    if len(slots) < len(order):
        return None
    assign = [-1] * mesh.pods
    for unit, nodes in zip(order, slots, strict=False):
        for pod, node in zip(mesh.tp_units[unit], nodes, strict=True):
            assign[pod] = node
    return assign


def fill_racked(tree: Tree, mesh: Mesh, order: Sequence[int]) -> list[int] | None:
    """Required pipeline/data: each rack unit into one rack, best fit, racks of used blocks first."""
    work = tree.copy()
    unit_of_pod = {unit[0]: u for u, unit in enumerate(mesh.tp_units)}
    position = {u: i for i, u in enumerate(order)}
    groups = sorted(
        ([unit_of_pod[p] for p in group if p in unit_of_pod] for group in mesh.rack_units),
        key=lambda units: min(position[u] for u in units),
    )
    rack_block = {r: b for b, racks in work.block_racks.items() for r in racks}
    open_racks: set[int] = set()
    open_blocks: set[int] = set()
    assign = [-1] * mesh.pods
    for units in groups:
        units.sort(key=lambda u: position[u])
        caps = {r: work.rack_cap(r) for r in rack_block}
        fitting = [r for r in caps if caps[r] >= len(units)]
        if not fitting:
            return None
        rack = min(fitting, key=lambda r: (r not in open_racks, rack_block[r] not in open_blocks, caps[r], r))
        open_racks.add(rack)
        open_blocks.add(rack_block[rack])
        slots: list[list[int]] = []
        for clique in work.rack_cliques[rack]:
            slots.extend(work.take_units(clique, len(units) - len(slots)))
        for unit, nodes in zip(units, slots, strict=True):
            for pod, node in zip(mesh.tp_units[unit], nodes, strict=True):
                assign[pod] = node
    return assign


def placed(assign: Sequence[int] | None) -> bool:
    return assign is not None and all(node >= 0 for node in assign)
