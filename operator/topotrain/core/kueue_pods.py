"""Running under Kueue, pure: what Kueue's own job integrations do with pods, done for the gang.

- `pods_ready_status`: the Workload's `PodsReady` condition, as Kueue v0.17's job framework sets
  it (`generatePodsReadyCondition`): False `WaitForStart` until the gang runs, True `Started`
  once it does, False `WaitForRecovery` when a running gang stops being whole and True
  `Recovered` when it is again. A cluster with `waitForPodsReady` on evicts a Workload whose
  condition is not True within its timeout (`PodsReadyTimeout`); a running gang is never evicted.
- `pod_set_updates` and `with_pod_set_updates`: the `podSetUpdates` admission checks (a
  ProvisioningRequest's, say) put on the Workload (labels, annotations, nodeSelector,
  tolerations) applied to the gang's pods, through the spec the pods are built from (so the
  planner also sees the node selector and tolerations).

The I/O is controller/queue_link.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from topotrain.api.pod import Toleration
from topotrain.api.spec import TrainingJobSpec
from topotrain.core.kueue import POD_SET

PODS_READY = "PodsReady"
ADMITTED = "Admitted"
# Kueue v0.17's reasons (apis/kueue/v1beta2/workload_types.go) and messages (jobframework).
WAIT_FOR_START = "WaitForStart"
WAIT_FOR_RECOVERY = "WaitForRecovery"
STARTED = "Started"
RECOVERED = "Recovered"
_NOT_READY = "Not all pods are ready or succeeded"
_RECOVERING = "At least one pod has failed, waiting for recovery"
_READY = "All pods reached readiness and the workload is running"


def pods_ready(workload: Mapping[str, Any], running: bool) -> tuple[bool, str, str] | None:
    """(status, reason, message) of the PodsReady condition the Workload should carry now;
    None while it is not admitted and carries none (nothing to say yet)."""
    conditions = {str(c.get("type")): c for c in (workload.get("status") or {}).get("conditions") or []}
    current = conditions.get(PODS_READY)
    if (conditions.get(ADMITTED) or {}).get("status") != "True":
        return None if current is None else (False, WAIT_FOR_START, _NOT_READY)
    if running:
        recovering = current is not None and current.get("reason") in (WAIT_FOR_RECOVERY, RECOVERED)
        return True, RECOVERED if recovering else STARTED, _READY
    if current is not None and (current.get("status") == "True" or current.get("reason") == WAIT_FOR_RECOVERY):
        return False, WAIT_FOR_RECOVERY, _RECOVERING
    return False, WAIT_FOR_START, _NOT_READY


def pods_ready_status(workload: Mapping[str, Any], running: bool, now: str) -> dict[str, Any] | None:
    """The status merge patch setting `PodsReady` (None: unchanged). `running`: the gang is whole
    and Running. It carries the Workload's resourceVersion: a Workload Kueue changed meanwhile is
    not overwritten (the next pass writes again)."""
    wanted = pods_ready(workload, running)
    if wanted is None:
        return None
    value, reason, message = wanted
    status = "True" if value else "False"
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    old = next((c for c in conditions if c.get("type") == PODS_READY), None)
    if old is not None and old.get("status") == status and old.get("reason") == reason:
        return None
    meta = workload.get("metadata") or {}
    new: dict[str, Any] = {
        "type": PODS_READY, "status": status, "reason": reason, "message": message,
        "lastTransitionTime": now if old is None or old.get("status") != status
        else old.get("lastTransitionTime", now),
    }
    if meta.get("generation") is not None:
        new["observedGeneration"] = meta["generation"]
    kept = [c for c in conditions if c.get("type") != PODS_READY]
    patch: dict[str, Any] = {"status": {"conditions": [*kept, new]}}
    if meta.get("resourceVersion"):
        patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
    return patch


@dataclass(frozen=True)
class PodSetUpdate:
    """What the admission checks ask of the `workers` pods, merged in check order."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.labels or self.annotations or self.node_selector or self.tolerations)


def pod_set_updates(workload: Mapping[str, Any]) -> PodSetUpdate:
    """The podSetUpdates of the Workload's admission checks for the `workers` podSet (an update
    naming another podSet is some other integration's; a Workload built elsewhere with one podSet
    takes that one's)."""
    checks = (workload.get("status") or {}).get("admissionChecks") or []
    names = [p.get("name") for p in (workload.get("spec") or {}).get("podSets") or []]
    ours = POD_SET if POD_SET in names or not names else names[0]
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    selector: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    for check in checks:
        for update in check.get("podSetUpdates") or []:
            if update.get("name") != ours:
                continue
            labels.update({str(k): str(v) for k, v in (update.get("labels") or {}).items()})
            annotations.update({str(k): str(v) for k, v in (update.get("annotations") or {}).items()})
            selector.update({str(k): str(v) for k, v in (update.get("nodeSelector") or {}).items()})
            tolerations += [t for t in update.get("tolerations") or [] if t not in tolerations]
    return PodSetUpdate(labels, annotations, selector, tuple(tolerations))


def with_pod_set_updates(spec: TrainingJobSpec, update: PodSetUpdate) -> TrainingJobSpec:
    """The spec the gang's pods are built from, with the admission checks' updates on top of the
    worker's own labels, annotations, node selector and tolerations."""
    if not update:
        return spec
    worker = spec.worker
    tolerations = list(worker.tolerations)
    wire = [t.to_wire() for t in tolerations]
    tolerations += [Toleration.model_validate(t) for t in update.tolerations if dict(t) not in wire]
    changed = worker.model_copy(update={
        "labels": {**(worker.labels or {}), **update.labels} or None,
        "annotations": {**(worker.annotations or {}), **update.annotations} or None,
        "node_selector": {**worker.node_selector, **update.node_selector},
        "tolerations": tolerations,
    })
    return spec.model_copy(update={"worker": changed})
