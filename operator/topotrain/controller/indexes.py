"""What kopf's watch indexes keep, and how a pass reads them.

The indexes (main.py) keep a slim copy of every GPU pod and node (`slim_pod`,
`slim_node`): only the fields the operator reads, so a fleet of thousands of
nodes stays small in memory. Besides "all", each node is filed under its name
and each pod with a job label under that job (`node_entries`, `pod_entries`), so
a pass looks up what it needs and never lists the fleet; `snapshot.py` turns
what it read into the reconciler's views and the planner's inventory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import kopf

from topotrain.contract import CHECKPOINT_REQUEST
from topotrain.core.manifests import (
    JOB_LABEL,
    NODE_ANNOTATION,
    RESUME_ANNOTATION,
    TEMPLATE_ANNOTATION,
)
from topotrain.placement.topology import pod_gpus

JobKey = tuple[str, str]  # (namespace, name)


MESSAGE_LIMIT = 1024  # bytes of a termination message kept in memory per container


def _container_states(status: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(terminated, waiting) container states, slimmed."""
    terminated, waiting = [], []
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        term, wait = state.get("terminated"), state.get("waiting")
        if term:
            terminated.append({
                "name": cs.get("name") or "",
                "exitCode": term.get("exitCode"), "reason": term.get("reason", ""),
                "message": str(term.get("message") or "")[-MESSAGE_LIMIT:],
            })
        if wait and wait.get("reason"):
            waiting.append({"reason": wait["reason"], "message": str(wait.get("message") or "")[:500]})
    return terminated, waiting


# Conditions every pod has: not kept (failure rules match the others, DisruptionTarget, ...).
ROUTINE_CONDITIONS = frozenset({"Initialized", "ContainersReady", "Ready", "PodReadyToStartContainers"})


def _pod_conditions(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conditions that say why a pod cannot run or was stopped (Unschedulable,
    DisruptionTarget) and any other but the routine ones, for spec.failurePolicy.rules."""
    out = []
    for cond in status.get("conditions") or []:
        kind = cond.get("type")
        unschedulable = kind == "PodScheduled" and cond.get("reason") == "Unschedulable"
        if unschedulable or (kind != "PodScheduled" and kind not in ROUTINE_CONDITIONS):
            out.append({k: cond.get(k) for k in ("type", "status", "reason", "message")})
    return out


def slim_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a pod the operator reads (kept in memory for every GPU pod)."""
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    terminated, waiting = _container_states(status)
    annotations = meta.get("annotations") or {}
    return {
        "metadata": {
            "name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
            "labels": dict(meta.get("labels") or {}),
            "annotations": {
                key: annotations[key]
                for key in (NODE_ANNOTATION, RESUME_ANNOTATION, TEMPLATE_ANNOTATION, CHECKPOINT_REQUEST)
                if key in annotations
            },
            "deletionTimestamp": meta.get("deletionTimestamp"),
            "ownerReferences": [
                {"uid": o.get("uid"), "kind": o.get("kind"), "name": o.get("name"),
                 "controller": o.get("controller")}
                for o in meta.get("ownerReferences") or []
            ],
        },
        "spec": {
            "nodeName": spec.get("nodeName"),
            "schedulingGates": [dict(g) for g in spec.get("schedulingGates") or []],
            "containers": [{"resources": dict(c.get("resources") or {})} for c in spec.get("containers") or []],
            "terminationGracePeriodSeconds": spec.get("terminationGracePeriodSeconds"),
        },
        "status": {
            "phase": status.get("phase", "Pending"), "reason": status.get("reason", ""),
            "message": status.get("message", ""), "terminated": terminated, "waiting": waiting,
            "conditions": _pod_conditions(status),
        },
    }


def slim_node(body: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    ready = [dict(c) for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return {
        "metadata": {"name": meta.get("name"), "uid": meta.get("uid"), "labels": dict(meta.get("labels") or {})},
        "spec": {"unschedulable": spec.get("unschedulable", False),
                 "taints": [dict(t) for t in spec.get("taints") or []]},
        "status": {"allocatable": dict(status.get("allocatable") or {}), "conditions": ready},
    }


def job_of(pod: Mapping[str, Any]) -> JobKey | None:
    meta = pod.get("metadata", {})
    job = (meta.get("labels") or {}).get(JOB_LABEL)
    return None if not job else (str(meta.get("namespace")), str(job))


def requests_gpus(body: Mapping[str, Any], resource: str = "nvidia.com/gpu") -> bool:
    try:
        return pod_gpus(body.get("spec", {}), resource) > 0
    except ValueError:
        return False


def index_values(index: kopf.Index[Any, Any], key: Any = "all") -> list[Mapping[str, Any]]:
    store = index.get(key)
    return list(store) if store is not None else []


# Besides "all", the indexes (main.py) file each node under its name and each pod with a job
# label under that job: a pass looks up what it needs, never lists the fleet.
def node_key(name: str) -> tuple[str, str]:
    return ("node", name)


def job_pods_key(job: JobKey) -> tuple[str, str, str]:
    return ("job", *job)


def node_entries(slim: Mapping[str, Any]) -> dict[Any, Mapping[str, Any]]:
    """What the nodes index files a slim node under."""
    return {"all": slim, node_key(str(slim["metadata"]["name"])): slim}


def pod_entries(slim: Mapping[str, Any]) -> dict[Any, Mapping[str, Any]]:
    """What the GPU pods index files a slim pod under."""
    job = job_of(slim)
    return {"all": slim} if job is None else {"all": slim, job_pods_key(job): slim}


class IndexedNodes(Mapping[str, Mapping[str, Any]]):
    """Node name -> slim node, read from the nodes index at each lookup; the nodes whose uid is
    in `ghosts` (deleted, though the index still shows them) are not there."""

    def __init__(self, index: kopf.Index[Any, Any], ghosts: frozenset[str] = frozenset()) -> None:
        self._index, self._ghosts = index, ghosts

    def __getitem__(self, name: str) -> Mapping[str, Any]:
        store = self._index.get(node_key(name))
        found: list[Mapping[str, Any]] = list(store) if store is not None else []  # one C call: the event loop may be changing it
        if not found or found[0]["metadata"].get("uid") in self._ghosts:
            raise KeyError(name)
        return found[0]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or node_key(name) not in self._index:
            return False
        try:
            return bool(self[name])  # (a ghost's name raises)
        except KeyError:
            return False

    def _live(self) -> list[Mapping[str, Any]]:
        return [n for n in index_values(self._index) if n["metadata"].get("uid") not in self._ghosts]

    def __iter__(self) -> Iterator[str]:
        return (str(n["metadata"]["name"]) for n in self._live())

    def __len__(self) -> int:
        if self._ghosts:
            return len(self._live())
        store = self._index.get("all")
        return len(store) if store is not None else 0
