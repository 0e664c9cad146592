"""Free GPUs kept from the watch events, so a planning pass never recounts the fleet.

`Fleet` is fed by the node and GPU-pod watch (the index handlers see every
listed, added and modified object; the DELETED events remove them). Each node
event parses the node once (`FleetNode`: pool, place in the domain tree,
allocatable GPUs, and what makes it unusable whatever the job); each pod event
replaces that pod's hold, the GPUs it takes on one node: on its `nodeName`
while it is bound and not finished, or on its planned node (the operator's node
annotation) while a job's pod is created but not bound yet, and not being
deleted. The node's taken count moves by the difference.

A planning pass (`inventory`) copies the counts under the fleet's mutex, gives
back the holds of the job's own pods (a restart replaces them) and of ghost
pods, adds the ledger's pods not watched yet, and builds the job's `Inventory`
from the parsed nodes: no pod is looked at, and no node is parsed. The result
equals `Inventory.from_snapshot` over the same nodes and pods, which stays the
reference (tests/unit/test_fleet.py replays random event sequences against it).

The counts are updated before kopf stores the event's object in its index
(index handlers run first), and a deletion after the index forgot the pod: a
snapshot taken between the two sees the GPUs as taken, never as free.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from topotrain.core.manifests import JOB_LABEL, NODE_ANNOTATION
from topotrain.core.ownership import controller_owner
from topotrain.placement.topology import (
    BLOCKING_EFFECTS,
    TERMINAL_PHASES,
    UNLABELLED,
    Inventory,
    NodeInfo,
    Path,
    TopologyLevels,
    parse_count,
    pod_gpus,
    tolerates,
)

JobKey = tuple[str, str]  # (namespace, name)
PodKey = tuple[str, str]  # (namespace, name), as kopf's index keys a pod


@dataclass(frozen=True)
class Hold:
    """GPUs one pod takes on one node, and whose pod it is."""

    node: str
    gpus: int
    job: JobKey | None  # the job label, if any
    owner: str | None  # the controller's uid, if any
    uid: str


def hold_of(pod: Mapping[str, Any]) -> Hold | None:
    """What a (slim) pod takes: as `gpus_in_use` counts bound pods and `Snapshot.reserved`
    counts a job's created, unbound ones. None: nothing."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
        return None
    labels = meta.get("labels") or {}
    job_name = labels.get(JOB_LABEL)
    job = (str(meta.get("namespace")), str(job_name)) if job_name else None
    node = spec.get("nodeName")
    if not node:
        if job is None or meta.get("deletionTimestamp"):
            return None
        node = (meta.get("annotations") or {}).get(NODE_ANNOTATION)
        if not node:
            return None
    try:
        gpus = pod_gpus(spec)
    except ValueError:  # the index admits only pods whose request parses
        return None
    if gpus <= 0:
        return None
    owner = controller_owner(meta)
    return Hold(str(node), gpus, job, owner.uid if owner is not None else None, str(meta.get("uid") or ""))


def _belongs(hold: Hold, job: JobKey, uid: str | None) -> bool:
    """`snapshot.belongs` for a hold: the job's label and, when `uid` is known, its controller."""
    return hold.job == job and (uid is None or (bool(uid) and hold.owner == uid))


@dataclass(frozen=True)
class FleetNode:
    """One node, parsed once per change: its NodeInfo (free = allocatable) and what excludes it
    for every job (`static_why`); taints and labels stay for the per-job checks."""

    name: str
    info: NodeInfo | None  # None: no GPUs (static_why says so) or an unreadable count (error)
    static_why: str = ""
    taints: tuple[tuple[Any, str, str], ...] = ()  # (key, value, effect) of the blocking ones
    labels: Mapping[str, str] = field(default_factory=dict)
    error: str = ""
    uid: str = ""  # the Node object's (a namesake re-created under the name has another)

    @classmethod
    def parse(cls, node: Mapping[str, Any], levels: TopologyLevels) -> FleetNode:
        meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
        name, uid = str(meta.get("name", "?")), str(meta.get("uid") or "")
        labels: Mapping[str, str] = meta.get("labels") or {}
        try:
            allocatable = parse_count((status.get("allocatable") or {}).get(levels.gpu_resource))
        except ValueError as exc:
            return cls(name, None, error=f"node {name}: status.allocatable.{levels.gpu_resource}: {exc}", uid=uid)
        if allocatable <= 0:
            return cls(name, None, static_why=f"no allocatable {levels.gpu_resource}", uid=uid)
        path: Path = (
            labels.get(levels.block, UNLABELLED),
            labels.get(levels.rack, UNLABELLED),
            labels.get(levels.nvlink) or f"host:{name}",
            labels.get(levels.host, name),
        )
        pool = labels.get(levels.product, UNLABELLED) or "unlabelled"
        ready = any(c.get("type") == "Ready" and str(c.get("status")) == "True"
                    for c in status.get("conditions") or [])  # fmt: skip
        why = "" if ready else "not Ready"
        if not why and spec.get("unschedulable"):
            why = "unschedulable (cordoned)"
        taints = tuple((t.get("key"), str(t.get("value") or ""), str(t.get("effect")))
                       for t in spec.get("taints") or [] if t.get("effect") in BLOCKING_EFFECTS)  # fmt: skip
        info = NodeInfo(name=name, pool=pool, allocatable=allocatable, free=allocatable, path=path)
        return cls(name, info, why, taints, dict(labels), uid=uid)

    def why_not(self, tolerations: list[Mapping[str, Any]], selector: Mapping[str, str]) -> str:
        """`topology._unusable` for this node and one job ("" when the job can use it)."""
        if self.static_why:
            return self.static_why
        for key, value, effect in self.taints:
            if not tolerates({"key": key, "value": value, "effect": effect}, tolerations):
                return f"taint {key}={value}:{effect} not tolerated"
        for key, wanted in selector.items():
            if self.labels.get(key) != wanted:
                return f"nodeSelector {key}={wanted} does not match"
        return ""


class Fleet:
    """Parsed nodes and per-node taken GPUs, kept from the watch events (thread-safe)."""

    def __init__(self, levels: TopologyLevels | None = None) -> None:
        self.levels = levels or TopologyLevels()
        self._nodes: dict[str, FleetNode] = {}
        self._order: list[FleetNode] | None = []  # by name; None: rebuilt at the next look
        self._holds: dict[PodKey, Hold] = {}
        self._by_job: dict[JobKey, set[PodKey]] = {}
        self._by_uid: dict[str, PodKey] = {}
        self._taken: dict[str, int] = {}
        self._mutex = threading.Lock()

    # --- the watch -----------------------------------------------------------------

    def node_seen(self, node: Mapping[str, Any]) -> None:
        parsed = FleetNode.parse(node, self.levels)
        with self._mutex:
            if self._nodes.get(parsed.name) != parsed:
                self._nodes[parsed.name] = parsed
                self._order = None

    def node_gone(self, name: str, uid: str = "") -> None:
        """The node is deleted (the watch said so) or, with `uid`, the node object `uid` is gone
        (a resync's LISTs lack it: a ghost); a namesake re-created since keeps its place."""
        with self._mutex:
            node = self._nodes.get(name)
            if node is not None and (not uid or node.uid == uid):
                del self._nodes[name]
                self._order = None

    def node_names(self) -> set[str]:
        with self._mutex:
            return set(self._nodes)

    def pod_seen(self, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        with self._mutex:
            self._drop(key)
            hold = hold_of(pod)
            if hold is not None:
                self._holds[key] = hold
                self._taken[hold.node] = self._taken.get(hold.node, 0) + hold.gpus
                if hold.job is not None:
                    self._by_job.setdefault(hold.job, set()).add(key)
                if hold.uid:
                    self._by_uid[hold.uid] = key

    def pod_gone(self, pod: Mapping[str, Any]) -> None:
        """The watch reported the pod deleted (a namesake seen since keeps its hold)."""
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        with self._mutex:
            hold = self._holds.get(key)
            if hold is not None and (not meta.get("uid") or hold.uid == meta.get("uid")):
                self._drop(key)

    def _drop(self, key: PodKey) -> None:
        hold = self._holds.pop(key, None)
        if hold is None:
            return
        left = self._taken[hold.node] - hold.gpus
        if left:
            self._taken[hold.node] = left
        else:
            del self._taken[hold.node]
        if hold.job is not None:
            keys = self._by_job[hold.job]
            keys.discard(key)
            if not keys:
                del self._by_job[hold.job]
        if self._by_uid.get(hold.uid) == key:
            del self._by_uid[hold.uid]

    # --- a planning pass ---------------------------------------------------------

    def taken(self, job: JobKey, uid: str | None, ghosts: Iterable[str] = ()) -> tuple[list[FleetNode], dict[str, int]]:
        """(nodes by name, node -> GPUs taken by pods not of `job` and not ghosts), one moment's."""
        with self._mutex:
            if self._order is None:
                self._order = [self._nodes[name] for name in sorted(self._nodes)]
            order, taken = self._order, dict(self._taken)
            given_back = {key for key in self._by_job.get(job, ()) if _belongs(self._holds[key], job, uid)}
            given_back.update(k for k in map(self._by_uid.get, ghosts) if k is not None)
            for key in given_back:
                hold = self._holds[key]
                taken[hold.node] -= hold.gpus
        return order, taken

    def inventory(self, job: JobKey, uid: str | None, tolerations: Iterable[Mapping[str, Any]],
                  node_selector: Mapping[str, str], avoid: frozenset[str] = frozenset(),
                  unseen: Iterable[Mapping[str, Any]] = (), ghosts: Iterable[str] = ()) -> Inventory:
        """`Snapshot.inventory` from the kept counts: free GPUs as `job` (controller `uid`) sees
        them, nodes in `avoid` left out; `unseen`: the ledger's pods the watch has not shown
        (they hold their GPUs unless they are the job's own); `ghosts`: uids of pods gone."""
        order, taken = self.taken(job, uid, ghosts)
        for pod in unseen:
            hold = hold_of(pod)
            if hold is not None and not _belongs(hold, job, uid):
                taken[hold.node] = taken.get(hold.node, 0) + hold.gpus
        tols, selector = list(tolerations), dict(node_selector)
        usable: dict[str, NodeInfo] = {}
        known: dict[str, NodeInfo] = {}
        excluded: dict[str, str] = {}
        for node in order:
            if node.name in avoid:
                continue
            if node.error:
                raise ValueError(node.error)
            info = node.info
            if info is None:
                excluded[node.name] = node.static_why
                continue
            why = node.why_not(tols, selector)
            used = taken.get(node.name, 0)
            if used and not why:
                info = NodeInfo(info.name, info.pool, info.allocatable, max(0, info.allocatable - used), info.path)
            if why:
                excluded[node.name] = why
                known[node.name] = NodeInfo(info.name, info.pool, info.allocatable, 0, info.path)
            else:
                known[node.name] = usable[node.name] = info
        return Inventory(nodes=usable, excluded=excluded, known=known)
