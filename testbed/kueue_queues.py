"""Kueue's queue objects for a testbed fleet, pure: a Topology with the fleet's levels, a
ResourceFlavor per GPU pool, one ClusterQueue over them and a LocalQueue, as a Kueue user
would write them for the same nodes; and a Workload's topology assignment read back as
(node label values, pods) pairs.

The Topology's levels are the operator's own (`topotrain.kueue.topology_manifest`): block,
rack, NVLink domain, host. Kueue's TAS ignores a node that lacks a value for any level, so
when some pool has no multi-node NVLink domains (no `nvidia.com/gpu.clique` label: an HGX
board is its own domain) the NVLink level is the hostname, which the Topology then lists
once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from topotrain.kueue import KUEUE_API_VERSION, topology_domains, topology_manifest
from topotrain.topology import TopologyLevels

from testbed.topology import (
    CLIQUE_LABEL,
    GPU_RESOURCE,
    HOSTNAME_LABEL,
    PRODUCT_LABEL,
    Pool,
    Topology,
)

POOL_LABEL = "node.kubernetes.io/instance-type"  # testbed-<pool>, one value per pool


def levels_for(node_labels: Iterable[Mapping[str, str]]) -> TopologyLevels:
    """The operator's levels, with the NVLink level on the hostname unless every node
    carries a clique label (a node without one would be invisible to Kueue's TAS)."""
    if all(CLIQUE_LABEL in labels for labels in node_labels):
        return TopologyLevels()
    return TopologyLevels(nvlink=HOSTNAME_LABEL)


def topology_levels(topology: Topology) -> TopologyLevels:
    """`levels_for` a topology file's nodes without listing them."""
    if topology.pools and all(pool.nvlink_domain_nodes > 1 for pool in topology.pools):
        return TopologyLevels()
    return TopologyLevels(nvlink=HOSTNAME_LABEL)


@dataclass(frozen=True)
class Flavor:
    """One ResourceFlavor: the pool's node labels and its nominal quota per resource."""

    name: str
    node_labels: Mapping[str, str]
    quota: Mapping[str, str]


def pool_flavor(pool: Pool, *, extra_quota: Mapping[str, str] | None = None) -> Flavor:
    """The flavor of one testbed pool: its GPU product and pool label, quota = its GPUs.

    The product label is among the node labels so that Kueue, which matches a pod's
    required node affinity only on keys the flavor names, never gives a job that accepts
    one product a flavor of another."""
    quota = {GPU_RESOURCE: str(pool.node_count * pool.gpus_per_node), **(extra_quota or {})}
    labels = {PRODUCT_LABEL: pool.product, POOL_LABEL: f"testbed-{pool.name}"}
    return Flavor(pool.name, labels, quota)


@dataclass(frozen=True)
class KueueQueues:
    """The names of one set of queue objects, and the objects themselves."""

    prefix: str
    namespace: str
    levels: TopologyLevels
    flavors: tuple[Flavor, ...]
    preemption: Mapping[str, str] = field(
        default_factory=lambda: {"withinClusterQueue": "LowerPriority"}
    )

    @property
    def topology(self) -> str:
        return f"{self.prefix}-topology"

    @property
    def cluster_queue(self) -> str:
        return f"{self.prefix}-cq"

    @property
    def local_queue(self) -> str:
        return self.prefix

    def flavor_name(self, flavor: Flavor) -> str:
        return f"{self.prefix}-{flavor.name}"

    def manifests(self) -> list[dict[str, Any]]:
        """Topology, ResourceFlavors, ClusterQueue, LocalQueue: the order to apply them in."""
        objects = [topology_manifest(self.topology, self.levels)]
        objects += [self._resource_flavor(f) for f in self.flavors]
        objects += [self._cluster_queue(), self._local_queue()]
        return objects

    def _resource_flavor(self, flavor: Flavor) -> dict[str, Any]:
        return {
            "apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor",
            "metadata": {"name": self.flavor_name(flavor)},
            "spec": {"nodeLabels": dict(flavor.node_labels), "topologyName": self.topology},
        }  # fmt: skip

    def _cluster_queue(self) -> dict[str, Any]:
        """One resource group: every flavor covers every resource any flavor has quota for
        (Kueue requires that), in the flavors' order, which is Kueue's order of preference."""
        covered = list(dict.fromkeys(r for f in self.flavors for r in f.quota))
        flavors = [
            {
                "name": self.flavor_name(f),
                "resources": [{"name": r, "nominalQuota": f.quota.get(r, "0")} for r in covered],
            }
            for f in self.flavors
        ]
        return {
            "apiVersion": KUEUE_API_VERSION, "kind": "ClusterQueue",
            "metadata": {"name": self.cluster_queue},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [{"coveredResources": covered, "flavors": flavors}],
                "preemption": dict(self.preemption),
            },
        }  # fmt: skip

    def _local_queue(self) -> dict[str, Any]:
        return {
            "apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
            "metadata": {"name": self.local_queue, "namespace": self.namespace},
            "spec": {"clusterQueue": self.cluster_queue},
        }  # fmt: skip


def queue_manifests(
    topology: Topology,
    namespace: str,
    *,
    prefix: str = "testbed",
    pools: Sequence[str] | None = None,
    extra_quota: Mapping[str, str] | None = None,
    levels: TopologyLevels | None = None,
) -> KueueQueues:
    """Queue objects for `topology`'s GPU pools (all, or those named in `pools`, in that
    order: the ClusterQueue's flavor order). `extra_quota` (cpu, memory) is added to every
    flavor when the pods request those resources; Kueue refuses a pod requesting a resource
    its ClusterQueue does not cover."""
    by_name = {pool.name: pool for pool in topology.pools}
    chosen = [by_name[name] for name in pools] if pools is not None else list(topology.pools)
    flavors = tuple(pool_flavor(pool, extra_quota=extra_quota) for pool in chosen)
    return KueueQueues(prefix, namespace, levels or topology_levels(topology), flavors)


def assigned_domains(topology_assignment: Mapping[str, Any]) -> list[tuple[tuple[str, ...], int]]:
    """A v1beta2 `topologyAssignment` as [(values of its levels, pods in that domain)], read
    as the operator reads it (`topotrain.kueue.topology_domains`)."""
    return [(tuple(values), pods) for values, pods in topology_domains(topology_assignment)]
