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
        """The tree of `index` for pods of `gpus_per_pod` GPUs in units of `k` pods. The domain
        structure is built once per index and pod size (a plan builds several trees of one pool);
        each tree gets slots of its own."""
        cached = index.trees.get(gpus_per_pod)
        if cached is None:
            cached = cls._structure(index, gpus_per_pod)
            index.trees[gpus_per_pod] = cached
        slots, clique_nodes, rack_cliques, block_racks = cached
        return cls(index, list(slots), k, clique_nodes, rack_cliques, block_racks)

    @staticmethod
    def _structure(
        index: DomainIndex, gpus_per_pod: int
    ) -> tuple[list[int], dict[int, list[int]], dict[int, list[int]], dict[int, list[int]]]:
        slots = [n.free // gpus_per_pod for n in index.nodes]
        clique_nodes: dict[int, list[int]] = {}
        rack_cliques: dict[int, list[int]] = {}
        block_racks: dict[int, list[int]] = {}
        racks_seen: set[int] = set()  # a rack lies in one block
        for node, (clique, rack, block) in enumerate(zip(index.clique, index.rack, index.block, strict=True)):
            members = clique_nodes.get(clique)
            if members is None:
                clique_nodes[clique] = [node]
                rack_cliques.setdefault(rack, []).append(clique)
            else:
                members.append(node)
            if rack not in racks_seen:
                racks_seen.add(rack)
                block_racks.setdefault(block, []).append(rack)
        for nodes in clique_nodes.values():
            if len(nodes) > 1:
                nodes.sort(key=lambda n: (slots[n], n))  # best fit among hosts
        return slots, clique_nodes, rack_cliques, block_racks

    def clique_cap(self, clique: int) -> int:
        return sum(self.slots[n] for n in self.clique_nodes[clique]) // self.k

    def rack_cap(self, rack: int) -> int:
        return sum(self.clique_cap(c) for c in self.rack_cliques[rack])

    def block_cap(self, block: int) -> int:
        return sum(self.rack_cap(r) for r in self.block_racks[block])

    def total_cap(self) -> int:
        """Units in the whole tree (each clique lies in one rack, each rack in one block)."""
        return sum(self._clique_caps().values())

    def _clique_caps(self) -> dict[int, int]:
        at, k = self.slots.__getitem__, self.k  # map() over a bound method: a 50,000-node pool
        return {c: sum(map(at, nodes)) // k for c, nodes in self.clique_nodes.items()}

    def capacities(self) -> Capacities:
        """Every domain's capacity in units now, summed once."""
        clique = self._clique_caps()
        at = clique.__getitem__
        rack = {r: sum(map(at, cliques)) for r, cliques in self.rack_cliques.items()}
        block = {b: sum(map(rack.__getitem__, racks)) for b, racks in self.block_racks.items()}
        return Capacities(clique, rack, block)

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


@dataclass(frozen=True)
class Capacities:
    """Units that fit in each clique, rack and block of a tree, at one moment."""

    clique: dict[int, int]
    rack: dict[int, int]
    block: dict[int, int]


@dataclass(frozen=True)
class Selection:
    """How domains are chosen. Kueue's BestFit: the least spare capacity. `fewest`: among
    domains that fit, the one needing the fewest sub-domains first. `balanced`: spread the
    units evenly over the chosen sub-domains instead of filling the largest first."""

    fewest: bool = False
    balanced: bool = False
    roomy: bool = False  # among equally few sub-domains, the largest (room to balance)


KUEUE = Selection()
SELECTIONS = (
    Selection(fewest=True), Selection(fewest=True, balanced=True), Selection(fewest=True, balanced=True, roomy=True), KUEUE,
)


def pick(
    children: Sequence[int], cap: Callable[[int], int], need: int, how: Selection = KUEUE,
    span: Callable[[int, int], tuple[int, ...]] | None = None,
) -> list[tuple[int, int]] | None:
    """Best fit: the smallest child that fits, else fewest children (largest first, the last
    one the best fit for the remainder)."""
    caps = {c: cap(c) for c in children}
    fitting = [c for c in children if caps[c] >= need]
    if fitting:
        spans = {c: span(c, need) if how.fewest and span else () for c in fitting}
        sign = -1 if how.roomy else 1
        return [(min(fitting, key=lambda c: (spans[c], sign * caps[c], c)), need)]
    chosen: list[tuple[int, int]] = []
    used: set[int] = set()
    remaining = need
    def order(c: int) -> tuple[object, ...]:
        return (-caps[c], span(c, min(caps[c], need)) if how.fewest and span else (), c)

    for child in sorted(children, key=order):
        if caps[child] <= 0:
            break
        if caps[child] >= remaining:
            rest = [c for c in children if c not in used and caps[c] >= remaining]
            tail_span = {c: span(c, remaining) if how.fewest and span else () for c in rest}
            tail = child if how.balanced else min(rest, key=lambda c: (tail_span[c], caps[c], c))
            chosen.append((tail, remaining))
            return _balance(chosen, caps, need) if how.balanced else chosen
        chosen.append((child, caps[child]))
        used.add(child)
        remaining -= caps[child]
    return None


def _balance(chosen: list[tuple[int, int]], caps: dict[int, int], need: int) -> list[tuple[int, int]]:
    """Water-fill `need` over the chosen children as evenly as their capacities allow."""
    give: dict[int, int] = {}
    remaining = need
    ascending = sorted((c for c, _ in chosen), key=lambda c: (caps[c], c))
    for i, child in enumerate(ascending):
        share = -(-remaining // (len(ascending) - i))
        give[child] = min(caps[child], share)
        remaining -= give[child]
    return [(c, give[c]) for c, _ in chosen]


def _count_needed(caps: list[int], need: int) -> tuple[int, int]:
    """Children needed, largest first, to hold `need`, and minus their capacity (roomier first)."""
    for count, total in enumerate(_running(sorted(caps, reverse=True)), start=1):
        if total >= need:
            return count, -total
    return len(caps) + 1, 0


def _running(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def select(tree: Tree, need: int, how: Selection = KUEUE,
           caps: Capacities | None = None) -> list[tuple[int, int]] | None:
    """Ordered (clique, units) covering `need` units: the lowest level at which one domain
    fits decides (as in Kueue), else the fewest blocks, racks and cliques. `caps`: the tree's
    capacities now (Tree.capacities), when the caller has them."""

    # The tree does not change during a selection: every capacity is summed once (a 10,000-node
    # pool asks for them hundreds of thousands of times).
    caps = tree.capacities() if caps is None else caps
    clique_cap, rack_cap, block_cap = caps.clique.__getitem__, caps.rack.__getitem__, caps.block.__getitem__

    def rack_span(rack: int, n: int) -> tuple[int, ...]:
        count, room = _count_needed([clique_cap(c) for c in tree.rack_cliques[rack]], n)
        return (count, room) if how.roomy else (count,)

    def block_span(block: int, n: int) -> tuple[int, ...]:
        racks = tree.block_racks[block]
        cliques = [clique_cap(c) for r in racks for c in tree.rack_cliques[r]]
        count, room = _count_needed([rack_cap(r) for r in racks], n)
        return (count, _count_needed(cliques, n)[0], room if how.roomy else 0)

    cliques = [c for c in tree.clique_nodes if clique_cap(c) >= need]
    if cliques:
        return [(min(cliques, key=lambda c: (clique_cap(c), c)), need)]
    all_racks = [r for racks in tree.block_racks.values() for r in racks]
    if any(rack_cap(r) >= need for r in all_racks):
        ((rack, _),) = pick(all_racks, rack_cap, need, how, rack_span) or [(-1, 0)]
        return pick(tree.rack_cliques[rack], clique_cap, need, how)
    out: list[tuple[int, int]] = []
    blocks = pick(list(tree.block_racks), block_cap, need, how, block_span)
    if blocks is None:
        return None
    for block, in_block in blocks:
        for rack, in_rack in pick(tree.block_racks[block], rack_cap, in_block, how, rack_span) or []:
            out.extend(pick(tree.rack_cliques[rack], clique_cap, in_rack, how) or [])
    return out


def unit_slots(tree: Tree, chosen: list[tuple[int, int]]) -> list[list[int]]:
    """The chosen cliques' unit slots in sequence, each a list of k nodes."""
    work = tree.copy()
    slots: list[list[int]] = []
    for clique, count in chosen:
        slots.extend(work.take_units(clique, count))
    return slots


def fill_sequence(mesh: Mesh, order: Sequence[int], slots: list[list[int]]) -> list[int] | None:
    """Units in `order` into the unit slots in sequence: pod -> node."""
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
    caps = {r: work.rack_cap(r) for r in rack_block}
    for units in groups:
        units.sort(key=lambda u: position[u])
        fitting = [r for r in caps if caps[r] >= len(units)]
        if not fitting:
            return None
        rack = min(fitting, key=lambda r: (r not in open_racks, rack_block[r] not in open_blocks, caps[r], r))
        open_racks.add(rack)
        open_blocks.add(rack_block[rack])
        slots: list[list[int]] = []
        for clique in work.rack_cliques[rack]:
            slots.extend(work.take_units(clique, len(units) - len(slots)))
        caps[rack] = work.rack_cap(rack)  # only this rack's slots changed
        for unit, nodes in zip(units, slots, strict=True):
            for pod, node in zip(mesh.tp_units[unit], nodes, strict=True):
                assign[pod] = node
    return assign


def placed(assign: Sequence[int] | None) -> bool:
    return assign is not None and all(node >= 0 for node in assign)
