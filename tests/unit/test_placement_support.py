"""Builders shared by the placement tests (no tests here): snapshots, random small clusters, a brute-force optimum."""

from __future__ import annotations

import random
from typing import Any

from topotrain.placement import GangRequest, Mesh
from topotrain.placement.cost import DomainIndex, evaluate
from topotrain.placement.topology import TopologyLevels

LEVELS = TopologyLevels()


def node(
    name: str,
    gpus: int = 8,
    *,
    block: str = "b0",
    rack: str = "r0",
    clique: str | None = None,
    product: str = "H100-80GB",
    ready: bool = True,
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node as `kubectl get node -o yaml` prints it."""
    all_labels = {LEVELS.block: block, LEVELS.rack: rack, LEVELS.host: name, LEVELS.product: product}
    if clique is not None:
        all_labels[LEVELS.nvlink] = clique
    all_labels.update(labels or {})
    spec: dict[str, Any] = {}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = taints
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "spec": spec,
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "96"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pod(
    node_name: str | None, gpus: int, *, phase: str = "Running", limits_only: bool = False,
    labels: dict[str, str] | None = None, name: str = "p",
) -> dict[str, Any]:
    resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if limits_only else {
        "requests": {"nvidia.com/gpu": str(gpus)}, "limits": {"nvidia.com/gpu": str(gpus)}
    }
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": resources}]}
    if node_name:
        spec["nodeName"] = node_name
    return {"metadata": {"name": name, "namespace": "x", "labels": labels or {}}, "spec": spec, "status": {"phase": phase}}


def random_cluster(rng: random.Random, max_nodes: int = 8) -> list[dict[str, Any]]:
    """A small random topology: 1-2 blocks, racks, NVLink cliques of 1-3 nodes, 1-8 free GPUs."""
    nodes: list[dict[str, Any]] = []
    count = rng.randint(2, max_nodes)
    per_rack = rng.choice([1, 2, 3, 4])
    racks_per_block = rng.choice([1, 2, 3])
    clique_size = rng.choice([1, 1, 2, 3])
    for i in range(count):
        rack = i // per_rack
        clique = f"c{i // clique_size}-{rack}" if clique_size > 1 else None
        nodes.append(node(
            f"n{i}", rng.choice([2, 4, 4, 8, 8]), block=f"b{rack // racks_per_block}", rack=f"r{rack}", clique=clique,
        ))
    return nodes


def random_request(rng: random.Random, max_pods: int = 8) -> GangRequest:
    while True:
        tensor = rng.choice([1, 2, 4])
        pipeline = rng.choice([1, 2, 3, 4])
        data = rng.choice([1, 2, 3, 4])
        gpp = rng.choice([g for g in (1, 2, 4) if g % tensor == 0 or tensor % g == 0])
        world = tensor * pipeline * data
        if world % gpp == 0 and 2 <= world // gpp <= max_pods:
            order = rng.choice(["tp-pp-dp", "tp-dp-pp"])
            return GangRequest(tensor=tensor, pipeline=pipeline, data=data, gpus_per_pod=gpp, rank_order=order)


def brute_force(mesh: Mesh, index: DomainIndex) -> int | None:
    """The optimum of the cost model over every assignment that keeps the hard constraints.

    Cost depends only on each pod's NVLink domain, so pods are assigned to domains
    (with room counted in pod slots), branch and bound on the partial cost.
    """
    g = mesh.request.gpus_per_pod
    cliques = sorted(set(index.clique))
    rep = {c: index.clique.index(c) for c in cliques}
    room = {c: sum(index.nodes[i].free // g for i in range(len(index.nodes)) if index.clique[i] == c) for c in cliques}
    unit_of = {p: u for u, unit in enumerate(mesh.tp_units) for p in unit}
    rack_of_unit_group = {p: r for r, grp in enumerate(mesh.rack_units) for p in grp}
    best: list[int | None] = [None]
    assign = [-1] * mesh.pods

    def partial_cost() -> int:
        placed = [a if a >= 0 else -1 for a in assign]
        total = 0
        for a, b, mult in mesh.pp_pairs:
            if placed[a] >= 0 and placed[b] >= 0:
                total += mult * index.distance(placed[a], placed[b])
        for members, mult in mesh.dp_groups:
            nodes_in = [placed[p] for p in members if placed[p] >= 0]
            for level, w in enumerate((1, 4, 16)):
                if nodes_in:
                    total += w * mult * (len({index.dom[level][n] for n in nodes_in}) - 1)
        return total

    def ok(p: int, c: int) -> bool:
        node = rep[c]
        for q in range(p):
            if unit_of[q] == unit_of[p] and index.clique[assign[q]] != index.clique[node]:
                return False
            if rack_of_unit_group[q] == rack_of_unit_group[p] and index.rack[assign[q]] != index.rack[node]:
                return False
        return True

    def dfs(p: int) -> None:
        if best[0] is not None and partial_cost() >= best[0]:
            return
        if p == mesh.pods:
            best[0] = partial_cost()
            return
        for c in cliques:
            if room[c] > 0 and ok(p, c):
                room[c] -= 1
                assign[p] = rep[c]
                dfs(p + 1)
                assign[p] = -1
                room[c] += 1

    dfs(0)
    return best[0]


def cost_of(mesh: Mesh, index: DomainIndex, nodes_by_pod: dict[int, str]) -> int:
    position = {name: i for i, name in enumerate(index.names)}
    return evaluate(mesh, index, [position[nodes_by_pod[i]] for i in range(mesh.pods)]).total
