"""What the operator remembers of the cluster between watch events, and how it plans on it.

The kopf indexes keep a slim copy of every GPU pod and node (`slim_pod`,
`slim_node`); `Snapshot` turns them into the reconciler's views and the
planner's inventory. Pods the operator created but the watch has not shown
yet sit in the `Ledger`, so a plan made a moment later (for another job, or
the same one) sees their GPUs as taken: two plans never double-book a node.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from topotrain.manifests import (
    ATTEMPT_LABEL,
    GANG_GATE,
    INDEX_LABEL,
    JOB_LABEL,
    NODE_ANNOTATION,
)
from topotrain.policy import NodeView, PodView
from topotrain.topology import TERMINAL_PHASES, Inventory, TopologyLevels, pod_gpus

JobKey = tuple[str, str]  # (namespace, name)
LEDGER_TTL = 120.0  # seconds: a created pod the watch never showed is forgotten


def slim_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a pod the operator reads (kept in memory for every GPU pod)."""
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    terminated = []
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            terminated.append({"exitCode": term.get("exitCode"), "reason": term.get("reason", "")})
    return {
        "metadata": {
            "name": meta.get("name"), "namespace": meta.get("namespace"),
            "labels": dict(meta.get("labels") or {}),
            "annotations": {NODE_ANNOTATION: (meta.get("annotations") or {}).get(NODE_ANNOTATION, "")},
            "deletionTimestamp": meta.get("deletionTimestamp"),
        },
        "spec": {
            "nodeName": spec.get("nodeName"),
            "schedulingGates": [dict(g) for g in spec.get("schedulingGates") or []],
            "containers": [{"resources": dict(c.get("resources") or {})} for c in spec.get("containers") or []],
        },
        "status": {
            "phase": status.get("phase", "Pending"), "reason": status.get("reason", ""),
            "message": status.get("message", ""), "terminated": terminated,
        },
    }


def slim_node(body: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    ready = [dict(c) for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return {
        "metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
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
    return PodView(
        name=str(meta["name"]), index=index, attempt=attempt, phase=str(status.get("phase") or "Pending"),
        planned_node=str((meta.get("annotations") or {}).get(NODE_ANNOTATION, "")),
        node=str(spec.get("nodeName") or ""),
        gated=any(g.get("name") == GANG_GATE for g in spec.get("schedulingGates") or []),
        terminating=bool(meta.get("deletionTimestamp")),
        exit_code=int(first["exitCode"]) if first else None,
        reason=str(status.get("reason") or (first or {}).get("reason") or ""),
        message=str(status.get("message") or ""),
        gpus=pod_gpus(spec),
    )


def node_view(node: Mapping[str, Any]) -> NodeView:
    ready = any(c.get("status") == "True" for c in node["status"].get("conditions", []))
    return NodeView(str(node["metadata"]["name"]), ready=ready)


@dataclass
class Ledger:
    """Pods this process created that the watch has not reported yet."""

    entries: dict[tuple[str, str], tuple[JobKey, dict[str, Any], float]] = field(default_factory=dict)

    def record(self, job: JobKey, manifest: Mapping[str, Any]) -> None:
        meta = manifest["metadata"]
        slim = slim_pod(manifest)
        self.entries[(meta["namespace"], meta["name"])] = (job, slim, time.monotonic())

    def forget(self, namespace: str, name: str) -> None:
        self.entries.pop((namespace, name), None)

    def unseen(self, seen: Iterable[tuple[str, str]]) -> list[tuple[JobKey, dict[str, Any]]]:
        """Entries the index does not show yet (expired ones are dropped)."""
        shown, now = set(seen), time.monotonic()
        for key in [k for k, (_, _, t) in self.entries.items() if k in shown or now - t > LEDGER_TTL]:
            del self.entries[key]
        return [(job, slim) for job, slim, _ in self.entries.values()]


@dataclass
class Snapshot:
    """One consistent look at the cluster, taken under the planning lock."""

    nodes: list[dict[str, Any]]
    pods: list[dict[str, Any]]  # every GPU pod, including ledger entries not yet watched

    @classmethod
    def take(cls, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
             ledger: Ledger) -> Snapshot:
        pod_list = [dict(p) for p in pods]
        seen = [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pod_list]
        pod_list += [slim for _, slim in ledger.unseen(seen)]
        return cls(nodes=[dict(n) for n in nodes], pods=pod_list)

    def job_pods(self, job: JobKey) -> tuple[PodView, ...]:
        views = (pod_view(p) for p in self.pods if job_of(p) == job)
        return tuple(sorted((v for v in views if v is not None), key=lambda v: (v.attempt, v.index)))

    def node_views(self) -> dict[str, NodeView]:
        return {v.name: v for v in map(node_view, self.nodes)}

    def reserved(self, job: JobKey) -> dict[str, int]:
        """GPUs promised to other jobs' pods that are not bound yet (gated or just created)."""
        out: dict[str, int] = {}
        for pod in self.pods:
            meta, spec = pod["metadata"], pod["spec"]
            if spec.get("nodeName") or job_of(pod) in (None, job) or meta.get("deletionTimestamp"):
                continue
            if pod["status"].get("phase") in TERMINAL_PHASES:
                continue
            node = (meta.get("annotations") or {}).get(NODE_ANNOTATION)
            if node:
                out[node] = out.get(node, 0) + pod_gpus(spec)
        return out

    def inventory(self, job: JobKey, labels: TopologyLevels, tolerations: list[dict[str, Any]],
                  node_selector: Mapping[str, str]) -> Inventory:
        """Free GPUs as `job` sees them: its own pods hold nothing (a restart replaces them)."""
        others = [p for p in self.pods if job_of(p) != job]
        return Inventory.from_snapshot(
            self.nodes, others, labels, tolerations=tolerations,
            node_selector=node_selector, reserved=self.reserved(job),
        )
