"""The planner alone, as the operator calls it: a big gang on a generated HGX cluster.

Each repeat builds the job's `Inventory` from node and pod dicts (the
operator does so on every planning pass, from its indexes) and asks
`planning.PlacementPlanner.plan` for the gang at its full data degree. The
cluster is bench/placement.py's HGX style (8-GPU nodes, 16 a rack, 8 racks a
block), empty or with a fraction of its GPUs held by other pods of 1-8 GPUs.
Wall time is what a reconcile pass waits; CPU time (this process only) is
the figure to compare between machines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from placement import LEVELS, STYLES, make_cluster
from topotrain.api.spec import TrainingJobSpec
from topotrain.core.planning import PlacementPlanner
from topotrain.placement.topology import Inventory

TARGET_P99_S = 1.0


@dataclass
class PlanRow:
    nodes: int
    used: float
    pods: int
    inventory_s: list[float]  # wall seconds building the Inventory
    wall_s: list[float]  # wall seconds of PlacementPlanner.plan
    cpu_s: list[float]  # CPU seconds of PlacementPlanner.plan
    total_s: list[float]  # wall seconds of both
    problem: str = ""


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def plan_rows(node_counts: list[int], pods: int, used_fractions: list[float], repeats: int,
              seed: int) -> list[PlanRow]:
    pipeline = 8 if pods % 8 == 0 else 1
    data = pods // pipeline
    spec = TrainingJobSpec.model_validate({
        "image": "topotrain/trainer:bench",
        "parallelism": {"tensor": 8, "pipeline": pipeline, "data": data},
        "worker": {"gpusPerPod": 8, "gpuTypes": ["H100-80GB"]},
    })
    rows = []
    for nodes in node_counts:
        for used in used_fractions:
            node_dicts, pod_dicts = make_cluster(STYLES["hgx"], nodes, used, seed + nodes)
            row = PlanRow(len(node_dicts), used, pods, [], [], [], [])
            for _ in range(repeats):
                start = time.perf_counter()
                inventory = Inventory.from_snapshot(node_dicts, pod_dicts, LEVELS)
                built, cpu = time.perf_counter(), time.process_time()
                outcome = PlacementPlanner(spec, inventory).plan(data, data)
                done = time.perf_counter()
                row.cpu_s.append(time.process_time() - cpu)
                row.wall_s.append(done - built)
                row.inventory_s.append(built - start)
                row.total_s.append(done - start)
                if not outcome.feasible or len(outcome.assignments) != pods:
                    row.problem = f"{outcome.reason}: {outcome.message}"
                    break
            rows.append(row)
    return rows


def print_plan_table(rows: list[PlanRow]) -> None:
    print("| cluster nodes | GPUs used by others | gang pods | repeats | inventory p50 ms | "
          "plan p50 s | plan p99 s | plan max s | plan CPU p99 s | with inventory p99 s | plan p99 < 1 s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|")
    for r in rows:
        if r.problem:
            print(f"| {r.nodes} | {r.used:.0%} | {r.pods} | {len(r.wall_s)} | infeasible: {r.problem} |")
            continue
        p99 = _quantile(r.wall_s, 0.99)
        print(f"| {r.nodes} | {r.used:.0%} | {r.pods} | {len(r.wall_s)} | "
              f"{_quantile(r.inventory_s, 0.5) * 1000:.0f} | {_quantile(r.wall_s, 0.5):.3f} | {p99:.3f} | "
              f"{max(r.wall_s):.3f} | {_quantile(r.cpu_s, 0.99):.3f} | {_quantile(r.total_s, 0.99):.3f} | "
              f"{'yes' if p99 < TARGET_P99_S else 'NO'} |")
    print("plan = PlacementPlanner.plan, wall seconds (CPU: this process only); "
          "with inventory = Inventory.from_snapshot + plan, as a reconcile pass does")
