"""SVG picture of a placement: blocks > racks > nodes > GPUs, the gang's GPUs coloured.

Hue says the pipeline stage of the rank on a GPU, lightness its data-parallel
replica; grey GPUs are held by other pods, white ones are free.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from topotrain.contract import rank_coords
from topotrain.placement.model import Plan
from topotrain.placement.request import GangRequest
from topotrain.placement.topology import NodeInfo

GPU = 9  # px per GPU square
GAP = 2
NODE_H = GPU + 4
RACK_PAD = 6
RACKS_PER_ROW = 12


def colour(stage: int, stages: int, replica: int, replicas: int) -> str:
    hue = int(360 * stage / max(1, stages))
    light = 35 + int(40 * replica / max(1, replicas - 1)) if replicas > 1 else 50
    return f"hsl({hue},70%,{light}%)"


def render(plan: Plan, request: GangRequest, nodes: Sequence[NodeInfo]) -> str:
    """The pool's nodes (`nodes`, sorted by domain path) with `plan`'s pods drawn in."""
    gpu_colours = _gang_colours(plan, request)
    racks: dict[tuple[str, str], list[NodeInfo]] = {}
    for info in nodes:
        racks.setdefault(info.rack, []).append(info)
    blocks: dict[str, list[tuple[str, str]]] = {}
    for rack in racks:
        blocks.setdefault(rack[0], []).append(rack)
    width_gpus = max((n.allocatable for n in nodes), default=8)
    rack_w = width_gpus * (GPU + GAP) + 2 * RACK_PAD
    rack_h = max((len(v) for v in racks.values()), default=1) * NODE_H + 2 * RACK_PAD + 12
    body: list[str] = []
    y = 40
    for block, block_racks in blocks.items():
        rows = (len(block_racks) + RACKS_PER_ROW - 1) // RACKS_PER_ROW
        block_w = min(len(block_racks), RACKS_PER_ROW) * (rack_w + RACK_PAD) + RACK_PAD
        block_h = rows * (rack_h + RACK_PAD) + RACK_PAD + 14
        body.append(f'<rect x="4" y="{y}" width="{block_w}" height="{block_h}" fill="#f4f4f8" stroke="#888"/>')
        body.append(f'<text x="8" y="{y + 12}" font-size="11">block {escape(block or "(unlabelled)")}</text>')
        for i, rack in enumerate(block_racks):
            rx = 4 + RACK_PAD + (i % RACKS_PER_ROW) * (rack_w + RACK_PAD)
            ry = y + 16 + (i // RACKS_PER_ROW) * (rack_h + RACK_PAD)
            body.extend(_rack(rack, racks[rack], rx, ry, rack_w, rack_h, gpu_colours))
        y += block_h + 8
    width = max(600, max((min(len(b), RACKS_PER_ROW) for b in blocks.values()), default=1) * (rack_w + RACK_PAD) + 20)
    title = _title(plan, request)
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 10}" font-family="sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="6" y="16" font-size="13">{escape(title)}</text>',
        '<text x="6" y="32" font-size="10">hue: pipeline stage; lightness: data replica; '
        'grey: other pods; white: free; dashed: NVLink domain</text>',
        *body,
        "</svg>",
        "",
    ])


def _rack(
    rack: tuple[str, str], nodes: list[NodeInfo], x: int, y: int, w: int, h: int, colours: dict[str, list[str]]
) -> list[str]:
    out = [
        f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="#fff" stroke="#555"/>',
        f'<text x="{x + 3}" y="{y + 10}" font-size="9">rack {escape(rack[1] or "(unlabelled)")}</text>',
    ]
    top = y + 14
    last_clique: str | None = None
    for j, info in enumerate(nodes):
        ny = top + j * NODE_H
        if info.path[2] != last_clique and not info.path[2].startswith("host:"):
            span = sum(1 for n in nodes if n.path[2] == info.path[2])
            out.append(
                f'<rect x="{x + 2}" y="{ny - 1}" width="{w - 4}" height="{span * NODE_H}" fill="none" '
                f'stroke="#36c" stroke-dasharray="3,2"/>'
            )
        last_clique = info.path[2]
        gang = colours.get(info.name, [])
        others = info.allocatable - info.free
        for g in range(info.allocatable):
            if g < others:
                fill = "#bbb"
            elif g - others < len(gang):
                fill = gang[g - others]
            else:
                fill = "#fff"
            gx = x + RACK_PAD + g * (GPU + GAP)
            out.append(f'<rect x="{gx}" y="{ny + 2}" width="{GPU}" height="{GPU}" fill="{fill}" stroke="#666" '
                       f'stroke-width="0.5"><title>{escape(info.name)} GPU {g}</title></rect>')
    return out


def _gang_colours(plan: Plan, request: GangRequest) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    if not plan.feasible or plan.parallelism is None:
        return out
    t, p, d = plan.parallelism["tensor"], plan.parallelism["pipeline"], plan.parallelism["data"]
    for pod in plan.assignments:
        for rank in range(pod.ranks[0], pod.ranks[1] + 1):
            _, pp, dp = rank_coords(rank, t, p, d, request.rank_order)
            out.setdefault(pod.node, []).append(colour(pp, p, dp, d))
    return out


def _title(plan: Plan, request: GangRequest) -> str:
    if not plan.feasible or plan.parallelism is None:
        return f"not placeable: {plan.reason}"
    par = plan.parallelism
    return (
        f"pool {plan.pool}: tp={par['tensor']} pp={par['pipeline']} dp={par['data']}, "
        f"{len(plan.assignments)} pods x {request.gpus_per_pod} GPUs, cost {plan.cost.total} "
        f"(rack {plan.cost.rack}, block {plan.cost.block})"
    )
