"""bench/versus.py's tables: placement cost and predicted step time per job, latency and
admissions, recovery after a node loss, and what each system cannot express, as rows."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from versus_jobs import (
    STEP_MICROBATCHES,
    STEP_MODEL,
    STEP_SEQ_LEN,
    STEP_WORKLOADS,
    Placed,
    workload_label,
)
from versus_results import PlacementResult, SystemResult

FIRST = workload_label(*STEP_WORKLOADS[0])  # the per-job table's workload

# What a user of each system can ask for, from the benchmark's own job kinds and the docs
# of each API (Kueue v0.17 TAS annotations, JobSet v1alpha2, TrainingJob v1alpha1).
EXPRESSIVENESS = (
    ("elastic shrink under required topology (minData < data)", "yes: the planner picks the "
     "largest allowed data degree that fits", "no: a JobSet's size is fixed; the elastic jobs run "
     "at full size or wait"),
    ("two GPU types in preference order per job", "yes: worker.gpuTypes is ordered",
     "only through queues: one ClusterQueue per flavor order, sharing quota in a cohort, and a "
     "LocalQueue each (this bench makes them); a job picks an order by its queue"),
    ("TP group in one NVLink domain where pools differ (cliques vs. one board a node)",
     "yes: the NVLink level falls back to the node per pool", "one label per annotation: a "
     "Topology level missing on some nodes hides them from TAS, so the level is the hostname"),
    ("pipeline neighbours close, DP groups in few racks (a cost, not a rule)",
     "yes: the cost model of docs/placement.md", "preferred level for the whole gang only"),
    ("recovery after a node loss",
     "in place (default): the lost node's pod re-planned and created, the others kept; "
     "or recreate the gang",
     "Recreate or BlockingRecreate (all pods) + Kueue TAS node replacement; InPlaceRestart "
     "needs an agent in every pod and a feature gate"),
)  # fmt: skip


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    pos = q * (len(values) - 1)
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def fmt(value: float | None) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 or float(value).is_integer() else f"{value:.2f}"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_report(results: Sequence[SystemResult], args: argparse.Namespace) -> int:
    ours, theirs = results
    print(f"\n### topotrain against {theirs.system}: {args.nodes} nodes, {int(args.used * 100)}% "
          f"of GPUs held by filler pods, {args.jobs} jobs (seed {args.seed}; topotrain's pods bound by the "
          f"{getattr(args, 'pod_binding', 'scheduler')})\n")  # fmt: skip
    print(
        "Placement cost (docs/placement.md) on the nodes each gang got; pods at the size it ran\n"
    )
    rows, logs, worse = [], [], []
    for shape in ours.shapes:
        a, b = ours.placed.get(shape.name), theirs.placed.get(shape.name)
        ratio = "-"
        if a and b and len(a.nodes) == len(b.nodes):
            r = max(b.cost, 1) / max(a.cost, 1)
            logs.append(math.log(r))
            ratio = f"{r:.2f}x"
            if a.cost > b.cost:
                worse.append(shape.name)
        rows.append([shape.name, str(shape.pods), _cell(a), _cell(b), ratio,
                     fmt(ours.latency(shape.name)), fmt(theirs.latency(shape.name))])  # fmt: skip
    table(["job", "pods asked", f"{ours.system} pods: cost/rack/block",
           f"{theirs.system} pods: cost/rack/block", "their cost / ours",
           f"{ours.system} apply->Running s", f"{theirs.system} apply->Running s"], rows)  # fmt: skip
    geo = math.exp(sum(logs) / len(logs)) if logs else float("nan")
    print(f"\ngeo-mean cost ratio ({theirs.system} / {ours.system}) over {len(logs)} jobs placed "
          f"by both at the same size: {fmt(geo)}x; jobs where {ours.system} costs more: "
          f"{len(worse)} {worse if worse else ''}\n")  # fmt: skip
    print_steps([(shape.name, ours.placed.get(shape.name), theirs.placed.get(shape.name))
                 for shape in ours.shapes], ours.system, theirs.system)  # fmt: skip
    lat_rows = []
    for result in results:
        lat = result.latencies()
        lat_rows.append([result.system, f"{len(lat)}/{len(result.shapes)}", fmt(percentile(lat, 0.5)),
                         fmt(percentile(lat, 0.95)), fmt(lat[-1] if lat else None),
                         fmt(result.admissions_per_minute())])  # fmt: skip
    table(["system", "jobs Running", "apply->Running p50 s", "p95 s", "max s", "admissions/min"],
          lat_rows)  # fmt: skip
    print()
    rec_rows = []
    for result in results:
        rec = result.recovery
        rec_rows.append(
            [
                result.system,
                rec.node if rec else "-",
                fmt(rec.seconds) if rec else "-",
                str(rec.pods_created) if rec else "-",
            ]
        )
    table(["system", "node deleted", "node loss -> all pods Running s", "pods created"], rec_rows)
    print()
    table(["can a user express", ours.system, theirs.system], [list(r) for r in EXPRESSIVENESS])
    for result in results:
        if result.victim_state:
            print(f"\n{result.system}, the node-loss job's Workload at the end of the wait:\n"
                  f"{result.victim_state}")  # fmt: skip
    missing = [s.name for s in theirs.shapes if s.name not in theirs.placed]
    if (missing or (theirs.recovery and theirs.recovery.seconds is None)) and theirs.log_tail:
        print(f"\nnot Running under {theirs.system}: {missing}\n{theirs.log_tail}")
    return 0


def print_placement(result: PlacementResult, ours: str, theirs: str,
                    args: argparse.Namespace) -> None:  # fmt: skip
    """The placement phase: each instance placed by each system alone on the same fleet."""
    if not result.instances:
        return
    print(f"\n### Placement on identical instances: {args.nodes} nodes, "
          f"{int(args.used * 100)}% of GPUs held by filler pods, filler seeds {result.seeds}, "
          f"{len(result.instances)} instances ({result.seconds:.0f}s)\n")  # fmt: skip
    print(
        "Each instance = one filler seed + one job, placed by each system alone on the same "
        "free GPUs;\ncost of docs/placement.md on the nodes it got (pool, pods: cost/rack/block)\n"
    )
    rows, logs, worse, other_pool = [], [], [], []
    only: dict[str, int] = {ours: 0, theirs: 0, "neither": 0}
    for inst in result.instances:
        a, b = inst.ours, inst.theirs
        ratio = "-"
        if a and b and len(a.nodes) == len(b.nodes):
            r = max(b.cost, 1) / max(a.cost, 1)
            logs.append(r)
            ratio = f"{r:.2f}x"
            if a.cost > b.cost:
                worse.append(f"{inst.shape.name}@{inst.seed}")
            if _pool(a) != _pool(b):
                other_pool.append(f"{inst.shape.name}@{inst.seed}")
        elif a and b:
            ratio = "sizes differ"
        elif a:
            only[ours] += 1
        elif b:
            only[theirs] += 1
        else:
            only["neither"] += 1
        rows.append([str(inst.seed), inst.shape.name, str(inst.shape.pods),
                     _pool_cell(a, inst.ours_note), _pool_cell(b, inst.theirs_note),
                     ratio])  # fmt: skip
    table(["seed", "job", "pods asked", f"{ours}", f"{theirs}", "their cost / ours"], rows)
    geo = math.exp(sum(math.log(r) for r in logs) / len(logs)) if logs else float("nan")
    print()
    table(["summary", "value"], [
        ["instances placed by both at the same size", str(len(logs))],
        [f"geo-mean cost ratio ({theirs} / {ours})", f"{fmt(geo)}x"],
        ["worst instance ratio", f"{min(logs):.2f}x" if logs else "-"],
        [f"instances where {ours} costs more", f"{len(worse)} {' '.join(worse)}".strip()],
        ["instances the two placed in different pools",
         f"{len(other_pool)} {' '.join(other_pool)}".strip()],
        [f"placed by {ours} only", str(only[ours])],
        [f"placed by {theirs} only", str(only[theirs])],
        ["placed by neither", str(only["neither"])],
    ])  # fmt: skip
    print()
    print_steps([(f"{inst.shape.name}@{inst.seed}", inst.ours, inst.theirs)
                 for inst in result.instances], ours, theirs)  # fmt: skip
    if result.recovery:
        print(f"### Node loss on identical state ({result.recovery_seconds:.0f}s)\n\n"
              "The job alone under each system on the same fillers; the node of its pod 0 "
              "deleted\n")  # fmt: skip
        table(["system", "restart", "job", "pods", "node deleted",
               "node loss -> all pods Running s", "pods created"], [
            [row.system, row.restart, row.job, str(row.pods), row.recovery.node if row.recovery else "-",
             fmt(row.recovery.seconds) if row.recovery else f"- ({row.note})",
             str(row.recovery.pods_created) if row.recovery else "-"]
            for row in result.recovery])  # fmt: skip
        print()


def step_ratio(ours: Placed | None, theirs: Placed | None, label: str = FIRST) -> float | None:
    """Their predicted step time over ours, for two placements of the same job at one size."""
    if ours is None or theirs is None or len(ours.nodes) != len(theirs.nodes):
        return None
    if label not in ours.steps or label not in theirs.steps:
        return None
    return theirs.steps[label][0] / ours.steps[label][0]


def print_steps(jobs: Sequence[tuple[str, Placed | None, Placed | None]], ours: str,
                theirs: str) -> list[float]:  # fmt: skip
    """The predicted step time (docs/placement.md, "Step-time model") of each system's
    placement of the same job, with the ratio and the bound no placement of the job is
    predicted faster than (`versus_jobs.best_step`); then the ratios for every workload of
    STEP_WORKLOADS. Returns the first workload's ratios."""
    print(f"Predicted step time (docs/placement.md's step-time model: Llama 3 {STEP_MODEL} shape, "
          f"seqLen {STEP_SEQ_LEN}, {STEP_MICROBATCHES} micro-batches of 1 a replica) on the nodes "
          "each system gave the same job; bound: no placement of the job is predicted faster "
          "(versus_jobs.best_step)\n")  # fmt: skip
    rows = []
    for name, a, b in jobs:
        ratio = step_ratio(a, b)
        rows.append([name, _step(a), _step(b), _step(a or b, best=True), "-" if ratio is None else f"{ratio:.3f}x"])
    table(["job", f"{ours} step s", f"{theirs} step s", "bound s", "their step / ours"], rows)
    summary, first = [], []
    for model, microbatches in STEP_WORKLOADS:
        label = workload_label(model, microbatches)
        rated = [(name, a, b, r) for name, a, b in jobs if (r := step_ratio(a, b, label)) is not None]
        ratios = [r for *_, r in rated]
        slower = [name for name, _, _, r in rated if r < 1]
        first = first or ratios
        if label == FIRST:
            print(f"\ngeo-mean predicted step ratio ({theirs} / {ours}) over {len(ratios)} jobs placed "
                  f"by both at the same size: {_geo(ratios):.3f}x; worst {min(ratios, default=float('nan')):.3f}x; "
                  f"jobs where {ours}'s step is slower: {len(slower)} {' '.join(slower)}\n")  # fmt: skip
        headroom = _geo([b.steps[label][0] / b.steps[label][1] for _, _, b, _ in rated if b])
        ours_off = _geo([a.steps[label][0] / a.steps[label][1] for _, a, _, _ in rated if a])
        summary.append([label, str(len(ratios)), f"{_geo(ratios):.3f}x", f"{min(ratios, default=float('nan')):.3f}x",
                        f"{len(slower)} {' '.join(slower)}".strip(), f"{headroom:.3f}x", f"{ours_off:.3f}x"])  # fmt: skip
    print("The same placements, each workload (Llama 3 shape, seqLen 4096; geo-means over the jobs "
          "placed by both at the same size)\n")
    table(["workload", "jobs", f"{theirs} / {ours}", "worst", f"jobs where {ours} is slower",
           f"{theirs} / bound", f"{ours} / bound"], summary)  # fmt: skip
    print()
    return first


def _geo(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _step(placed: Placed | None, best: bool = False) -> str:
    if placed is None or FIRST not in placed.steps:
        return "-"
    return f"{placed.steps[FIRST][1 if best else 0]:.3f}"


def _pool(placed: Placed) -> str:
    """The pool of the gang's first node, from the fleet's node names (v-<pool>-b..-r..-n..)."""
    parts = placed.nodes[0].split("-") if placed.nodes else []
    return parts[1] if len(parts) > 1 else "?"


def _pool_cell(placed: Placed | None, note: str = "") -> str:
    return _cell(placed, note) if placed is None else f"{_pool(placed)} {_cell(placed)}"


def _cell(placed: Placed | None, note: str = "") -> str:
    if placed is None:
        return f"not placed ({note})" if note else "not Running"
    return f"{len(placed.nodes)}: {placed.cost}/{placed.rack}/{placed.block}"
