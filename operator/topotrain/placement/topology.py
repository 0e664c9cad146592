"""The GPU inventory a gang is placed into, built from a snapshot of Nodes and Pods.

Inputs are plain dicts as `kubectl get -o yaml`, the Kubernetes client's
`.to_dict()` or kopf bodies give them (camelCase or snake_case keys); nothing
here talks to an API server.

A node counts only if it is Ready, schedulable, its NoSchedule/NoExecute taints
are tolerated and it matches the job's nodeSelector. Free GPUs = allocatable
`nvidia.com/gpu` minus the GPUs requested by non-terminal pods bound to it,
minus GPUs reserved for pods the operator created but has not seen yet.

Domains nest: block > rack > NVLink domain > host. A domain's identity is its
path from the root, so two racks with the same label in different blocks stay
apart, and an NVLink clique label seen in two racks is treated as two domains
(a conservative reading for a tensor-parallel group).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
UNLABELLED = ""


@dataclass(frozen=True)
class TopologyLevels:
    """Node label keys of the topology levels (outermost first) and of the pool."""

    block: str = "topology.topotrain.io/block"
    rack: str = "topology.topotrain.io/rack"
    nvlink: str = "nvidia.com/gpu.clique"
    host: str = "kubernetes.io/hostname"
    product: str = "nvidia.com/gpu.product"
    gpu_resource: str = GPU_RESOURCE


Path = tuple[str, str, str, str]  # (block, rack, nvlink domain, host)


@dataclass(frozen=True)
class NodeInfo:
    """One usable node: its pool, its place in the domain tree and its free GPUs."""

    name: str
    pool: str
    allocatable: int
    free: int
    path: Path

    @property
    def block(self) -> tuple[str]:
        return (self.path[0],)

    @property
    def rack(self) -> tuple[str, str]:
        return (self.path[0], self.path[1])

    @property
    def nvlink(self) -> tuple[str, str, str]:
        return (self.path[0], self.path[1], self.path[2])


@dataclass(frozen=True)
class Inventory:
    """Usable nodes by name; `excluded` says why the others were left out."""

    nodes: Mapping[str, NodeInfo]
    excluded: Mapping[str, str] = field(default_factory=dict)
    known: Mapping[str, NodeInfo] = field(default_factory=dict)  # every GPU node; excluded ones free=0

    @classmethod
    def from_snapshot(
        cls,
        nodes: Iterable[Mapping[str, Any]],
        pods: Iterable[Mapping[str, Any]] = (),
        levels: TopologyLevels | None = None,
        *,
        tolerations: Iterable[Mapping[str, Any]] = (),
        node_selector: Mapping[str, str] | None = None,
        ignore_pods_of: Mapping[str, str] | None = None,
        reserved: Mapping[str, int] | None = None,
    ) -> Inventory:
        """Build the inventory a job with these tolerations and nodeSelector sees.

        `ignore_pods_of`: pods carrying all these labels hold nothing (a job's own
        pods, when re-planning it). `reserved`: node -> GPUs already promised to
        pods the watch has not reported yet, so two plans never double-book.
        """
        levels = levels or TopologyLevels()
        tols = [_norm(t) for t in tolerations]
        used = gpus_in_use(pods, levels.gpu_resource, ignore_pods_of)
        for node_name, count in (reserved or {}).items():
            used[node_name] = used.get(node_name, 0) + count
        usable: dict[str, NodeInfo] = {}
        excluded: dict[str, str] = {}
        known: dict[str, NodeInfo] = {}
        # Nodes are read as they come: none of the fields read here is spelt differently in the
        # client's snake_case dicts (copying 10,000 node dicts was most of this function's time).
        for node in nodes:
            try:
                info, why = _node_info(node, levels, tols, node_selector or {}, used)
            except ValueError as exc:
                raise ValueError(f"node {_name(node)}: {exc}") from None
            if why:
                excluded[_name(node)] = why
            if info is not None:
                known[info.name] = info if not why else replace(info, free=0)
                if not why:
                    usable[info.name] = info
        return cls(nodes=dict(sorted(usable.items())), excluded=excluded, known=dict(sorted(known.items())))

    def pools(self) -> dict[str, list[NodeInfo]]:
        """Usable nodes grouped by GPU product, each list sorted by domain path."""
        grouped: dict[str, list[NodeInfo]] = {}
        for info in self.nodes.values():
            grouped.setdefault(info.pool, []).append(info)
        return {pool: sorted(infos, key=lambda n: n.path) for pool, infos in sorted(grouped.items())}

    def pool_of(self, node_name: str) -> str | None:
        info = self.known.get(node_name) or self.nodes.get(node_name)
        return None if info is None else info.pool

    def known_in_pool(self, pool: str) -> list[NodeInfo]:
        """Every GPU node of a pool, usable or not (unusable ones with free=0), by domain path."""
        every = {**self.known, **self.nodes}
        return sorted((n for n in every.values() if n.pool == pool), key=lambda n: n.path)

    def reserve(self, usage: Mapping[str, int]) -> Inventory:
        """A copy with `usage` (node -> GPUs) taken out of the free counts."""
        updated = dict(self.nodes)
        for node_name, count in usage.items():
            if node_name in updated:
                info = updated[node_name]
                updated[node_name] = replace(info, free=max(0, info.free - count))
        return Inventory(nodes=updated, excluded=self.excluded, known={**self.known, **updated})

    def without(self, node_names: Iterable[str], why: str = "lost") -> Inventory:
        """A copy without these nodes (failed or unhealthy)."""
        gone = set(node_names)
        kept = {name: info for name, info in self.nodes.items() if name not in gone}
        excluded = dict(self.excluded)
        excluded.update({name: why for name in gone if name in self.nodes})
        known = dict(self.known)
        known.update({name: replace(info, free=0) for name, info in self.nodes.items() if name in gone})
        return Inventory(nodes=kept, excluded=excluded, known=known)


def gpus_in_use(
    pods: Iterable[Mapping[str, Any]], resource: str = GPU_RESOURCE, ignore_labels: Mapping[str, str] | None = None
) -> dict[str, int]:
    """node -> GPUs requested by non-terminal pods bound to it."""
    used: dict[str, int] = {}
    for pod in pods:
        spec = pod.get("spec") or {}
        node_name = spec.get("nodeName") or spec.get("node_name")  # camelCase or the client's to_dict()
        phase = (pod.get("status") or {}).get("phase")
        if not node_name or phase in TERMINAL_PHASES:
            continue
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if ignore_labels and all(labels.get(k) == v for k, v in ignore_labels.items()):
            continue
        try:
            gpus = pod_gpus(spec, resource)
        except ValueError as exc:
            meta = pod.get("metadata") or {}
            raise ValueError(f"pod {meta.get('namespace', '')}/{meta.get('name', '?')}: {exc}") from None
        used[node_name] = used.get(node_name, 0) + gpus
    return used


def pod_gpus(spec: Mapping[str, Any], resource: str = GPU_RESOURCE) -> int:
    """GPUs a pod holds: max(sum over containers, max over init containers), as the scheduler counts."""

    def one(container: Mapping[str, Any]) -> int:
        res = container.get("resources") or {}
        requests = res.get("requests") or {}
        limits = res.get("limits") or {}
        field = "requests" if resource in requests else "limits"
        try:
            return parse_count(requests.get(resource, limits.get(resource, 0)))
        except ValueError as exc:
            raise ValueError(f"container {container.get('name', '?')}: resources.{field}.{resource}: {exc}") from None

    main = sum(one(c) for c in spec.get("containers") or [])
    init = max((one(c) for c in spec.get("initContainers") or spec.get("init_containers") or []), default=0)
    return max(main, init)


def parse_count(raw: Any) -> int:
    """An extended-resource quantity (whole numbers only: '8', 8, '8.0')."""
    if raw is None or raw == "":
        return 0
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"not a GPU count: {raw!r}") from None
    return int(value)


def tolerates(taint: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]) -> bool:
    """The core/v1 toleration matching rule."""
    for tol in tolerations:
        effect = tol.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        key = tol.get("key")
        if tol.get("operator") == "Exists":
            if not key or key == taint.get("key"):
                return True
        elif key == taint.get("key") and (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _node_info(
    node: Mapping[str, Any],
    levels: TopologyLevels,
    tolerations: list[dict[str, Any]],
    selector: Mapping[str, str],
    used: Mapping[str, int],
) -> tuple[NodeInfo | None, str]:
    name = _name(node)
    meta = node.get("metadata") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    try:
        allocatable = parse_count((status.get("allocatable") or {}).get(levels.gpu_resource))
    except ValueError as exc:
        raise ValueError(f"status.allocatable.{levels.gpu_resource}: {exc}") from None
    if allocatable <= 0:
        return None, f"no allocatable {levels.gpu_resource}"
    path: Path = (
        labels.get(levels.block, UNLABELLED),
        labels.get(levels.rack, UNLABELLED),
        labels.get(levels.nvlink) or f"host:{name}",
        labels.get(levels.host, name),
    )
    free = max(0, allocatable - used.get(name, 0))
    pool = labels.get(levels.product, UNLABELLED) or "unlabelled"
    info = NodeInfo(name=name, pool=pool, allocatable=allocatable, free=free, path=path)
    return info, _unusable(labels, spec, status, tolerations, selector)


def _unusable(
    labels: Mapping[str, str],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    tolerations: list[dict[str, Any]],
    selector: Mapping[str, str],
) -> str:
    """Why a job cannot use this node ("" when it can)."""
    if not _ready(status):
        return "not Ready"
    if spec.get("unschedulable"):
        return "unschedulable (cordoned)"
    for taint in spec.get("taints") or []:
        if taint.get("effect") in BLOCKING_EFFECTS and not tolerates(taint, tolerations):
            return f"taint {taint.get('key')}={taint.get('value') or ''}:{taint.get('effect')} not tolerated"
    for key, value in selector.items():
        if labels.get(key) != value:
            return f"nodeSelector {key}={value} does not match"
    return ""


def _ready(status: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and str(c.get("status")) == "True" for c in status.get("conditions") or []
    )


def _name(node: Mapping[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name", "?"))


_SNAKE_KEYS = {
    "node_name": "nodeName", "init_containers": "initContainers", "node_selector": "nodeSelector",
}


def _norm(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Accept the Kubernetes client's snake_case `.to_dict()` as well as camelCase."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if key in ("labels", "annotations", "allocatable", "capacity", "requests", "limits"):
            out[key] = value
            continue
        if isinstance(value, Mapping):
            value = _norm(value)
        elif isinstance(value, list):
            value = [_norm(v) if isinstance(v, Mapping) else v for v in value]
        out[_SNAKE_KEYS.get(key, key)] = value
    return out
