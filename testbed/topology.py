"""Cluster topology files (`examples/clusters/*.yaml`) and the Node manifests they describe.

The format, its parser and the Node manifests are the product's (`topotrain.cli.fleet_file`:
`topotrain plan --nodes` reads these files too); the testbed adds KWOK's annotation to each
Node, and the scale benchmark's generated fleets.
"""

from __future__ import annotations

from typing import Any

from topotrain.cli import fleet_file
from topotrain.cli.fleet_file import (
    BLOCK_LABEL,
    CLIQUE_LABEL,
    GPU_COUNT_LABEL,
    GPU_RESOURCE,
    HOSTNAME_LABEL,
    PRELOAD_NAMESPACE,
    PRODUCT_LABEL,
    RACK_LABEL,
    TOPOLOGY_LABEL,
    NodePlan,
    Pool,
    Preload,
    Topology,
    parse_topology,
    plan_nodes,
    preload_pod_manifest,
)

from testbed.components import KWOK_NODE_ANNOTATION, KWOK_NODE_VALUE

__all__ = [
    "BLOCK_LABEL",
    "CLIQUE_LABEL",
    "GPU_COUNT_LABEL",
    "GPU_RESOURCE",
    "HOSTNAME_LABEL",
    "PRELOAD_NAMESPACE",
    "PRODUCT_LABEL",
    "RACK_LABEL",
    "TOPOLOGY_LABEL",
    "NodePlan",
    "Pool",
    "Preload",
    "Topology",
    "generate_scale_topology",
    "node_manifest",
    "parse_topology",
    "plan_nodes",
    "preload_pod_manifest",
]


def node_manifest(plan: NodePlan, topology_name: str) -> dict[str, Any]:
    """The Node object KWOK will manage: labels, annotations, capacity = allocatable."""
    return fleet_file.node_manifest(plan, topology_name, {
        KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE, "node.alpha.kubernetes.io/ttl": "0"})


def generate_scale_topology(
    nodes: int, nodes_per_rack: int = 10, racks_per_block: int = 10, prefix: str = ""
) -> dict[str, Any]:
    """A two-pool HGX topology (H100 and A100 halves) of `nodes` nodes, for the scale benchmark."""
    per_block = nodes_per_rack * racks_per_block
    if nodes % (2 * per_block):
        raise ValueError(f"nodes must be a multiple of {2 * per_block}")
    pool = {"gpusPerNode": 8, "blocks": nodes // (2 * per_block), "racksPerBlock": racks_per_block,
            "nodesPerRack": nodes_per_rack, "nvlinkDomainNodes": 1}  # fmt: skip
    return {
        "name": f"{prefix}scale-{nodes}",
        "pools": [
            {"name": f"{prefix}h100", "product": "H100-80GB", **pool},
            {"name": f"{prefix}a100", "product": "A100-80GB", **pool},
        ],
    }
