"""Kueue's queue objects for a testbed fleet, pure: a Topology with the fleet's levels, a
ResourceFlavor per GPU pool, one ClusterQueue over them and a LocalQueue, as a Kueue user
would write them for the same nodes; and a Workload's topology assignment read back as
(node label values, pods) pairs.

The Topology's levels are the operator's own (`topotrain.core.kueue.topology_manifest`): block,
rack, NVLink domain, host. Kueue's TAS ignores a node that lacks a value for any level, so
when some pool has no multi-node NVLink domains (no `nvidia.com/gpu.clique` label: an HGX
board is its own domain) the NVLink level is the hostname, which the Topology then lists
once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from topotrain.core.kueue import KUEUE_API_VERSION, topology_manifest
from topotrain.core.kueue_admission import topology_domains
from topotrain.placement.topology import TopologyLevels

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
    # Further flavor orders (flavor names, first preferred): a job that prefers a GPU type
    # other than the ClusterQueue's first flavor's goes to the LocalQueue of an order that
    # starts with it. Kueue takes flavor order from the ClusterQueue alone, so each order is a
    # ClusterQueue of its own, with no quota, borrowing the first one's through a cohort.
    orders: tuple[tuple[str, ...], ...] = ()

    @property
    def topology(self) -> str:
        return f"{self.prefix}-topology"

    @property
    def cluster_queue(self) -> str:
        return f"{self.prefix}-cq"

    @property
    def local_queue(self) -> str:
        return self.prefix

    @property
    def cohort(self) -> str:
        return f"{self.prefix}-cohort"

    @property
    def cluster_queues(self) -> list[str]:
        """Every ClusterQueue: the first (holding the quota), then one per further order."""
        return [self.cluster_queue, *(f"{self.cluster_queue}-{o[0]}-first" for o in self.orders)]

    def flavor_name(self, flavor: Flavor) -> str:
        return f"{self.prefix}-{flavor.name}"

    def queue_for(self, products: Sequence[str]) -> str:
        """The LocalQueue for a job accepting GPU `products` in that order of preference: the
        one of the order that starts with the first product's flavor; the first LocalQueue
        when no further order does (its ClusterQueue's first flavor, or no orders made)."""
        by_name = {f.name: f for f in self.flavors}
        for order in self.orders:
            if products and by_name[order[0]].node_labels.get(PRODUCT_LABEL) == products[0]:
                return f"{self.prefix}-{order[0]}-first"
        return self.local_queue

    def manifests(self) -> list[dict[str, Any]]:
        """Topology, ResourceFlavors, ClusterQueues, LocalQueues: the order to apply them in."""
        objects = [topology_manifest(self.topology, self.levels)]
        objects += [self._resource_flavor(f) for f in self.flavors]
        objects += [self._cluster_queue(), self._local_queue(self.local_queue, self.cluster_queue)]
        by_name = {f.name: f for f in self.flavors}
        for order, cq in zip(self.orders, self.cluster_queues[1:], strict=True):
            objects.append(self._cluster_queue(cq, [by_name[n] for n in order], borrowed=True))
            objects.append(self._local_queue(f"{self.prefix}-{order[0]}-first", cq))
        return objects

    def _resource_flavor(self, flavor: Flavor) -> dict[str, Any]:
        return {
            "apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor",
            "metadata": {"name": self.flavor_name(flavor)},
            "spec": {"nodeLabels": dict(flavor.node_labels), "topologyName": self.topology},
        }  # fmt: skip

    def _cluster_queue(self, name: str | None = None, order: Sequence[Flavor] | None = None,
                       *, borrowed: bool = False) -> dict[str, Any]:  # fmt: skip
        """One resource group: every flavor covers every resource any flavor has quota for
        (Kueue requires that), in the flavors' order, which is Kueue's order of preference.
        `borrowed`: no quota of its own, all of it borrowed from the cohort."""
        order = list(self.flavors if order is None else order)
        covered = list(dict.fromkeys(r for f in self.flavors for r in f.quota))
        flavors = [
            {
                "name": self.flavor_name(f),
                "resources": [
                    {"name": r, "nominalQuota": "0" if borrowed else f.quota.get(r, "0")}
                    for r in covered
                ],
            }
            for f in order
        ]
        spec: dict[str, Any] = {
            "namespaceSelector": {},
            "resourceGroups": [{"coveredResources": covered, "flavors": flavors}],
            "preemption": dict(self.preemption),
        }
        if self.orders:
            spec["cohortName"] = self.cohort
        return {
            "apiVersion": KUEUE_API_VERSION, "kind": "ClusterQueue",
            "metadata": {"name": name or self.cluster_queue}, "spec": spec,
        }  # fmt: skip

    def _local_queue(self, name: str, cluster_queue: str) -> dict[str, Any]:
        return {
            "apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"clusterQueue": cluster_queue},
        }  # fmt: skip


def queue_manifests(
    topology: Topology,
    namespace: str,
    *,
    prefix: str = "testbed",
    pools: Sequence[str] | None = None,
    extra_quota: Mapping[str, str] | None = None,
    levels: TopologyLevels | None = None,
    preference_orders: bool = False,
) -> KueueQueues:
    """Queue objects for `topology`'s GPU pools (all, or those named in `pools`, in that
    order: the ClusterQueue's flavor order). `extra_quota` (cpu, memory) is added to every
    flavor when the pods request those resources; Kueue refuses a pod requesting a resource
    its ClusterQueue does not cover. `preference_orders`: for every further flavor, a
    ClusterQueue and LocalQueue that try it first (then the others in order), sharing the
    first ClusterQueue's quota in a cohort: how a Kueue user lets each job say which GPU
    type it prefers (`KueueQueues.queue_for`)."""
    by_name = {pool.name: pool for pool in topology.pools}
    chosen = [by_name[name] for name in pools] if pools is not None else list(topology.pools)
    flavors = tuple(pool_flavor(pool, extra_quota=extra_quota) for pool in chosen)
    names = [f.name for f in flavors]
    orders = (
        tuple((first, *(n for n in names if n != first)) for first in names[1:])
        if preference_orders
        else ()
    )
    return KueueQueues(prefix, namespace, levels or topology_levels(topology), flavors,
                       orders=orders)  # fmt: skip


def assigned_domains(topology_assignment: Mapping[str, Any]) -> list[tuple[tuple[str, ...], int]]:
    """A v1beta2 `topologyAssignment` as [(values of its levels, pods in that domain)], read
    as the operator reads it (`topotrain.core.kueue_admission.topology_domains`)."""
    return [(tuple(values), pods) for values, pods in topology_domains(topology_assignment)]
