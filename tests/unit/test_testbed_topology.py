"""Topology files turn into the nodes DESIGN.md describes (pure, no cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.topology import (
    BLOCK_LABEL,
    CLIQUE_LABEL,
    GPU_RESOURCE,
    HOSTNAME_LABEL,
    PRODUCT_LABEL,
    RACK_LABEL,
    generate_scale_topology,
    node_manifest,
    parse_topology,
    plan_nodes,
)

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"


@pytest.mark.parametrize(
    ("file", "nodes", "gpus"),
    [("tiny.yaml", 5, 40), ("two-pool.yaml", 32, 256), ("nvl72.yaml", 72, 288)],
)
def test_example_topologies_have_the_documented_size(file: str, nodes: int, gpus: int) -> None:
    topology = parse_topology(CLUSTERS / file)
    plans = list(plan_nodes(topology))
    assert len(plans) == topology.node_count == nodes
    assert sum(p.pool.gpus_per_node for p in plans) == gpus
    assert len({p.name for p in plans}) == nodes


def test_node_carries_topology_labels_and_gpu_capacity() -> None:
    plans = {p.name: p for p in plan_nodes(parse_topology(CLUSTERS / "two-pool.yaml"))}
    node = node_manifest(plans["a100-b1-r0-n3"], "two-pool")
    labels = node["metadata"]["labels"]
    assert labels[BLOCK_LABEL] == "a100-b1"
    assert labels[RACK_LABEL] == "a100-b1-r0"
    assert labels[HOSTNAME_LABEL] == "a100-b1-r0-n3"
    assert labels[PRODUCT_LABEL] == "A100-80GB"
    assert CLIQUE_LABEL not in labels  # HGX: the NVLink domain is the node itself
    assert node["status"]["capacity"][GPU_RESOURCE] == "8"
    assert node["status"]["allocatable"] == node["status"]["capacity"]


def test_nvl72_racks_form_one_nvlink_clique_each() -> None:
    plans = list(plan_nodes(parse_topology(CLUSTERS / "nvl72.yaml")))
    cliques: dict[str, set[str]] = {}
    for plan in plans:
        clique = node_manifest(plan, "nvl72")["metadata"]["labels"][CLIQUE_LABEL]
        cliques.setdefault(clique, set()).add(plan.rack)
    assert len(cliques) == 4
    assert all(len(racks) == 1 for racks in cliques.values())


def test_preload_takes_gpus_on_every_nth_node() -> None:
    plans = [
        p for p in plan_nodes(parse_topology(CLUSTERS / "two-pool.yaml")) if p.pool.name == "a100"
    ]
    assert [p.preload_gpus for p in plans[:4]] == [3, 0, 0, 3]
    assert sum(1 for p in plans if p.preload_gpus) == 6


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"nodesPerRack": 4, "nvlinkDomainNodes": 3}, "never spans racks"),
        ({"gpusPerNode": 0}, "gpus_per_node must be >= 1"),
        ({"preload": {"everyNthNode": 1, "gpus": 9}}, "preload.gpus"),
        ({"gpus": 8}, "unknown keys ['gpus']"),
    ],
)
def test_invalid_pools_are_rejected_with_the_reason(pool: dict[str, Any], message: str) -> None:
    raw = {
        "name": "bad",
        "pools": [{"name": "p", "product": "H100-80GB", "gpusPerNode": 8, **pool}],
    }
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_topology(raw)


def test_scale_topology_has_the_requested_node_count() -> None:
    topology = parse_topology(generate_scale_topology(1000))
    assert topology.node_count == 1000
    assert {p.product for p in topology.pools} == {"H100-80GB", "A100-80GB"}
