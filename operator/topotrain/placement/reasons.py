"""Why a gang does not fit, in words a user can act on."""

from __future__ import annotations

from topotrain.placement.cost import DomainIndex
from topotrain.placement.fill import Tree
from topotrain.placement.request import Mesh


def pods_reason(pool: str, index: DomainIndex, pods: int, gpus_per_pod: int) -> str | None:
    """Not enough whole-pod room for `pods` pods, by arithmetic on free GPUs (no mesh needed)."""
    g = gpus_per_pod
    slots = sum(n.free // g for n in index.nodes)
    if slots >= pods:
        return None
    free = sum(n.free for n in index.nodes)
    holding = sum(1 for n in index.nodes if n.free > 0)
    text = f"pool {pool}: {free} free GPUs in {holding} nodes, need {pods * g} ({pods} pods x {g})"
    if free >= pods * g:
        text += f"; only {slots} pods of {g} GPUs fit on whole nodes"
    return text


def capacity_reason(pool: str, index: DomainIndex, mesh: Mesh) -> str:
    """Not enough whole-pod room, or not enough NVLink domains for the tensor-parallel groups."""
    req = mesh.request
    g, t = req.gpus_per_pod, req.tensor
    short = pods_reason(pool, index, mesh.pods, g)
    if short is not None:
        return short
    tree = Tree.build(index, g, mesh.unit_size)
    units = len(mesh.tp_units)
    largest = max((sum(tree.slots[n] for n in nodes) * g for nodes in tree.clique_nodes.values()), default=0)
    if largest < t:
        return (
            f"pool {pool}: no NVLink domain has {t} free GPUs for a tensor-parallel group of {t} "
            f"(largest: {largest} in {g}-GPU pods)"
        )
    return (
        f"pool {pool}: NVLink domains hold only {tree.total_cap()} tensor-parallel groups of {t} GPUs, "
        f"need {units}"
    )


def racked_reason(pool: str, tree: Tree, mesh: Mesh) -> str:
    """A Required pipeline/data group does not fit in one rack."""
    req = mesh.request
    dims = [d for d in ("pipeline", "data") if getattr(req, f"{d}_topology") == "Required"]
    what = " and ".join(dims) or "tensor"
    group_pods = max(len(g) for g in mesh.rack_units)
    group_units = group_pods // mesh.unit_size
    groups = len(mesh.rack_units)
    caps = sorted((tree.rack_cap(r) for racks in tree.block_racks.values() for r in racks), reverse=True)
    rule = " and ".join(f"topology.{d}=Required" for d in dims)
    largest = (caps[0] if caps else 0) * mesh.unit_size
    if largest < group_pods:
        return (
            f"pool {pool}: {rule} keeps each {what} group ({group_pods} pods, {group_pods * req.gpus_per_pod} GPUs) "
            f"inside one rack; the largest rack has room for {largest} pods"
        )
    fit = sum(cap // group_units for cap in caps)
    if fit >= groups:
        return f"pool {pool}: best-fit packing of {groups} {what} groups ({group_pods} pods each) into racks failed under {rule}"
    return (
        f"pool {pool}: racks fit only {fit} of {groups} {what} groups ({group_pods} pods each) under {rule}"
    )
