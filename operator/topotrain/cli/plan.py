"""`topotrain plan`: where would this TrainingJob go on this cluster, and why.

    kubectl get nodes -o yaml > nodes.yaml
    kubectl get pods -A -o yaml > pods.yaml
    topotrain plan --nodes nodes.yaml --pods pods.yaml --job job.yaml [--output table|json|svg]

The plan comes with its predicted step time (docs/placement.md, "Step-time model") for the
model and batch of `spec.training`; `--step-model FILE` overrides the model's link table,
utilisation or GPU peaks (JSON).

`--nodes` also takes a fleet file (examples/clusters/*.yaml, the testbed's topology files):
    topotrain plan --nodes examples/clusters/nvl72.yaml --job examples/large-3d.yaml

Exit status: 0 feasible, 1 not placeable (the reason is printed), 2 bad input
(the message names the file and the field).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from topotrain.cli.fleet_file import node_manifest, parse_topology, plan_nodes, preload_pod_manifest
from topotrain.contract import rank_coords
from topotrain.placement import GangRequest, Plan, plan
from topotrain.placement.steptime import StepTime, predict_plan
from topotrain.placement.steptime_tables import Assumptions, StepTimeError, Workload
from topotrain.placement.svg import render
from topotrain.placement.topology import Inventory, TopologyLevels

JOB_LABEL = "topotrain.io/job"  # the label the operator puts on a job's pods


class InputError(Exception):
    """Bad input: the message names the file and the field."""


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan", help="show where a TrainingJob's gang would be placed",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run_plan)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TopologyLevels()
    parser.add_argument("--nodes", required=True, type=Path,
                        help="`kubectl get nodes -o yaml` output, or a fleet file (examples/clusters/)")
    parser.add_argument("--pods", type=Path, help="`kubectl get pods -A -o yaml` output (GPUs in use)")
    parser.add_argument("--job", required=True, type=Path, help="TrainingJob manifest")
    parser.add_argument("--output", "-o", choices=["table", "json", "svg"], default="table")
    parser.add_argument("--block-label", default=defaults.block, help="node label of the block level")
    parser.add_argument("--rack-label", default=defaults.rack, help="node label of the rack level")
    parser.add_argument("--nvlink-label", default=defaults.nvlink, help="node label of the NVLink domain")
    parser.add_argument("--product-label", default=defaults.product, help="node label of the GPU pool")
    parser.add_argument("--step-model", type=Path, metavar="FILE",
                        help="JSON overriding the step-time model's links, utilisation or peakTflops")


def run_plan(args: argparse.Namespace) -> int:
    levels = TopologyLevels(
        block=args.block_label, rack=args.rack_label, nvlink=args.nvlink_label, product=args.product_label
    )
    try:
        name, spec = load_job(args.job)
        request = GangRequest.from_spec(spec)
        nodes, preloaded = load_nodes(args.nodes)
        pods = load_list(args.pods, "Pod") if args.pods else preloaded
        inventory = _inventory(args, nodes, pods, levels, name, spec)
        assumptions = Assumptions.from_file(args.step_model) if args.step_model else Assumptions()
    except (InputError, StepTimeError) as exc:
        print(f"topotrain plan: {exc}", file=sys.stderr)
        return 2
    result = plan(request, inventory)
    step = step_time(result, request, inventory, spec.training, assumptions)
    try:
        _write(args.output, result, request, inventory, step)
    except BrokenPipeError:  # `topotrain plan ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if result.feasible else 1


def step_time(
    result: Plan, request: GangRequest, inventory: Inventory, training: Any, assumptions: Assumptions,
) -> StepTime | str:
    """The plan's predicted step time, or why there is none."""
    if not result.feasible:
        return "no plan"
    try:
        workload = Workload.from_training(training)
        return predict_plan(result, request, inventory.pools().get(result.pool or "", []), workload, assumptions)
    except StepTimeError as exc:
        return str(exc)


def _write(output: str, result: Plan, request: GangRequest, inventory: Inventory, step: StepTime | str) -> None:
    if output == "json":
        doc = result.to_json()
        doc["stepTime"] = step.as_dict() if isinstance(step, StepTime) else None
        print(json.dumps(doc, indent=2))
    elif output == "svg":
        pool = result.pool or (request.gpu_types[0] if request.gpu_types else next(iter(inventory.pools()), ""))
        sys.stdout.write(render(result, request, inventory.pools().get(pool, [])))
    else:
        print(table(result, request, inventory, step))
    if isinstance(step, str) and result.feasible:
        print(f"topotrain plan: step time not predicted: {step}", file=sys.stderr)


def _inventory(
    args: argparse.Namespace, nodes: list[dict[str, Any]], pods: list[dict[str, Any]],
    levels: TopologyLevels, name: str, spec: Any,
) -> Inventory:
    try:
        return Inventory.from_snapshot(
            nodes, pods, levels,
            tolerations=[t.to_wire() for t in spec.worker.tolerations],
            node_selector=spec.worker.node_selector,
            ignore_pods_of={JOB_LABEL: name},
        )
    except ValueError as exc:
        source = args.pods if str(exc).startswith("pod ") else args.nodes
        raise InputError(f"{source}: {exc}") from None


def load_job(path: Path) -> tuple[str, Any]:
    """(name, validated TrainingJobSpec) from a manifest file."""
    from topotrain.api.spec import TrainingJobSpec
    from topotrain.api.validation import validate_manifest

    doc = _load_yaml(path)
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected a TrainingJob manifest (a mapping), got {type(doc).__name__}")
    problems = validate_manifest(doc)
    if problems:
        raise InputError(f"{path}: " + "; ".join(problems))
    return str(doc["metadata"]["name"]), TrainingJobSpec.model_validate(doc["spec"])


def load_nodes(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Ready nodes, pods holding GPUs) of a fleet file (a mapping with `pools`: its nodes, and
    the pods of its `preload`), else (the Node List, no pods)."""
    docs = _load_all(path)
    if len(docs) != 1 or not isinstance(docs[0], dict) or "pools" not in docs[0] or "kind" in docs[0]:
        return load_list(path, "Node"), []
    try:
        fleet = parse_topology(docs[0])
    except (ValueError, TypeError, KeyError) as exc:
        raise InputError(f"{path}: not a valid fleet file: {exc}") from None
    plans = list(plan_nodes(fleet))
    nodes = [node_manifest(p, fleet.name) for p in plans]
    for node in nodes:
        node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    return nodes, [preload_pod_manifest(p, fleet.name) for p in plans if p.preload_gpus]


def _load_all(path: Path) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML: {exc}") from None


def load_list(path: Path, kind: str) -> list[dict[str, Any]]:
    """Items of a `kubectl get -o yaml` List (or a single object, or a multi-document stream)."""
    docs = _load_all(path)
    items: list[Any] = []
    for doc in docs:
        if isinstance(doc, dict) and isinstance(doc.get("items"), list):
            items.extend(doc["items"])
        elif isinstance(doc, dict) and doc.get("kind") in (kind, None) and "metadata" in doc:
            items.append(doc)
        else:
            got = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise InputError(f"{path}: expected a List of {kind} objects (kubectl get -o yaml), got {got}")
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("metadata"), dict) or not item["metadata"].get("name"):
            raise InputError(f"{path}: items[{i}].metadata.name: required")
        if item.get("kind") not in (kind, None):
            raise InputError(f"{path}: items[{i}].kind: expected {kind}, got {item.get('kind')}")
    return items


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML: {exc}") from None


def table(result: Plan, request: GangRequest, inventory: Inventory, step: StepTime | str = "") -> str:
    """Human-readable plan: one line per pod with its node's domains, stages and replicas."""
    if not result.feasible or result.parallelism is None:
        return f"not placeable: {result.reason}"
    par = result.parallelism
    cost = result.cost
    lines = [
        f"pool {result.pool}  tp={par['tensor']} pp={par['pipeline']} dp={par['data']} "
        f"(requested data {request.data}, min {request.lowest_data})  {len(result.assignments)} pods",
        f"cost {cost.total} = nvlink {cost.nvlink} + rack {cost.rack} + block {cost.block} "
        f"(pipeline {cost.pipeline}, data {cost.data}); free GPUs stranded on used nodes "
        f"{result.fragmentation.on_used_nodes}, in used racks {result.fragmentation.in_used_racks}",
        f"strategy {result.strategy}",
        *([f"predicted {step.describe()}", f"  ({step.basis})"] if isinstance(step, StepTime)
          else [f"step time not predicted: {step or '-'}"]),
        f"{'POD':>4} {'RANKS':>11} {'NODE':20} {'BLOCK':8} {'RACK':8} {'NVLINK':16} {'STAGES':8} REPLICAS",
    ]
    t, p, d = par["tensor"], par["pipeline"], par["data"]
    for pod in result.assignments:
        info = inventory.nodes[pod.node]
        coords = [rank_coords(r, t, p, d, request.rank_order) for r in range(pod.ranks[0], pod.ranks[1] + 1)]
        stages = _span(sorted({c[1] for c in coords}))
        replicas = _span(sorted({c[2] for c in coords}))
        clique = "-" if info.path[2].startswith("host:") else info.path[2]
        lines.append(
            f"{pod.index:>4} {f'{pod.ranks[0]}-{pod.ranks[1]}':>11} {pod.node:20} {info.path[0]:8} "
            f"{info.path[1]:8} {clique:16} {stages:8} {replicas}"
        )
    return "\n".join(lines)


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}" if values[-1] - values[0] + 1 == len(values) else ",".join(map(str, values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="topotrain plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
