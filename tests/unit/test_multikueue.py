"""spec.managedBy and Kueue's MultiKueue: a job managed elsewhere gets no pod and no status write
(MultiKueue's gets its Workload on the manager), a worker's copy adopts the Workload MultiKueue
prebuilt, and the run's identity carried by that Workload lets a copy dispatched again to another
worker resume the run's checkpoints under the default resumePolicy IfOwned.

The API server is faked at the unit-test boundary (`WorkloadKube`, `FakeKube`, `AdoptingKube`);
MultiKueue's side (what it copies, labels and expects) is as read in Kueue v0.17.1's sources
(docs/multicluster.md)."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime
from typing import Any

import pytest
from topotrain.api.status import Reason, TrainingJobStatus
from topotrain.checkpoints import PrefixOwner
from topotrain.controller.process import Operator
from topotrain.controller.settings import Settings
from topotrain.core import kueue, multikueue
from topotrain.core.multikueue import Manager, manager_of
from topotrain.core.ownership import claim_checkpoints
from topotrain.core.reconcile_status import StatusBuilder
from topotrain.placement.topology import TopologyLevels

from tests.unit.test_fenced_pass import FencedKube
from tests.unit.test_handlers_queue import BODY, SPEC, FakeKube, link
from tests.unit.test_ownership import SPEC as GANG
from tests.unit.test_ownership import node

NOW = datetime(2026, 1, 1, tzinfo=UTC)
MANAGER_UID = "manager-uid"


def body(managed_by: str | None = None, **labels: str) -> dict[str, Any]:
    spec: dict[str, Any] = GANG.model_dump(by_alias=True, exclude_none=True)
    if managed_by is not None:
        spec["managedBy"] = managed_by
    return {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1", "generation": 1,
                         "resourceVersion": "7", "labels": dict(labels)}, "spec": spec}


def test_managed_by_unset_or_topotrain_is_ours_multikueue_and_others_are_not() -> None:
    assert manager_of(body()) is Manager.TOPOTRAIN
    assert manager_of(body("topotrain.io/trainingjob-controller")) is Manager.TOPOTRAIN
    assert manager_of(body("kueue.x-k8s.io/multikueue")) is Manager.MULTIKUEUE
    assert manager_of(body("example.com/other")) is Manager.OTHER


class WorkloadKube(FencedKube, FakeKube):
    """FencedKube's status and pod calls and FakeKube's Workloads (unit-test fakes)."""

    def __init__(self) -> None:
        FencedKube.__init__(self)
        FakeKube.__init__(self)


@pytest.mark.parametrize("managed_by", ["example.com/other", "kueue.x-k8s.io/multikueue"])
def test_a_job_managed_elsewhere_gets_no_pod_and_no_status_write(
        managed_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from topotrain.controller import loop as loop_module
    from topotrain.controller.loop import JobLoop

    monkeypatch.setattr(loop_module.kopf, "event", lambda *a, **kw: None)
    kube = WorkloadKube()
    op = Operator(settings=Settings(), kube=kube)  # type: ignore[arg-type]
    job = body(managed_by, **{kueue.QUEUE_LABEL: "lq"})
    job["status"] = {"phase": "Running"}  # another controller's (MultiKueue's copy of the worker's)
    loop = JobLoop(op, ("team", "llm"), job)  # type: ignore[arg-type]
    indexes = ({"all": []}, {"all": [node("n0"), node("n1"), node("n2")]})  # kopf's, at the boundary
    assert asyncio.run(loop.pass_once(*indexes)) is None  # type: ignore[arg-type]
    assert kube.writes == [] and kube.pod_calls == []
    if managed_by == multikueue.MULTIKUEUE_MANAGER:  # the Workload MultiKueue dispatches
        made = kube.workloads["trainingjob-llm"]
        assert made["metadata"]["annotations"] == {multikueue.RUN_ANNOTATION: "uid-1"}
        assert made["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    else:
        assert kube.workloads == {}
    # The same job managed by topotrain: a status write and the gang's pods.
    loop = JobLoop(op, ("team", "llm"), body())  # type: ignore[arg-type]
    asyncio.run(loop.pass_once(*indexes))  # type: ignore[arg-type]
    assert kube.writes and any(c.startswith("create ") for c in kube.pod_calls)


def test_the_manager_creates_no_workload_for_a_finished_job_and_follows_suspend() -> None:
    kube = FakeKube()
    done = {**BODY, "spec": {**SPEC.to_wire(), "managedBy": multikueue.MULTIKUEUE_MANAGER},
            "status": {"phase": "Succeeded"}}
    link(kube).dispatched(done)
    assert kube.workloads == {}
    suspended = {**done, "spec": {**done["spec"], "suspend": True}, "status": {}}
    link(kube).dispatched(suspended)
    assert list(kube.workloads) == ["trainingjob-llm"]
    assert kube.patches == [("trainingjob-llm", {"spec": {"active": False}}, False)]


class AdoptingKube(FakeKube):
    """FakeKube whose metadata patches land (status patches are only recorded)."""

    def patch_workload(self, namespace: str, name: str, patch: dict[str, Any], status: bool = False) -> None:
        super().patch_workload(namespace, name, patch, status)
        if not status and "metadata" in patch:
            meta = self.workloads[name]["metadata"]
            meta["ownerReferences"] = patch["metadata"]["ownerReferences"]
            meta.setdefault("labels", {}).update(patch["metadata"]["labels"])


def prebuilt(kube: FakeKube, name: str = "trainingjob-llm") -> dict[str, Any]:
    """MultiKueue's clone of the manager's Workload: no owner, the manager's annotations."""
    manifest = kueue.workload_for("llm", "team", MANAGER_UID, SPEC, "lq", TopologyLevels())
    manifest["metadata"].pop("ownerReferences")
    manifest["metadata"]["name"] = name
    manifest["metadata"]["uid"], manifest["metadata"]["resourceVersion"] = "remote-wl", "5"
    manifest["metadata"]["labels"][multikueue.ORIGIN_LABEL] = "manager"
    kube.workloads[name] = manifest
    return manifest


WORKER_BODY = {"metadata": {**BODY["metadata"], "labels": {
    **BODY["metadata"]["labels"], multikueue.PREBUILT_LABEL: "trainingjob-llm",
    multikueue.ORIGIN_LABEL: "manager"}}}


def test_a_dispatched_copy_waits_for_then_adopts_its_prebuilt_workload_and_creates_none() -> None:
    kube = AdoptingKube()
    view = link(kube).observe(WORKER_BODY, SPEC)
    assert view is not None and not view.gate.admitted and "waiting for Workload trainingjob-llm" in view.gate.message
    assert kube.workloads == {}, "a dispatched copy never creates its own Workload"
    assert view.run_uid == "", "the run is not known yet: its checkpoints are not claimed"
    prebuilt(kube)
    view = link(kube).observe(WORKER_BODY, SPEC)
    assert view is not None and view.run_uid == MANAGER_UID
    meta = kube.workloads["trainingjob-llm"]["metadata"]
    assert [(r["kind"], r["uid"], r["controller"]) for r in meta["ownerReferences"]] == [("TrainingJob", "uid-1", True)]
    assert meta["labels"][multikueue.JOB_UID_LABEL] == "uid-1"
    (_, patch, _), = kube.patches
    assert patch["metadata"]["resourceVersion"] == "5", "a Workload changed meanwhile is not taken"
    link(kube).observe(WORKER_BODY, SPEC)
    assert len(kube.patches) == 1, "adopted once"


def test_a_job_of_this_cluster_alone_is_its_own_run() -> None:
    view = link(FakeKube()).observe(BODY, SPEC)
    assert view is not None and view.run_uid == "uid-1"


def test_a_prebuilt_workload_of_another_object_is_left_alone() -> None:
    kube = AdoptingKube()
    prebuilt(kube)["metadata"]["ownerReferences"] = [
        {"kind": "TrainingJob", "name": "llm", "uid": "someone", "controller": True}]
    view = link(kube).observe(WORKER_BODY, SPEC)
    assert view is not None and not view.gate.admitted and "belongs to TrainingJob llm" in view.gate.message
    assert kube.patches == []


def test_a_dispatched_copy_marks_its_workload_finished_instead_of_deleting_it() -> None:
    kube = AdoptingKube()
    prebuilt(kube)
    q = link(kube)
    q.observe(WORKER_BODY, SPEC)
    view = q.observe(WORKER_BODY, SPEC, finished=True)
    assert view is not None and view.workload is not None
    q.finish(view, True, "done at step 100")
    (_, patch, status), = kube.patches[1:]
    assert status and kube.deleted == []
    finished = [c for c in patch["status"]["conditions"] if c["type"] == "Finished"]
    assert finished == [{"type": "Finished", "status": "True", "reason": "Succeeded", "message": "done at step 100",
                         "lastTransitionTime": finished[0]["lastTransitionTime"]}]
    # A job's own Workload (no MultiKueue) is deleted as before.
    own = FakeKube()
    q = link(own)
    q.observe(BODY, SPEC)
    view = q.observe(BODY, SPEC, finished=True)
    assert view is not None
    q.finish(view, False, "failed")
    assert own.deleted == [("trainingjob-llm", "wl-uid")]


def test_finished_status_is_written_once() -> None:
    wl = {"metadata": {"generation": 2}, "status": {"conditions": [{"type": "Admitted", "status": "True"}]}}
    patch = multikueue.finished_status(wl, False, "", "t")
    assert patch is not None
    cond = patch["status"]["conditions"][-1]
    assert (cond["reason"], cond["message"], cond["observedGeneration"]) == ("Failed", "the job failed", 2)
    assert patch["status"]["conditions"][0] == {"type": "Admitted", "status": "True"}
    assert multikueue.finished_status({"status": patch["status"]}, True, "", "t") is None


def test_the_run_identity_comes_from_a_prebuilt_workload_only() -> None:
    carried = {"metadata": {"annotations": {multikueue.RUN_ANNOTATION: MANAGER_UID}}}
    assert multikueue.run_uid("own", carried, prebuilt=True) == MANAGER_UID
    assert multikueue.run_uid("own", carried, prebuilt=False) == "own"
    assert multikueue.run_uid("own", {"metadata": {}}, prebuilt=True) == "own"
    assert multikueue.origin(WORKER_BODY) == "manager" and multikueue.origin(BODY) is None


def test_a_copy_dispatched_again_resumes_its_runs_checkpoints_under_if_owned() -> None:
    # Worker 1's copy (uid w1) starts the run: the prefix is claimed for the run, not the copy.
    first = claim_checkpoints(uid=MANAGER_UID, started=False, policy="IfOwned", owner=None,
                              latest_step=None, prefix="s3://c/team/llm", now=NOW, own_uid="w1")
    assert first.problem is None and first.write == PrefixOwner(uid=MANAGER_UID, created=NOW)
    # Worker 2's copy (uid w2, a new object) finds the run's commits: it goes on from them.
    again = claim_checkpoints(uid=MANAGER_UID, started=False, policy="IfOwned", owner=first.write,
                              latest_step=300, prefix="s3://c/team/llm", now=NOW, own_uid="w2")
    assert again.problem is None and again.write is None
    assert again.took_over == PrefixOwner(uid=MANAGER_UID, created=NOW, resumed_uid=MANAGER_UID, resumed_step=300)
    # Once it started, nothing more is said; another run's checkpoints are still refused.
    started = claim_checkpoints(uid=MANAGER_UID, started=True, policy="IfOwned", owner=first.write,
                                latest_step=400, prefix="s3://c/team/llm", now=NOW, own_uid="w2")
    assert started.took_over is None and started.problem is None
    other = claim_checkpoints(uid="another-run", started=False, policy="IfOwned", owner=first.write,
                              latest_step=300, prefix="s3://c/team/llm", now=NOW, own_uid="w3")
    assert other.problem is not None and other.problem[0] == Reason.FOREIGN_CHECKPOINTS
    # A job of this cluster alone (its run is itself) resuming its own steps says nothing.
    own = claim_checkpoints(uid="w1", started=False, policy="IfOwned", owner=PrefixOwner(uid="w1", created=NOW),
                            latest_step=300, prefix="s3://c/team/llm", now=NOW, own_uid="w1")
    assert own.took_over is None


def test_status_says_the_job_went_on_from_its_run_started_elsewhere() -> None:
    sb = StatusBuilder(TrainingJobStatus(), 1, NOW)
    sb.took_over(PrefixOwner(uid=MANAGER_UID, created=NOW, resumed_uid=MANAGER_UID, resumed_step=300))
    resumed = sb.status.resumed_from
    assert resumed is not None and (resumed.uid, resumed.step, resumed.same_run) == (MANAGER_UID, 300, True)
    (kind, reason, message), = sb.events
    assert (kind, reason) == ("Normal", Reason.RESUMED_RUN) and "started on another cluster" in message
    wire = sb.status.to_wire()["resumedFrom"]
    assert wire["sameRun"] is True  # type: ignore[index]
    other = StatusBuilder(TrainingJobStatus(), 1, NOW)
    other.took_over(PrefixOwner(uid="me", created=NOW, resumed_uid="them", resumed_step=3))
    assert other.status.resumed_from is not None and other.status.resumed_from.same_run is None


def test_a_dispatched_copy_claims_the_prefix_for_its_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Observer claims with the run's identity the pass read off the Workload."""
    from topotrain.controller.observe import Observer

    calls: list[dict[str, Any]] = []

    def claim(**kw: Any) -> Any:
        calls.append(kw)
        return claim_checkpoints(**kw)

    monkeypatch.setattr("topotrain.controller.observe.claim_checkpoints", claim)

    class Store:
        uri = "s3://c/team/llm"

        def read_owner(self) -> PrefixOwner:
            return PrefixOwner(uid=MANAGER_UID, created=NOW)

        def write_owner(self, record: PrefixOwner) -> None:
            raise AssertionError("the run's own prefix is not claimed again")

    observer = Observer(None, Settings(), "w2")  # type: ignore[arg-type]
    observer.run_uid = MANAGER_UID
    assert observer._claim(Store(), "IfOwned", False, 300) is None  # type: ignore[arg-type]
    assert (calls[0]["uid"], calls[0]["own_uid"]) == (MANAGER_UID, "w2")
    assert observer.took_over is not None and observer.took_over.resumed_step == 300
    observer.run_uid = ""  # the prebuilt Workload not read yet: no claim, no refusal
    assert observer._claim(Store(), "IfOwned", False, 300) is None  # type: ignore[arg-type]
    assert len(calls) == 1


def test_the_workload_topotrain_creates_carries_the_run() -> None:
    made = kueue.workload_for("llm", "team", "uid-1", SPEC, "lq", TopologyLevels())
    assert made["metadata"]["annotations"] == {multikueue.RUN_ANNOTATION: "uid-1"}
    clone = copy.deepcopy(made)  # what MultiKueue's cloneForCreate keeps: labels and annotations
    clone["metadata"].pop("ownerReferences")
    assert multikueue.run_uid("worker-copy", clone, prebuilt=True) == "uid-1"


def _evicted(reason: str) -> dict[str, Any]:
    return {"metadata": {"generation": 1}, "status": {
        "admission": {"clusterQueue": "cq"},
        "conditions": [{"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"},
                       {"type": "Evicted", "status": "True", "reason": reason, "message": "m"}]}}


def test_an_evicted_dispatched_workload_gives_its_quota_back_as_kueues_job_framework_does() -> None:
    # The worker was lost (MultiKueue retried its check): at once, though its last status said Running.
    assert multikueue.release_dispatched(_evicted("AdmissionCheck"), "Running")
    # Preempted on the manager: once the worker's copy no longer runs (its status, copied here).
    assert not multikueue.release_dispatched(_evicted("Preempted"), "Running")
    assert multikueue.release_dispatched(_evicted("Preempted"), "Suspended")
    given_back = _evicted("AdmissionCheck")
    given_back["status"]["admission"] = None
    assert not multikueue.release_dispatched(given_back, "Running"), "given back once"
    assert not multikueue.release_dispatched({"status": {"admission": {"clusterQueue": "cq"}}}, None)


def test_the_manager_gives_an_evicted_workloads_quota_back_so_multikueue_dispatches_again() -> None:
    kube = FakeKube()
    job = {**BODY, "spec": {**SPEC.to_wire(), "managedBy": multikueue.MULTIKUEUE_MANAGER},
           "status": {"phase": "Running"}}
    link(kube).dispatched(job)
    kube.workloads["trainingjob-llm"]["status"] = _evicted("AdmissionCheck")["status"]
    link(kube).dispatched(job)
    (_, patch, status), = kube.patches
    conditions = {c["type"]: c for c in patch["status"]["conditions"]}
    assert status and patch["status"]["admission"] is None
    assert conditions["QuotaReserved"]["status"] == "False" and conditions["Requeued"]["status"] == "False"
