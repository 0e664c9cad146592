"""Placement benchmark: topotrain's planner against baseline policies on generated clusters.

    python bench/placement.py --quick     # CI: 64 and 256 nodes
    python bench/placement.py             # full: 64 to 2,048 nodes

Clusters: HGX-style (8-GPU nodes, each its own NVLink domain, 16 nodes a rack)
and NVL72-style (4-GPU nodes, 18 per rack sharing one NVLink domain), 8 racks a
block; empty, 50% or 80% of GPUs held by other pods (1, 2, 4 GPUs or a whole
node, whole nodes 4 times in 7) dropped on random nodes with room (fragmented).
Jobs: tensor 8, pipeline 4 or 8, data sized to 30%, 60% or 95% of the free
capacity in whole tensor-parallel groups. Every planner is scored with the
same cost model (docs/placement.md); ratios are baseline cost / topotrain cost.
Times are CPU seconds of this process (time.process_time), so that other load on
the machine does not inflate them; the 1,024-pod figure also prints wall time.
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from topotrain.placement import GangRequest, Mesh, evaluate, meets_constraints, plan
from topotrain.placement.baselines import BASELINES
from topotrain.placement.cost import DomainIndex
from topotrain.placement.topology import Inventory, TopologyLevels

LEVELS = TopologyLevels()


@dataclass(frozen=True)
class Style:
    name: str
    gpus: int
    nodes_per_rack: int
    clique_is_rack: bool
    gpus_per_pod: int


STYLES = {
    "hgx": Style("hgx", 8, 16, False, 8),
    "nvl72": Style("nvl72", 4, 18, True, 4),
}
RACKS_PER_BLOCK = 8


def make_cluster(style: Style, nodes: int, used: float, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Node and pod dicts as `kubectl get -o yaml` prints them."""
    rng = random.Random(seed)
    racks = max(1, round(nodes / style.nodes_per_rack))
    node_dicts: list[dict[str, Any]] = []
    for r in range(racks):
        for h in range(style.nodes_per_rack):
            name = f"n-{r:03d}-{h:02d}"
            labels = {
                LEVELS.block: f"b{r // RACKS_PER_BLOCK}",
                LEVELS.rack: f"r{r:03d}",
                LEVELS.host: name,
                LEVELS.product: "H100-80GB" if style.name == "hgx" else "GB200",
            }
            if style.clique_is_rack:
                labels[LEVELS.nvlink] = f"clique-{r:03d}"
            node_dicts.append({
                "metadata": {"name": name, "labels": labels},
                "spec": {},
                "status": {"allocatable": {"nvidia.com/gpu": str(style.gpus)},
                           "conditions": [{"type": "Ready", "status": "True"}]},
            })
    free = {n["metadata"]["name"]: style.gpus for n in node_dicts}
    held = scatter(free, int(used * style.gpus * len(node_dicts)),
                   [1, 2, 4, style.gpus, style.gpus, style.gpus, style.gpus], rng)
    pods = [{
        "metadata": {"name": f"other-{i}", "namespace": "other"},
        "spec": {"nodeName": node, "containers": [{"resources": {"requests": {"nvidia.com/gpu": str(size)}}}]},
        "status": {"phase": "Running"},
    } for i, (node, size) in enumerate(held)]
    return node_dicts, pods


def scatter(free: dict[str, int], target: int, sizes: Sequence[int],
            rng: random.Random) -> list[tuple[str, int]]:
    """(node, GPUs) holds taking `target` of the `free` GPUs (node -> free, updated): sizes
    drawn from `sizes`, each on a random node with room for it (else any with room left),
    cut to what that node has. The fragmented cluster of this benchmark and bench/versus.py."""
    # For each size that can be asked, the sorted names with room for it, kept as GPUs are taken
    # (the same draws as filtering every name at every hold, without that scan: 50,000 nodes).
    names = sorted(free)
    room = {s: [n for n in names if free[n] >= s] for s in {*sizes, 1}}
    held: list[tuple[str, int]] = []
    while target > 0:
        size = min(target, rng.choice(sizes))
        candidates = room.get(size) or [n for n in names if free[n] >= size]
        node = rng.choice(candidates or room[1])
        size = min(size, free[node])
        before = free[node]
        free[node] -= size
        for need, members in room.items():
            if free[node] < need <= before:
                del members[bisect.bisect_left(members, node)]
        target -= size
        held.append((node, size))
    return held


def make_job(style: Style, inventory: Inventory, fraction: float) -> GangRequest | None:
    per_domain: dict[tuple[str, ...], int] = {}
    for n in inventory.nodes.values():
        per_domain[n.nvlink] = per_domain.get(n.nvlink, 0) + n.free // style.gpus_per_pod
    group = max(1, 8 // style.gpus_per_pod)  # pods per tensor-parallel group of 8
    slots = sum(count // group * group for count in per_domain.values())
    gpus = int(slots * style.gpus_per_pod * fraction)
    pipeline = 8 if gpus >= 8 * 8 * 8 else 4
    data = gpus // (8 * pipeline)
    if data < 1:
        return None
    return GangRequest(tensor=8, pipeline=pipeline, data=data, gpus_per_pod=style.gpus_per_pod)


@dataclass
class Row:
    instance: str
    pods: int
    costs: dict[str, tuple[int, int, int, float, bool]]  # planner -> (total, rack, block, seconds, valid)


def run_instance(style: Style, nodes: int, used: float, fraction: float, seed: int) -> Row | None:
    node_dicts, pods = make_cluster(style, nodes, used, seed)
    inventory = Inventory.from_snapshot(node_dicts, pods, LEVELS)
    request = make_job(style, inventory, fraction)
    if request is None:
        return None
    costs: dict[str, tuple[int, int, int, float, bool]] = {}
    start = time.process_time()
    result = plan(request, inventory)
    seconds = time.process_time() - start
    if not result.feasible:
        print(f"  topotrain infeasible: {result.reason}", file=sys.stderr)
        return None
    pool_nodes = inventory.pools()[result.pool or ""]
    index = DomainIndex(pool_nodes)
    mesh = Mesh.build(request)
    position = {name: i for i, name in enumerate(index.names)}
    ours = [position[a.node] for a in result.assignments]
    cost = evaluate(mesh, index, ours)
    costs["topotrain"] = (cost.total, cost.rack, cost.block, seconds, meets_constraints(mesh, index, ours))
    for name, baseline in BASELINES.items():
        start = time.process_time()
        assign = baseline(mesh, index)
        seconds = time.process_time() - start
        if assign is None:
            continue
        c = evaluate(mesh, index, assign)
        costs[name] = (c.total, c.rack, c.block, seconds, meets_constraints(mesh, index, assign))
    label = f"{style.name:5s} {len(node_dicts):5d}n {int(used * 100):2d}%used job{int(fraction * 100):2d}%"
    return Row(label, mesh.pods, costs)


PLANNERS = ("topotrain", "bestfit", "spread", "pack", "random")


def print_table(rows: list[Row], out: Callable[[str], None] = print) -> None:
    head = f"{'instance':30s} {'pods':>5s} " + " ".join(f"{p:>22s}" for p in PLANNERS)
    out(head)
    out(f"{'':30s} {'':5s} " + " ".join(f"{'cost/rack/block cpu-ms':>22s}" for _ in PLANNERS))
    for row in rows:
        cells = []
        for p in PLANNERS:
            if p not in row.costs:
                cells.append(f"{'-':>22s}")
                continue
            total, rack, block, secs, valid = row.costs[p]
            mark = "" if valid else "!"
            cells.append(f"{total:>7d}{mark}/{rack:>6d}/{block:>6d} {secs * 1000:>5.0f}")
        out(f"{row.instance:30s} {row.pods:>5d} " + " ".join(cells))
    out("! = breaks a hard constraint (a tensor-parallel group split across NVLink domains)")


def ratios(rows: list[Row], out: Callable[[str], None] = print) -> bool:
    """Print geomean ratios (baseline / topotrain) and check the targets; True when met."""
    ok = True
    worse = [r.instance for r in rows if r.costs["topotrain"][0] > r.costs.get("bestfit", (math.inf,))[0]]
    out(f"instances where topotrain costs more than bestfit: {len(worse)} {worse if worse else ''}")
    ok &= not worse
    for subset, label in ((rows, "all"), ([r for r in rows if "  0%used" not in r.instance], "fragmented")):
        parts = []
        for p in PLANNERS[1:]:
            logs = [math.log(max(r.costs[p][0], 1) / max(r.costs["topotrain"][0], 1)) for r in subset if p in r.costs]
            g = math.exp(sum(logs) / len(logs)) if logs else float("nan")
            parts.append(f"{p} {g:.2f}x")
            if label == "fragmented" and p == "bestfit":
                ok &= g >= 1.15
            if label == "fragmented" and p == "spread":
                ok &= g >= 1.5
        out(f"geomean cost ratio vs topotrain ({label}, {len(subset)} instances): " + ", ".join(parts))
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small clusters only (CI)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    sizes = [64, 256] if args.quick else [64, 256, 1024, 2048]
    rows: list[Row] = []
    for style in STYLES.values():
        for nodes in sizes:
            for used in (0.0, 0.5, 0.8):
                for fraction in (0.3, 0.6, 0.95):
                    row = run_instance(style, nodes, used, fraction, args.seed + nodes)
                    if row is not None:
                        rows.append(row)
    print_table(rows)
    met = ratios(rows)
    cpu, wall = _big_job_seconds()
    print(f"1,024-pod job (tp8 pp8 dp128) on an empty 2,048-node HGX cluster: planned in {cpu:.2f} s CPU "
          f"({wall:.2f} s wall; wall time counts other processes' use of this machine's cores)")
    print("targets met" if met and cpu < 1.0 else "TARGETS NOT MET")
    return 0


def _big_job_seconds() -> tuple[float, float]:
    style = STYLES["hgx"]
    node_dicts, pods = make_cluster(style, 2048, 0.0, 7)
    inventory = Inventory.from_snapshot(node_dicts, pods, LEVELS)
    request = GangRequest(tensor=8, pipeline=8, data=128, gpus_per_pod=8)
    wall, cpu = time.perf_counter(), time.process_time()
    result = plan(request, inventory)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert result.feasible and len(result.assignments) == 1024, result.reason
    return cpu, wall


if __name__ == "__main__":
    sys.exit(main())
