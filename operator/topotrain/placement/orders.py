"""Candidate orders in which a gang's units are laid into the chosen domains.

Filling domains in sequence turns each order into a placement. Rank order keeps
whole replicas together (cheap pipeline traffic, data groups spread over every
domain used); stage-major keeps data groups together; tiles of `a` stages x `b`
replicas sized to a rack balance the two (cost ~ 1/a + 1/b instead of 1 + 1/c);
Hilbert orders keep every contiguous stretch compact at all scales at once.
"""

from __future__ import annotations

from collections.abc import Callable

from topotrain.placement.request import Mesh

Key = Callable[[int, int, int], tuple[int, ...]]  # (pp, dp, first pod) -> sort key


def hilbert_index(side: int, x: int, y: int) -> int:
    """Position of (x, y) on the Hilbert curve filling a side x side square (side a power of 2)."""
    d = 0
    s = side // 2
    while s > 0:
        rx = 1 if x & s else 0
        ry = 1 if y & s else 0
        d += s * s * ((3 * rx) ^ ry)
        if ry == 0:
            if rx == 1:
                x, y = side - 1 - x, side - 1 - y
            x, y = y, x
        s //= 2
    return d


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v < n:
        out.append(v)
        v *= 2
    return [*out, n]


def tile_shapes(pipeline: int, data: int, cells_per_unit: int, target_units: int) -> list[tuple[int, int]]:
    """(stages, replicas) tiles holding about `target_units` units, squarest first."""
    shapes = []
    for a in _pow2_upto(pipeline):
        for b in _pow2_upto(data):
            area = a * b / cells_per_unit
            if target_units / 2 < area <= target_units and (a, b) not in ((pipeline, 1), (1, data)):
                shapes.append((a, b))
    shapes.sort(key=lambda ab: (abs(ab[0] - ab[1]), ab))
    return shapes[:3]


def candidate_keys(mesh: Mesh, targets: list[int]) -> list[tuple[str, Key]]:
    """Named sort keys for the units; `targets` are typical domain sizes in units (rack, block)."""
    req = mesh.request
    p, d = req.pipeline, req.data
    side = 1
    while side < max(p, d):
        side *= 2
    keys: list[tuple[str, Key]] = [
        ("rank-order", lambda pp, dp, i: (i,)),
        ("stage-major", lambda pp, dp, i: (pp, dp, i)),
        ("hilbert", lambda pp, dp, i: (hilbert_index(side, pp, dp), i)),
        ("hilbert-t", lambda pp, dp, i: (hilbert_index(side, dp, pp), i)),
    ]
    for width in (2, 3, 4, 6, 8):
        if width < d:
            keys.append((f"snake-{width}", _snake_key(width)))
    cells = max(1, req.gpus_per_pod // req.tensor)
    rack_shapes: list[tuple[int, int]] = []
    for target in sorted(set(targets)):
        for a, b in tile_shapes(p, d, cells, target):
            keys.append((f"tile-{a}x{b}", _tile_key(((a, b),))))
            for a2, b2 in rack_shapes:
                if a % a2 == 0 and b % b2 == 0:
                    keys.append((f"tile-{a}x{b}/{a2}x{b2}", _tile_key(((a, b), (a2, b2)))))
            rack_shapes.append((a, b))
    return keys


def _snake_key(width: int) -> Key:
    """Strips of `width` replicas walked stage by stage, alternately down and up: any stretch
    is a compact (stages x width) block, and a run of strips whole replicas."""

    def key(pp: int, dp: int, i: int) -> tuple[int, ...]:
        strip = dp // width
        return (strip, pp if strip % 2 == 0 else -pp, dp, i)

    return key


def _tile_key(tiles: tuple[tuple[int, int], ...]) -> Key:
    def key(pp: int, dp: int, i: int) -> tuple[int, ...]:
        out: list[int] = []
        for a, b in tiles:
            out += [dp // b, pp // a]
        return (*out, dp, pp, i)

    return key


def unit_order(mesh: Mesh, key: Key) -> list[int]:
    """Units sorted by the key of their first pod's (pp, dp)."""
    firsts = [unit[0] for unit in mesh.tp_units]
    return sorted(range(len(firsts)), key=lambda u: key(*mesh.coords[firsts[u]], firsts[u]))
