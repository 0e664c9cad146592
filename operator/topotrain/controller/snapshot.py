"""What the operator remembers of the cluster between watch events, and how it plans on it.

The kopf indexes keep a slim copy of every GPU pod and node (indexes.py
`slim_pod`, `slim_node`); `Snapshot` turns them into the reconciler's views and the
planner's inventory. Pods the operator created but the watch has not shown
yet sit in the `Ledger`, so a plan made a moment later (for another job, or
the same one) sees their GPUs as taken: two plans never double-book a node.
A job's pods are those with its label and its UID as controller (`belongs`):
a deleted namesake's terminating pods are someone else's, holding their GPUs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from topotrain.api.status import Reason
from topotrain.contract import CHECKPOINT_REQUEST
from topotrain.controller.fleet import Fleet
from topotrain.controller.indexes import JobKey, job_of, slim_pod
from topotrain.core.manifests import (
    ATTEMPT_LABEL,
    GANG_GATE,
    INDEX_LABEL,
    NODE_ANNOTATION,
    RESUME_ANNOTATION,
    TEMPLATE_ANNOTATION,
)
from topotrain.core.ownership import controller_owner, foreign_message, owned_by
from topotrain.core.policy import NodeView, PodView
from topotrain.placement.topology import TERMINAL_PHASES, Inventory, TopologyLevels, pod_gpus

LEDGER_TTL = 120.0  # seconds: a created pod the watch never showed is forgotten


def belongs(pod: Mapping[str, Any], job: JobKey, uid: str | None) -> bool:
    """True for `job`'s own pods: its label and, when `uid` is known, its UID as controller.

    A pod with the label but another controller (a deleted namesake's pod that is still
    terminating, a user's pod) is never the job's: not watched, counted or deleted as its own.
    """
    return job_of(pod) == job and (uid is None or owned_by(pod.get("metadata", {}), uid))


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """The reconciler's view of one of a job's pods; None if it lacks our labels."""
    meta, spec, status = pod["metadata"], pod["spec"], pod["status"]
    labels = meta.get("labels") or {}
    try:
        attempt, index = int(labels[ATTEMPT_LABEL]), int(labels[INDEX_LABEL])
    except (KeyError, ValueError):
        return None
    codes = [t for t in status.get("terminated", []) if t.get("exitCode")]
    first = codes[0] if codes else None
    annotations = meta.get("annotations") or {}
    waiting = list(status.get("waiting") or [])
    conditions = list(status.get("conditions") or [])
    unschedulable = [c for c in conditions if c.get("type") == "PodScheduled"]
    if unschedulable and not waiting:
        waiting = [{"reason": "Unschedulable", "message": unschedulable[0].get("message") or ""}]
    disruption = [c for c in conditions if c.get("type") == "DisruptionTarget"
                  and c.get("status", "True") == "True"]
    preempted = any("Preempt" in str(c.get("reason") or "") for c in disruption)
    message = str(status.get("message") or "") or str((first or {}).get("message") or "")
    if preempted and not message:
        message = str(disruption[0].get("message") or "")
    return PodView(
        name=str(meta["name"]), index=index, attempt=attempt, phase=str(status.get("phase") or "Pending"),
        planned_node=str(annotations.get(NODE_ANNOTATION, "")),
        node=str(spec.get("nodeName") or ""),
        gated=any(g.get("name") == GANG_GATE for g in spec.get("schedulingGates") or []),
        terminating=bool(meta.get("deletionTimestamp")),
        deletion_deadline=str(meta.get("deletionTimestamp") or ""),
        grace_seconds=float(spec.get("terminationGracePeriodSeconds") or DEFAULT_GRACE_SECONDS),
        exit_code=int(first["exitCode"]) if first else None,
        reason=str(status.get("reason") or (first or {}).get("reason") or ""),
        message=message,
        gpus=pod_gpus(spec),
        waiting=str(waiting[0]["reason"]) if waiting else "",
        waiting_message=str(waiting[0].get("message") or "") if waiting else "",
        preempted=preempted,
        resume_step=annotations.get(RESUME_ANNOTATION),
        template=str(annotations.get(TEMPLATE_ANNOTATION, "")),
        checkpoint_request=str(annotations.get(CHECKPOINT_REQUEST, "")),
        exits=tuple((str(t.get("name") or ""), int(t["exitCode"])) for t in codes),
        conditions=frozenset((str(c.get("type")), str(c.get("status") or "True")) for c in conditions
                             if c.get("type") != "PodScheduled"),
    )


def node_view(node: Mapping[str, Any]) -> NodeView:
    ready = any(c.get("status") == "True" for c in node["status"].get("conditions", []))
    cordoned = bool((node.get("spec") or {}).get("unschedulable"))
    return NodeView(str(node["metadata"]["name"]), ready=ready, cordoned=cordoned)


class NodeViews(Mapping[str, NodeView]):
    """Node name -> NodeView of every node, each parsed when first looked up: a pass looks at
    the nodes of one job's pods, not at the whole fleet. `nodes`: every slim node, or a mapping
    name -> slim node that finds them (the operator's index: nothing is copied per pass)."""

    def __init__(self, nodes: Iterable[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]]) -> None:
        self._raw: Mapping[str, Mapping[str, Any]] = (
            nodes if isinstance(nodes, Mapping) else {str(n["metadata"]["name"]): n for n in nodes})
        self._views: dict[str, NodeView] = {}

    def __getitem__(self, name: str) -> NodeView:
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = node_view(self._raw[name])
        return view

    def __contains__(self, name: object) -> bool:
        return name in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


DEFAULT_GRACE_SECONDS = 30.0  # Kubernetes' default terminationGracePeriodSeconds


@dataclass
class Ledger:
    """Pods this process created (or is about to create) that the watch has not reported yet.

    Shared by every job's worker threads (a decision reserves under the plan lock, the pod
    changes record and forget outside it), so each call holds the ledger's own mutex.
    """

    entries: dict[tuple[str, str], tuple[JobKey, dict[str, Any], float]] = field(default_factory=dict)
    _mutex: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, job: JobKey, manifest: Mapping[str, Any]) -> None:
        meta = manifest["metadata"]
        slim = slim_pod(manifest)
        with self._mutex:
            self.entries[(meta["namespace"], meta["name"])] = (job, slim, time.monotonic())

    def forget(self, namespace: str, name: str) -> None:
        with self._mutex:
            self.entries.pop((namespace, name), None)

    def forget_owned(self, namespace: str, uid: str, keep: Collection[str] = ()) -> None:
        """The job with `uid` is gone: its pods the watch never showed hold no GPUs and no names
        (a pod created and deleted between two passes is never seen by `unseen`, and would
        otherwise stand in a namesake's way, and hold its GPUs, for LEDGER_TTL). `keep`: names
        of pods just created, which do hold their GPUs until the watch shows them."""
        if not uid:
            return
        with self._mutex:
            for key in [k for k, (_, slim, _) in self.entries.items()
                        if k[0] == namespace and _owner_uid(slim) == uid and k[1] not in keep]:
                del self.entries[key]

    def deleted(self, pod: Mapping[str, Any]) -> None:
        """The watch reported `pod` deleted: the entry of that pod (same name, same owner) goes."""
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        with self._mutex:
            entry = self.entries.get(key)
            if entry is not None and _owner_uid(entry[1]) == _owner_uid(pod):
                del self.entries[key]

    def unseen(self, shown: Callable[[JobKey, tuple[str, str]], bool]) -> list[tuple[JobKey, dict[str, Any]]]:
        """Entries the index does not show yet (those it shows, and expired ones, are dropped).
        `shown(job, (namespace, name))`: whether the index holds that pod of `job`."""
        now = time.monotonic()
        with self._mutex:
            for key in [k for k, (job, _, t) in self.entries.items() if now - t > LEDGER_TTL or shown(job, k)]:
                del self.entries[key]
            return [(job, slim) for job, slim, _ in self.entries.values()]


def _owner_uid(pod: Mapping[str, Any]) -> str | None:
    owner = controller_owner(pod.get("metadata") or {})
    return owner.uid if owner is not None else None


SECOND_LOOK_SECONDS = 5.0  # Ghosts.resync: between the cached LIST and the consistent one


@dataclass
class Ghosts:
    """Pods (or, in the operator's second one, nodes) the watch cache still shows that the API
    server said are gone.

    kopf's index keeps every object it has not seen a DELETED event for. When a watch restarts
    with a fresh LIST (the API server restarted, "410 Gone"), a pod deleted meanwhile never gets
    that event and stays in the index for good: a gang waited for ever for such a pod (Terminating
    on a healthy node it needed) to go. A delete, patch or release that the API server answers
    with 404 proves the pod of that name is gone; the uids the snapshot showed under that name are
    then left out of every later snapshot. A ghost no call of ours touches (another job's, a
    deleted job's) is found by the periodic `resync`. Only uids still in the index are kept.
    Nodes have only the `resync` (process.py: a node deleted while the watch was away stayed
    Ready with every GPU free in the fleet, and gangs were pinned to it).
    """

    uids: set[str] = field(default_factory=set)
    _mutex: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def mark(self, pods: Iterable[Mapping[str, Any]], namespace: str, names: Iterable[str]) -> list[str]:
        """The uids of `pods` named `names` in `namespace` are gone; returns the new ones."""
        wanted = set(names)
        found = [str(m["uid"]) for m in (p["metadata"] for p in pods)
                 if m.get("uid") and m.get("namespace") == namespace and m.get("name") in wanted]  # fmt: skip
        with self._mutex:
            new = [u for u in found if u not in self.uids]
            self.uids.update(new)
        return new

    def resync(self, indexed: Iterable[Mapping[str, Any]], list_uids: Callable[[bool], Collection[str]],
               second_look: float | None = None) -> list[Mapping[str, Any]]:
        """Find the ghosts no call of ours met: pods the index shows that two LISTs do not.

        A cheap LIST from the API server's cache first; only if it lacks some of the index's pods,
        `second_look` seconds later a consistent LIST (a pod just created, not yet in a cache, is
        in that one; default SECOND_LOOK_SECONDS). `list_uids(cached)` lists. Returns the index entries found to be ghosts."""
        entries = {str(p["metadata"]["uid"]): p for p in indexed if p["metadata"].get("uid")}
        with self._mutex:
            self.uids &= set(entries)  # ghosts the index dropped since (passes look at one job)
        if not entries:
            return []
        suspects = set(entries) - self.uids - set(list_uids(True))
        if not suspects:
            return []
        time.sleep(SECOND_LOOK_SECONDS if second_look is None else second_look)
        gone = suspects - set(list_uids(False))
        with self._mutex:
            self.uids.update(gone)
        return [entries[u] for u in sorted(gone)]

    def current(self) -> frozenset[str]:
        with self._mutex:
            return frozenset(self.uids)

    def drop(self, pods: Iterable[Mapping[str, Any]], every: bool = True) -> list[Mapping[str, Any]]:
        """`pods` without the ghosts. `every`: `pods` is the whole index, and ghosts it no longer
        holds are forgotten (a job's own pods are not: `resync` forgets them instead)."""
        listed = list(pods)
        with self._mutex:
            if not self.uids:
                return listed
            if every:
                self.uids &= {p["metadata"].get("uid") for p in listed}
            return [p for p in listed if p["metadata"].get("uid") not in self.uids]


@dataclass
class Snapshot:
    """One consistent look at the cluster (the watch indexes at one moment, with the ledger).

    With a `fleet` (the operator's, fed by the same watch) a job's inventory comes from its kept
    counts; without one (tests, tools) it is rebuilt from every node and pod here. A job's pass
    in the operator takes a scoped snapshot (`for_job`): the job's pods and the nodes it looks up,
    so that a pass costs what the job has, not what the fleet has (5,000 nodes, 4,000 pods).
    """

    nodes: list[Mapping[str, Any]]  # every node; [] when scoped (`lookup` finds them)
    pods: list[Mapping[str, Any]]  # every GPU pod (scoped: the job's label's), with ledger entries not yet watched
    fleet: Fleet | None = None
    unseen: list[Mapping[str, Any]] = field(default_factory=list)  # the ledger's entries in `pods`
    ghosts: frozenset[str] = frozenset()  # uids left out of `pods` (Ghosts)
    lookup: Mapping[str, Mapping[str, Any]] | None = None  # scoped: node name -> slim node

    @classmethod
    def take(cls, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
             ledger: Ledger, fleet: Fleet | None = None, ghosts: frozenset[str] = frozenset()) -> Snapshot:
        # The index's slim dicts as they are (nothing here writes to them): a pass of a 5,000-node
        # fleet copies no node and no pod.
        pod_list = list(pods)
        seen = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pod_list}
        unseen: list[Mapping[str, Any]] = [slim for _, slim in ledger.unseen(lambda _, key: key in seen)]
        return cls(nodes=list(nodes), pods=pod_list + unseen, fleet=fleet, unseen=unseen, ghosts=ghosts)

    @classmethod
    def for_job(cls, nodes: Mapping[str, Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
                ledger: Ledger, fleet: Fleet, shown: Callable[[JobKey, tuple[str, str]], bool],
                ghosts: frozenset[str] = frozenset()) -> Snapshot:
        """A job's scoped look: `pods` every pod with the job's label (its own and namesakes'),
        `nodes` finds a node by name, `shown` says whether the index holds a ledger entry's pod.
        Every other job's unseen ledger entries are kept too: their GPUs are taken."""
        unseen: list[Mapping[str, Any]] = [slim for _, slim in ledger.unseen(shown)]
        return cls(nodes=[], pods=list(pods) + unseen, fleet=fleet, unseen=unseen, ghosts=ghosts,
                   lookup=nodes)

    def job_pods(self, job: JobKey, uid: str | None = None) -> tuple[PodView, ...]:
        views = (pod_view(p) for p in self.pods if belongs(p, job, uid))
        return tuple(sorted((v for v in views if v is not None), key=lambda v: (v.attempt, v.index)))

    def node_views(self) -> NodeViews:
        return NodeViews(self.lookup if self.lookup is not None else self.nodes)

    def reserved(self, job: JobKey, uid: str | None = None) -> dict[str, int]:
        """GPUs promised to other jobs' pods that are not bound yet (gated or just created)."""
        out: dict[str, int] = {}
        for pod in self.pods:
            meta, spec = pod["metadata"], pod["spec"]
            if spec.get("nodeName") or job_of(pod) is None or belongs(pod, job, uid):
                continue
            if meta.get("deletionTimestamp"):
                continue
            if pod["status"].get("phase") in TERMINAL_PHASES:
                continue
            node = (meta.get("annotations") or {}).get(NODE_ANNOTATION)
            if node:
                out[node] = out.get(node, 0) + pod_gpus(spec)
        return out

    def inventory(self, job: JobKey, labels: TopologyLevels, tolerations: list[dict[str, Any]],
                  node_selector: Mapping[str, str], avoid: frozenset[str] = frozenset(),
                  uid: str | None = None) -> Inventory:
        """Free GPUs as `job` sees them: its own pods hold nothing (a restart replaces them).

        Nodes in `avoid` (those that failed the job's pods too often) are left out. Pods with
        the job's label but another owner (`uid`) hold their GPUs like any other pod.
        """
        if self.fleet is not None and self.fleet.levels == labels:
            return self.fleet.inventory(job, uid, tolerations, node_selector, avoid, self.unseen, self.ghosts)
        if self.lookup is not None:
            raise ValueError("a scoped snapshot plans only on a fleet with the same topology labels")
        others = [p for p in self.pods if not belongs(p, job, uid)]
        nodes = [n for n in self.nodes if n["metadata"]["name"] not in avoid] if avoid else self.nodes
        return Inventory.from_snapshot(
            nodes, others, labels, tolerations=tolerations,
            node_selector=node_selector, reserved=self.reserved(job, uid),
        )

    def foreign_problem(self, job: JobKey, uid: str, attempt: int) -> tuple[str, str] | None:
        """A pod not of this job that holds a name the job's next pods would take.

        Pods are named `<job>-<attempt>-<index>`, and a pass creates attempt `attempt` or
        `attempt + 1`: a namesake's pod of those attempts (a deleted job's, still terminating)
        must be gone first. (reason, message) for reconcile's config_problem, else None.
        """
        if not uid:
            return None
        namesakes = [p for p in self.pods if job_of(p) == job and not owned_by(p["metadata"], uid)]
        for pod in sorted(namesakes, key=lambda p: str(p["metadata"]["name"])):
            meta = pod["metadata"]
            if (meta.get("labels") or {}).get(ATTEMPT_LABEL) in (str(attempt), str(attempt + 1)):
                message = foreign_message("Pod", job[0], str(meta["name"]), controller_owner(meta),
                                          job[1], terminating=bool(meta.get("deletionTimestamp")))
                return Reason.FOREIGN_OBJECT, message
        return None
