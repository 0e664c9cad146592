"""Who manages a TrainingJob (`spec.managedBy`), and the job as Kueue's MultiKueue dispatches it. Pure.

`spec.managedBy` has the meaning Kubernetes gives it on a batch Job and JobSet: unset or
`topotrain.io/trainingjob-controller`, topotrain runs the job; any other value names another
controller, and topotrain creates no pod and writes no status for it. The one other value it
knows is MultiKueue's (`kueue.x-k8s.io/multikueue`): on a manager cluster Kueue's generic
adapter for external frameworks (Kueue v0.17, `multiKueue.externalFrameworks`) dispatches the
job to a worker cluster, and what Kueue expects of topotrain there is the job's Workload, so
topotrain creates that (queue_link.py `QueueLink.dispatched`) and nothing else; Kueue copies the
worker's status onto the job.

On the worker, the adapter's copy has no `managedBy` (topotrain runs it), and carries two labels:
`kueue.x-k8s.io/prebuilt-workload-name`, the Workload MultiKueue cloned from the manager's (same
name, no owner) which the job adopts instead of creating its own, and
`kueue.x-k8s.io/multikueue-origin`, the manager's name. The run identity survives a re-dispatch
to another worker (a new object, a new UID) through the Workload: topotrain writes the
manager job's UID into its annotation `topotrain.io/run-uid`, and MultiKueue's clone keeps
annotations; so the checkpoint prefix's owner is the run, not one worker's copy of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

TOPOTRAIN_MANAGER = "topotrain.io/trainingjob-controller"
MULTIKUEUE_MANAGER = "kueue.x-k8s.io/multikueue"
PREBUILT_LABEL = "kueue.x-k8s.io/prebuilt-workload-name"
ORIGIN_LABEL = "kueue.x-k8s.io/multikueue-origin"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # Kueue labels an adopted prebuilt Workload with it
RUN_ANNOTATION = "topotrain.io/run-uid"

# The Workload eviction reason when an admission check is retried: MultiKueue's, after the worker
# holding the job was lost (workerLostTimeout) or evicted it (Kueue's WorkloadEvictedByAdmissionCheck).
EVICTED_BY_CHECK = "AdmissionCheck"
RUNNING_PHASES = ("Starting", "Running", "Recovering")

# Workload condition Kueue's MultiKueue waits for on a worker (a deleted worker Workload is a
# lost one to the manager, which then dispatches the job again).
FINISHED = "Finished"


class Manager(Enum):
    """Which controller acts on a TrainingJob."""

    TOPOTRAIN = "topotrain"    # topotrain runs it: pods, status, Workload
    MULTIKUEUE = "multikueue"  # Kueue's MultiKueue dispatches it: topotrain only creates its Workload
    OTHER = "other"            # another controller: topotrain leaves it alone


def manager_of(body: Mapping[str, Any]) -> Manager:
    """The manager `spec.managedBy` names (read off the wire object, before the spec is parsed,
    so that a job managed elsewhere never gets a status write, not even a rejection)."""
    value = (body.get("spec") or {}).get("managedBy")
    if value in (None, "", TOPOTRAIN_MANAGER):
        return Manager.TOPOTRAIN
    return Manager.MULTIKUEUE if value == MULTIKUEUE_MANAGER else Manager.OTHER


def prebuilt_workload(body: Mapping[str, Any]) -> str | None:
    """The Workload MultiKueue built for this copy of a dispatched job (its label), or None."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    name = labels.get(PREBUILT_LABEL)
    return str(name) if name else None


def origin(body: Mapping[str, Any]) -> str | None:
    """The manager cluster (MultiKueue's origin label) a worker's copy was dispatched from."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    value = labels.get(ORIGIN_LABEL)
    return str(value) if value else None


def run_uid(own_uid: str, workload: Mapping[str, Any] | None, prebuilt: bool) -> str:
    """The identity of the run this job object is part of: the manager job's UID carried by a
    prebuilt Workload's annotation, else the object's own UID (every job not dispatched by
    MultiKueue, and a prebuilt Workload that carries none: made by another manager)."""
    if prebuilt and workload is not None:
        carried = ((workload.get("metadata") or {}).get("annotations") or {}).get(RUN_ANNOTATION)
        if carried:
            return str(carried)
    return own_uid


def adoption_patch(workload: Mapping[str, Any], owner: Mapping[str, Any], job_uid: str
                   ) -> dict[str, Any] | None:
    """The metadata merge patch that makes the job (`owner`: its controller owner reference) the
    controller of a prebuilt Workload, as Kueue's own job integrations adopt one (the owner
    reference and the `kueue.x-k8s.io/job-uid` label); None when it is already the job's. The
    patch carries the Workload's resourceVersion, so a Workload changed meanwhile is not taken."""
    meta = workload.get("metadata") or {}
    refs = list(meta.get("ownerReferences") or [])
    if any(r.get("uid") == job_uid and r.get("controller") for r in refs):
        return None
    patch: dict[str, Any] = {"ownerReferences": [*refs, dict(owner)],
                             "labels": {JOB_UID_LABEL: job_uid}}
    if meta.get("resourceVersion"):
        patch["resourceVersion"] = meta["resourceVersion"]
    return {"metadata": patch}


def finished_status(workload: Mapping[str, Any], succeeded: bool, message: str, now: str
                    ) -> dict[str, Any] | None:
    """The status merge patch marking a worker's Workload Finished, as Kueue's own job
    integrations finish one (MultiKueue on the manager then finishes its own and copies the job's
    final status); None when it is already finished. A dispatched job's Workload is finished,
    never deleted: the manager would take a deleted one for a lost worker and dispatch again."""
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    if any(c.get("type") == FINISHED and c.get("status") == "True" for c in conditions):
        return None
    finished: dict[str, Any] = {
        "type": FINISHED, "status": "True", "reason": "Succeeded" if succeeded else "Failed",
        "message": message[:32768] or ("the job succeeded" if succeeded else "the job failed"),
        "lastTransitionTime": now,
    }
    generation = (workload.get("metadata") or {}).get("generation")
    if generation is not None:
        finished["observedGeneration"] = generation
    kept = [c for c in conditions if c.get("type") != FINISHED]
    return {"status": {"conditions": [*kept, finished]}}


def release_dispatched(workload: Mapping[str, Any], phase: str | None) -> bool:
    """Whether the manager's Workload of a job MultiKueue dispatched is evicted and its quota must be
    given back now (as Kueue's job framework gives back its own jobs' once they no longer run):
    at once after an admission check's retry (the worker holding the job was lost, or evicted
    it: nothing of the job runs where MultiKueue can reach it), otherwise once the status copied
    from the worker (`phase`) no longer says it runs (the worker stopped it, say after a
    preemption on the manager)."""
    status = workload.get("status") or {}
    evicted = next((c for c in status.get("conditions") or []
                    if c.get("type") == "Evicted" and c.get("status") == "True"), None)
    if evicted is None or not status.get("admission"):
        return False
    return evicted.get("reason") == EVICTED_BY_CHECK or phase not in RUNNING_PHASES
