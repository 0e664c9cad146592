"""Running under Kueue, pure: an elastic job's resizes reflected in Kueue's accounting.

A TrainingJob annotated `kueue.x-k8s.io/elastic-job: "true"` (the annotation Kueue's own
integrations read) is an elastic workload in Kueue's sense (Kueue v0.17's workload slices,
feature gate `ElasticJobsViaWorkloadSlices`):

- **shrink**: when the job's data degree is lowered below what its admitted Workload counts,
  the Workload's podSet count is lowered in place; Kueue's webhook allows a lower count on an
  admitted Workload with the gate on, and Kueue's quota usage follows the count, so the GPUs
  the job gave up go to other workloads at once;
- **grow**: a count cannot be raised once admitted; a second Workload, a *slice* for the new
  count, annotated `kueue.x-k8s.io/workload-slice-replacement-for: <namespace>/<current>`, is
  created beside it. The job keeps running at its admitted size while Kueue queues the slice;
  Kueue admits the slice against the difference only and marks the old Workload Finished
  (reason `WorkloadSliceReplaced`), and the job grows on the slice's admission. The old
  Workload is then deleted. Lowered again before the slice is admitted, the slice's count
  follows (or the slice goes, when the job is back within its admission).

A job has at most two Workloads: `kueue.workload_name(job)` and its alternate
(`slice_names`); each slice takes the name the Workload it replaces does not hold, so
the operator finds them after a restart with two reads and no list.

Without the gate Kueue refuses the lower count (the job keeps its whole admission, as any
job does, and the refusal is logged), and a slice is admitted as a Workload of its own (the
whole new count, not the difference) and replaces the old one once admitted. Partial
admission (`minCount`) is not used for such a job: Kueue admits a sliced workload whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from topotrain.core.kueue import ELASTIC_ANNOTATION, REPLACES_ANNOTATION, workload_name
from topotrain.core.kueue_admission import QUOTA_RESERVED, condition_true
from topotrain.core.multikueue import FINISHED

_ALTERNATE = ".slice"  # not a valid name character: the alternate name always ends in a hash


def elastic(body: Mapping[str, Any]) -> bool:
    """Whether the job asks Kueue to account its resizes (Kueue's own annotation)."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(ELASTIC_ANNOTATION, "")).lower() == "true"


def slice_names(job_name: str) -> tuple[str, str]:
    """The two names a job's Workloads take in turn."""
    return workload_name(job_name), workload_name(job_name + _ALTERNATE)


def other(job_name: str, name: str) -> str:
    first, second = slice_names(job_name)
    return second if name == first else first


def pod_count(workload: Mapping[str, Any]) -> int:
    pod_sets = (workload.get("spec") or {}).get("podSets") or [{}]
    return int(pod_sets[0].get("count") or 0)


def finished(workload: Mapping[str, Any]) -> bool:
    return condition_true(workload, FINISHED)


def reserved(workload: Mapping[str, Any]) -> bool:
    """Kueue reserved quota for it (QuotaReserved True)."""
    return condition_true(workload, QUOTA_RESERVED)


def _key(workload: Mapping[str, Any]) -> str:
    meta = workload.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def replaces(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    annotations = (new.get("metadata") or {}).get("annotations") or {}
    return annotations.get(REPLACES_ANNOTATION) == _key(old)


@dataclass(frozen=True)
class Slices:
    """The job's Workloads as one pass reads them."""

    current: Mapping[str, Any] | None = None  # the one the job runs (or waits) under
    pending: Mapping[str, Any] | None = None  # a slice for a larger count Kueue has not admitted
    stale: list[Mapping[str, Any]] = field(default_factory=list)  # Finished ones, to delete


def read(first: Mapping[str, Any] | None, second: Mapping[str, Any] | None) -> Slices:
    """Which of the job's (up to two, both the job's own) Workloads is which. A Finished one is
    stale (Kueue replaced it); of two live ones, a slice replacing the other is current (and
    the other stale) once Kueue reserved its quota, pending before; two unrelated ones: the
    first is current."""
    live = [w for w in (first, second) if w is not None and not finished(w)]
    stale = [w for w in (first, second) if w is not None and finished(w)]
    if len(live) < 2:
        return Slices(live[0] if live else None, None, stale)
    a, b = live
    for new, old in ((a, b), (b, a)):
        if replaces(new, old):
            # Admitted, the slice replaces the old Workload, whose quota Kueue counts no more
            # (it marks it Finished; a Kueue without the gate would admit both, whole).
            return Slices(new, None, [*stale, old]) if reserved(new) else Slices(old, new, stale)
    return Slices(a, None, stale)


def with_count(workload: Mapping[str, Any], count: int) -> dict[str, Any]:
    """The merge patch that sets the podSet count (a list is replaced whole: every podSet as
    read, only the count changed; the read's resourceVersion makes it a compare-and-swap)."""
    pod_sets = [dict(p) for p in (workload.get("spec") or {}).get("podSets") or []]
    pod_sets[0]["count"] = count
    version = (workload.get("metadata") or {}).get("resourceVersion")
    return {"metadata": {"resourceVersion": version}, "spec": {"podSets": pod_sets}}


@dataclass(frozen=True)
class Resize:
    """What one pass does to the job's Workloads for its desired pod count."""

    shrink: int | None = None  # lower the current Workload's count to this
    requeue: int | None = None  # set the count of the current Workload, not admitted, to this
    grow: int | None = None  # create the slice for this count (none pending yet)
    recount: int | None = None  # set the pending slice's count to this
    drop_pending: bool = False  # the pending slice is no longer wanted


def resize(slices: Slices, desired: int) -> Resize:
    """The writes that bring Kueue's accounting to `desired` pods (a queued Workload is simply
    recounted: Kueue admits it at its count when it admits it)."""
    current, pending = slices.current, slices.pending
    if current is None:
        return Resize()
    count = pod_count(current)
    if not reserved(current):
        return Resize(requeue=desired if desired != count else None, drop_pending=pending is not None)
    if desired < count:
        return Resize(shrink=desired, drop_pending=pending is not None)
    if desired == count:
        return Resize(drop_pending=pending is not None)
    if pending is None:
        return Resize(grow=desired)
    return Resize(recount=desired) if pod_count(pending) != desired else Resize()
