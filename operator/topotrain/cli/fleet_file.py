"""Fleet files (`examples/clusters/*.yaml`): a GPU fleet's topology in a few lines, and the Node
manifests it describes. `topotrain plan --nodes` reads them as well as `kubectl get nodes -o
yaml` output; the testbed creates its KWOK nodes from them (testbed/topology.py adds KWOK's
annotation). Pure: parsing and manifest building never touch an API server.

    name: two-pool
    pools:
      - name: h100
        product: H100-80GB          # nvidia.com/gpu.product, the pool
        gpusPerNode: 8
        blocks: 1
        racksPerBlock: 2
        nodesPerRack: 4
        nvlinkDomainNodes: 1        # 1: one HGX board per node; >1: multi-node clique (NVL72)
        cpu: "192"                  # optional, with memory, pods
        memory: 2Ti
        preload:                    # optional: pods already holding GPUs
          everyNthNode: 2
          gpus: 3

Node names read `<pool>-b<block>-r<rack>-n<node>`; block and rack label values
carry the pool name too, so two pools never share a rack by accident.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BLOCK_LABEL = "topology.topotrain.io/block"
RACK_LABEL = "topology.topotrain.io/rack"
CLIQUE_LABEL = "nvidia.com/gpu.clique"
HOSTNAME_LABEL = "kubernetes.io/hostname"
PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_RESOURCE = "nvidia.com/gpu"
TOPOLOGY_LABEL = "testbed.topotrain.io/topology"
PRELOAD_NAMESPACE = "testbed-preload"


@dataclass(frozen=True)
class Preload:
    every_nth_node: int
    gpus: int


@dataclass(frozen=True)
class Pool:
    name: str
    product: str
    gpus_per_node: int
    blocks: int = 1
    racks_per_block: int = 1
    nodes_per_rack: int = 1
    nvlink_domain_nodes: int = 1
    cpu: str = "96"
    memory: str = "1Ti"
    pods: int = 110
    preload: Preload | None = None

    def __post_init__(self) -> None:
        for attr in ("gpus_per_node", "blocks", "racks_per_block", "nodes_per_rack"):
            if getattr(self, attr) < 1:
                raise ValueError(f"pool {self.name}: {attr} must be >= 1")
        if self.nodes_per_rack % self.nvlink_domain_nodes:
            raise ValueError(
                f"pool {self.name}: nodesPerRack ({self.nodes_per_rack}) must be a multiple of "
                f"nvlinkDomainNodes ({self.nvlink_domain_nodes}); an NVLink domain never spans racks"
            )
        if self.preload and not 0 < self.preload.gpus <= self.gpus_per_node:
            raise ValueError(f"pool {self.name}: preload.gpus must be in 1..gpusPerNode")

    @property
    def node_count(self) -> int:
        return self.blocks * self.racks_per_block * self.nodes_per_rack


@dataclass(frozen=True)
class Topology:
    name: str
    pools: tuple[Pool, ...] = field(default_factory=tuple)

    @property
    def node_count(self) -> int:
        return sum(pool.node_count for pool in self.pools)


_POOL_KEYS = {
    "name": "name", "product": "product", "gpusPerNode": "gpus_per_node", "blocks": "blocks",
    "racksPerBlock": "racks_per_block", "nodesPerRack": "nodes_per_rack",
    "nvlinkDomainNodes": "nvlink_domain_nodes", "cpu": "cpu", "memory": "memory", "pods": "pods",
}  # fmt: skip


def parse_topology(source: Path | str | Mapping[str, Any]) -> Topology:
    """A Topology from a YAML file path or an already-loaded mapping."""
    raw: Mapping[str, Any] = (
        source if isinstance(source, Mapping) else yaml.safe_load(Path(source).read_text())
    )
    if not isinstance(raw.get("name"), str) or not isinstance(raw.get("pools"), list):
        raise ValueError("a fleet file needs name (a string) and pools (a list)")
    pools = []
    for entry in raw.get("pools", []):
        unknown = set(entry) - set(_POOL_KEYS) - {"preload"}
        if unknown:
            raise ValueError(f"pool {entry.get('name')}: unknown keys {sorted(unknown)}")
        kwargs = {_POOL_KEYS[k]: v for k, v in entry.items() if k in _POOL_KEYS}
        if "cpu" in kwargs:
            kwargs["cpu"] = str(kwargs["cpu"])
        preload = entry.get("preload")
        if preload:
            kwargs["preload"] = Preload(int(preload["everyNthNode"]), int(preload["gpus"]))
        pools.append(Pool(**kwargs))
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"topology {raw.get('name')}: pool names must be unique: {names}")
    return Topology(name=str(raw["name"]), pools=tuple(pools))


@dataclass(frozen=True)
class NodePlan:
    """One node to create, with its place in the topology."""

    name: str
    pool: Pool
    block: str
    rack: str
    clique: str | None
    index: int  # position within the pool, for preload selection

    @property
    def preload_gpus(self) -> int:
        preload = self.pool.preload
        return preload.gpus if preload and self.index % preload.every_nth_node == 0 else 0


def plan_nodes(topology: Topology) -> Iterator[NodePlan]:
    for pool in topology.pools:
        index = 0
        for b in range(pool.blocks):
            block = f"{pool.name}-b{b}"
            for r in range(pool.racks_per_block):
                rack = f"{block}-r{r}"
                for n in range(pool.nodes_per_rack):
                    clique = None
                    if pool.nvlink_domain_nodes > 1:
                        clique = f"{rack}.{n // pool.nvlink_domain_nodes}"
                    yield NodePlan(f"{rack}-n{n}", pool, block, rack, clique, index)
                    index += 1


def node_manifest(plan: NodePlan, topology_name: str,
                  annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The Node object: labels, `annotations`, capacity = allocatable."""
    pool = plan.pool
    labels = {
        HOSTNAME_LABEL: plan.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": f"testbed-{pool.name}",
        "type": "kwok",
        BLOCK_LABEL: plan.block,
        RACK_LABEL: plan.rack,
        PRODUCT_LABEL: pool.product,
        GPU_COUNT_LABEL: str(pool.gpus_per_node),
        TOPOLOGY_LABEL: topology_name,
    }
    if plan.clique is not None:
        labels[CLIQUE_LABEL] = plan.clique
    resources = {
        "cpu": pool.cpu,
        "memory": pool.memory,
        "pods": str(pool.pods),
        "ephemeral-storage": "1Ti",
        GPU_RESOURCE: str(pool.gpus_per_node),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": plan.name,
            "labels": labels,
            "annotations": dict(annotations or {}),
        },
        "spec": {},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


def preload_pod_manifest(plan: NodePlan, topology_name: str) -> dict[str, Any]:
    """A pod bound straight to the node, holding GPUs so the cluster starts fragmented."""
    gpus = str(plan.preload_gpus)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"preload-{plan.name}",
            "namespace": PRELOAD_NAMESPACE,
            "labels": {"app.kubernetes.io/name": "testbed-preload", TOPOLOGY_LABEL: topology_name},
        },
        "spec": {
            "nodeName": plan.name,
            "containers": [
                {
                    "name": "hold",
                    "image": "testbed.invalid/preload:0",
                    "resources": {"requests": {GPU_RESOURCE: gpus}, "limits": {GPU_RESOURCE: gpus}},
                }
            ],
            "automountServiceAccountToken": False,
        },
    }
