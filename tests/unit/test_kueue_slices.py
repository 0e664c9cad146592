"""An elastic job's resizes in Kueue's accounting (core/kueue_slices.py, controller/queue_link.py):
the pure reading of a job's two Workloads, and the writes a pass makes, against the in-memory
stand-in for the API server of test_handlers_queue.py (a unit-test fake of `Kube`)."""

from __future__ import annotations

from typing import Any

import pytest
from test_handlers_queue import FakeKube, link
from topotrain.api.spec import TrainingJobSpec
from topotrain.controller.kube import ApiException
from topotrain.core import kueue_slices
from topotrain.core.kueue_slices import Resize, Slices

FIRST, SECOND = kueue_slices.slice_names("llm")
BODY = {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1",
                     "labels": {"kueue.x-k8s.io/queue-name": "lq"},
                     "annotations": {"kueue.x-k8s.io/elastic-job": "true"}}}  # fmt: skip


def spec(data: int) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "trainer:1", "parallelism": {"tensor": 1, "pipeline": 1, "data": data, "minData": 1},
        "worker": {"gpusPerPod": 1},
    })  # fmt: skip


def workload(name: str, count: int, *, reserved: bool = False, finished: bool = False,
             replaces: str | None = None) -> dict[str, Any]:
    conditions = [{"type": "QuotaReserved", "status": "True"}] if reserved else []
    if finished:
        conditions.append({"type": "Finished", "status": "True", "reason": "WorkloadSliceReplaced"})
    annotations = {"kueue.x-k8s.io/workload-slice-replacement-for": replaces} if replaces else {}
    return {"metadata": {"name": name, "namespace": "team", "annotations": annotations},
            "spec": {"podSets": [{"name": "workers", "count": count}]},
            "status": {"conditions": conditions}}  # fmt: skip


OLD = workload(FIRST, 2, reserved=True)


@pytest.mark.parametrize(("first", "second", "current", "pending", "stale"), [
    (OLD, None, FIRST, None, []),
    (OLD, workload(SECOND, 4, replaces=f"team/{FIRST}"), FIRST, SECOND, []),  # the slice queued
    (OLD, workload(SECOND, 4, reserved=True, replaces=f"team/{FIRST}"), SECOND, None, [FIRST]),
    (workload(FIRST, 2, reserved=True, finished=True), workload(SECOND, 4, reserved=True), SECOND, None, [FIRST]),
    (None, None, None, None, []),
])  # fmt: skip
def test_which_workload_the_job_runs_under(first: Any, second: Any, current: Any, pending: Any,
                                           stale: list[str]) -> None:
    found = kueue_slices.read(first, second)
    assert (found.current or {}).get("metadata", {}).get("name") == current
    assert (found.pending or {}).get("metadata", {}).get("name") == pending
    assert [w["metadata"]["name"] for w in found.stale] == stale


@pytest.mark.parametrize(("slices", "desired", "wanted"), [
    (Slices(OLD), 1, Resize(shrink=1)),
    (Slices(OLD), 2, Resize()),
    (Slices(OLD), 4, Resize(grow=4)),
    (Slices(OLD, workload(SECOND, 4)), 8, Resize(recount=8)),
    (Slices(OLD, workload(SECOND, 4)), 2, Resize(drop_pending=True)),
    (Slices(OLD, workload(SECOND, 4)), 1, Resize(shrink=1, drop_pending=True)),
    (Slices(workload(FIRST, 2)), 4, Resize(requeue=4)),  # queued: recounted, no slice
])  # fmt: skip
def test_the_writes_for_a_desired_size(slices: Slices, desired: int, wanted: Resize) -> None:
    assert kueue_slices.resize(slices, desired) == wanted


def _apply_counts(kube: FakeKube) -> None:
    """What the API server would do with the recorded spec patches (a merge patch of podSets)."""
    for name, patch, status in kube.patches:
        if not status and "podSets" in patch.get("spec", {}) and name in kube.workloads:
            kube.workloads[name]["spec"]["podSets"] = patch["spec"]["podSets"]
    kube.patches.clear()


def _admit(kube: FakeKube, name: str, count: int) -> None:
    kube.workloads[name]["status"] = {
        "conditions": [{"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"}],
        "admission": {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "workers", "flavors": {"nvidia.com/gpu": "h100"}, "count": count}]},
    }  # fmt: skip


def test_a_shrink_lowers_the_count_and_a_grow_waits_for_the_slice_kueue_admits() -> None:
    kube = FakeKube()
    job = link(kube)
    job.observe(BODY, spec(4))
    made = kube.workloads[FIRST]
    assert made["metadata"]["annotations"]["kueue.x-k8s.io/elastic-job"] == "true"
    assert "minCount" not in made["spec"]["podSets"][0]  # Kueue admits a sliced workload whole
    _admit(kube, FIRST, 4)

    view = job.observe(BODY, spec(2))  # kubectl scale: 4 -> 2 replicas
    assert view is not None and view.data == 2
    [(name, patch, _)] = kube.patches
    assert name == FIRST and patch["spec"]["podSets"][0]["count"] == 2
    _apply_counts(kube)

    view = job.observe(BODY, spec(4))  # back to 4: the admitted count no longer holds it
    assert view is not None and view.data == 2, "grew before Kueue admitted the slice"
    slice_ = kube.workloads[SECOND]
    assert slice_["metadata"]["annotations"]["kueue.x-k8s.io/workload-slice-replacement-for"] == f"team/{FIRST}"
    assert slice_["spec"]["podSets"][0]["count"] == 4
    assert f"slice Workload {SECOND}" in view.gate.message

    _admit(kube, SECOND, 4)  # Kueue admits the slice and finishes the old Workload
    kube.workloads[FIRST]["status"]["conditions"].append(
        {"type": "Finished", "status": "True", "reason": "WorkloadSliceReplaced"})
    view = job.observe(BODY, spec(4))
    assert view is not None and view.data == 4 and job.name == SECOND
    assert (FIRST, "wl-uid") in kube.deleted and list(kube.workloads) == [SECOND]

    job.finish(view, True, "done")  # the job's last Workload goes with it
    assert not kube.workloads


def test_a_kueue_without_the_gate_refuses_the_lower_count_and_the_job_runs_on() -> None:
    class Refusing(FakeKube):
        def patch_workload(self, namespace: str, name: str, patch: dict[str, Any], status: bool = False) -> None:
            if not status:
                raise ApiException(status=422, reason="field is immutable")
            super().patch_workload(namespace, name, patch, status)

    kube = Refusing()
    job = link(kube)
    job.observe(BODY, spec(4))
    _admit(kube, FIRST, 4)
    view = job.observe(BODY, spec(2))
    assert view is not None and view.gate.admitted and view.data == 2
    assert kube.workloads[FIRST]["spec"]["podSets"][0]["count"] == 4  # the whole admission kept


def test_a_job_without_the_annotation_keeps_one_workload_and_partial_admission() -> None:
    kube = FakeKube()
    body = {"metadata": {**BODY["metadata"], "annotations": {}}}
    job = link(kube)
    job.observe(body, spec(4))
    _admit(kube, FIRST, 4)
    job.observe(body, spec(8))
    assert list(kube.workloads) == [FIRST] and not kube.patches
    assert kube.workloads[FIRST]["spec"]["podSets"][0]["minCount"] == 1
