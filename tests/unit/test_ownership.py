"""Identity by owner UID: which pods, children and checkpoints a TrainingJob may call its own.

Pure tests: the checkpoint claim table, the messages a user reads, and the
snapshot's view of a job whose deleted namesake's pods are still terminating.
The API server's side (409s, a user's Service, GC) is in
tests/integration/test_operator_ownership.py.
"""

from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any

import pytest
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import Reason
from topotrain.checkpoints import CheckpointStore, PrefixOwner
from topotrain.controller.indexes import slim_node, slim_pod
from topotrain.controller.snapshot import Ghosts, Ledger, Snapshot
from topotrain.core.manifests import JobMeta, PodPlan, pod
from topotrain.core.ownership import (
    Owner,
    claim_checkpoints,
    controller_owner,
    foreign_message,
    owned_by,
)
from topotrain.placement.topology import TopologyLevels

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
EARLIER = datetime(2025, 12, 1, tzinfo=UTC)
PREFIX = "s3://ckpt/runs/team/llm"
OLD = PrefixOwner(uid="old-uid", created=EARLIER)
SPEC = TrainingJobSpec.model_validate({
    "image": "trainer:1", "parallelism": {"tensor": 8, "pipeline": 1, "data": 2},
    "worker": {"gpusPerPod": 8},
})


class PutGetS3:
    """Fake of the two boto3 calls an owner record needs (a unit-test boundary)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put_object(self, Bucket: str, Key: str, Body: bytes, **_: Any) -> None:
        self.objects[Key] = Body

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        return {"Body": io.BytesIO(self.objects[Key])}


# --- checkpoints --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("started", "policy", "owner", "latest", "writes", "problem", "took_over"),
    [
        # a fresh prefix: claimed, starts afresh
        (False, "IfOwned", None, None, "new-uid", None, None),
        # our own record (an operator restart after the claim): nothing to do
        (False, "IfOwned", PrefixOwner("new-uid", EARLIER), 100, None, None, None),
        # a namesake's record but nothing committed: nothing to resume, claimed
        (False, "IfOwned", OLD, None, "new-uid", None, None),
        # a namesake's committed steps: refused by default ...
        (False, "IfOwned", OLD, 100, None, "uid old-uid", None),
        # ... and steps nobody claimed (copied there, or an older operator's run) too
        (False, "IfOwned", None, 100, None, "left no owner record", None),
        # opted in: taken over, and the record says from whom and which step
        (False, "Always", OLD, 100, "new-uid", None, ("old-uid", 100)),
        (False, "Always", None, 100, "new-uid", None, ("", 100)),
        # a job that started under an operator that wrote no record: its prefix, claimed quietly
        (True, "IfOwned", None, 300, "new-uid", None, None),
        # someone claimed the prefix while this job ran: two jobs must not share it
        (True, "Always", OLD, 300, None, "two jobs must not share", None),
    ],
)
def test_checkpoint_claim(started: bool, policy: Any, owner: PrefixOwner | None, latest: int | None,
                          writes: str | None, problem: str | None,
                          took_over: tuple[str, int] | None) -> None:
    claim = claim_checkpoints(uid="new-uid", started=started, policy=policy, owner=owner,
                              latest_step=latest, prefix=PREFIX, now=NOW)
    assert (claim.write.uid if claim.write else None) == writes
    if problem is None:
        assert claim.problem is None
    else:
        assert claim.problem is not None and claim.problem[0] == Reason.FOREIGN_CHECKPOINTS
        assert problem in claim.problem[1] and PREFIX in claim.problem[1]
    got = (claim.took_over.resumed_uid, claim.took_over.resumed_step) if claim.took_over else None
    assert got == took_over


def test_refusal_tells_the_user_how_to_opt_in_or_start_afresh() -> None:
    claim = claim_checkpoints(uid="new-uid", started=False, policy="IfOwned", owner=OLD,
                              latest_step=200, prefix=PREFIX, now=NOW)
    assert claim.problem is not None
    message = claim.problem[1]
    assert "up to step 200" in message and "created 2025-12-01T00:00:00Z" in message
    assert "spec.checkpoint.resumePolicy: Always" in message and "spec.checkpoint.uri" in message


def test_a_taken_over_prefix_keeps_saying_so_after_the_claim() -> None:
    first = claim_checkpoints(uid="new-uid", started=False, policy="Always", owner=OLD,
                              latest_step=100, prefix=PREFIX, now=NOW)
    assert first.write is not None
    store = CheckpointStore(PREFIX, client=PutGetS3())  # type: ignore[arg-type]
    store.write_owner(first.write)
    record = store.read_owner()
    assert record == PrefixOwner("new-uid", NOW, resumed_uid="old-uid", resumed_step=100)
    later = claim_checkpoints(uid="new-uid", started=True, policy="Always", owner=record,
                              latest_step=400, prefix=PREFIX, now=NOW)
    assert later.write is None and later.problem is None and later.took_over == record


# --- children -----------------------------------------------------------------------


def ref(kind: str, name: str, uid: str, controller: bool = True) -> dict[str, Any]:
    return {"kind": kind, "name": name, "uid": uid, "controller": controller}


def test_only_the_controller_reference_makes_an_object_ours() -> None:
    meta = {"ownerReferences": [ref("TrainingJob", "llm", "mine", controller=False),
                                ref("ReplicaSet", "web", "rs-uid")]}
    assert controller_owner(meta) == Owner("ReplicaSet", "web", "rs-uid")
    assert not owned_by(meta, "mine") and owned_by(meta, "rs-uid")
    assert not owned_by({}, "mine") and not owned_by({"ownerReferences": [ref("X", "x", "")]}, "")


@pytest.mark.parametrize(
    ("owner", "terminating", "says"),
    [
        (None, False, "Service team/llm exists and is not owned by this TrainingJob; delete or rename it"),
        (Owner("Deployment", "web", "d"), False, "(its controller is Deployment web); delete or rename it"),
        (Owner("TrainingJob", "llm", "old"), False,
         "belongs to an earlier TrainingJob llm (uid old) and awaits the garbage collector"),
        (Owner("TrainingJob", "llm", "old"), True, "and is being deleted; waiting for it to go"),
    ],
)
def test_foreign_object_message(owner: Owner | None, terminating: bool, says: str) -> None:
    assert says in foreign_message("Service", "team", "llm", owner, "llm", terminating=terminating)


# --- the snapshot of a re-created job -----------------------------------------------


def node(name: str) -> dict[str, Any]:
    return slim_node({
        "metadata": {"name": name, "labels": {"nvidia.com/gpu.product": "H100", "kubernetes.io/hostname": name}},
        "status": {"allocatable": {"nvidia.com/gpu": "8"},
                   "conditions": [{"type": "Ready", "status": "True"}]},
    })


def job_pod(uid: str, attempt: int, index: int, node_name: str, *, terminating: bool = False
            ) -> dict[str, Any]:
    manifest = pod(JobMeta("llm", "team", uid), SPEC,
                   PodPlan(attempt=attempt, index=index, node=node_name, data=2, resume_step=None))
    manifest["spec"]["nodeName"] = node_name
    manifest["spec"]["schedulingGates"] = []
    manifest["status"] = {"phase": "Running"}
    if terminating:
        manifest["metadata"]["deletionTimestamp"] = "2026-01-02T03:04:00Z"
    return slim_pod(manifest)


def test_a_deleted_namesakes_terminating_pods_are_not_the_new_jobs_but_hold_their_gpus() -> None:
    old = [job_pod("old-uid", 0, i, f"n{i}", terminating=True) for i in range(2)]
    snap = Snapshot.take([node("n0"), node("n1"), node("n2")], old, Ledger())
    key = ("team", "llm")
    assert snap.job_pods(key, "new-uid") == ()
    assert len(snap.job_pods(key, "old-uid")) == 2
    inventory = snap.inventory(key, TopologyLevels(), [], {}, uid="new-uid")
    assert {n: info.free for n, info in inventory.nodes.items()} == {"n0": 0, "n1": 0, "n2": 8}
    problem = snap.foreign_problem(key, "new-uid", attempt=0)
    assert problem is not None and problem[0] == Reason.FOREIGN_OBJECT
    assert "Pod team/llm-0-0 exists and is not owned by this TrainingJob" in problem[1]
    assert "is being deleted" in problem[1]
    # names of attempts 0 and 1 are not taken by an attempt-5 pod: no wait
    later = Snapshot.take([node("n0")], [job_pod("old-uid", 5, 0, "n0", terminating=True)], Ledger())
    assert later.foreign_problem(key, "new-uid", attempt=0) is None


def test_the_jobs_own_pods_and_ledger_entries_stay_its_own() -> None:
    ledger = Ledger()
    manifest = pod(JobMeta("llm", "team", "new-uid"), SPEC,
                   PodPlan(attempt=0, index=1, node="n1", data=2, resume_step=None))
    ledger.record(("team", "llm"), manifest)
    snap = Snapshot.take([node("n0"), node("n1")], [job_pod("new-uid", 0, 0, "n0")], ledger)
    assert [p.name for p in snap.job_pods(("team", "llm"), "new-uid")] == ["llm-0-0", "llm-0-1"]
    assert snap.foreign_problem(("team", "llm"), "new-uid", attempt=0) is None
    inventory = snap.inventory(("team", "llm"), TopologyLevels(), [], {}, uid="new-uid")
    assert {n: info.free for n, info in inventory.nodes.items()} == {"n0": 8, "n1": 8}


def test_a_reserved_launch_holds_its_gpus_before_any_api_call_until_unreserved() -> None:
    """The decision's pods are in the ledger when the plan lock is released (the creates run
    after it): another job's inventory counts their GPUs as taken; a failed pass frees them."""
    from topotrain.api.status import TrainingJobStatus
    from topotrain.controller.act import Actuator
    from topotrain.controller.settings import Settings
    from topotrain.core.decision import Decision, Launch

    ledger = Ledger()
    actuator = Actuator(kube=None, settings=Settings(), ledger=ledger)  # type: ignore[arg-type]
    launch = Launch(attempt=0, data=2, pool="H100-80GB", assignments={0: "n0", 1: "n1"},
                    resume_step=None, mode="initial")
    decision = Decision(status=TrainingJobStatus(), launch=launch)
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "new-uid"}}
    actuator.reserve(("team", "llm"), body, SPEC, decision)

    def free_for_other_job() -> dict[str, int]:
        snap = Snapshot.take([node("n0"), node("n1"), node("n2")], [], ledger)
        inventory = snap.inventory(("team", "other"), TopologyLevels(), [], {}, uid="other-uid")
        return {n: info.free for n, info in inventory.nodes.items()}

    assert free_for_other_job() == {"n0": 0, "n1": 0, "n2": 8}
    actuator.unreserve(("team", "llm"), decision)
    assert free_for_other_job() == {"n0": 8, "n1": 8, "n2": 8}


def test_a_pod_the_api_server_says_is_gone_leaves_every_later_snapshot() -> None:
    """kopf's index keeps a pod whose DELETED event a re-listed watch never delivered (long soak
    seed 1302: the gang waited for ever). The Actuator reports the 404s of its pod calls; the
    uids the pass saw under those names leave the snapshot, a namesake created later does not."""
    from topotrain.api.status import TrainingJobStatus
    from topotrain.controller.act import Actuator
    from topotrain.controller.settings import Settings
    from topotrain.core.decision import Decision

    def with_uid(p: dict[str, Any], uid: str) -> dict[str, Any]:
        return {**p, "metadata": {**p["metadata"], "uid": uid}}

    ghost = with_uid(job_pod("old-uid", 0, 0, "n0", terminating=True), "pod-a")
    alive = with_uid(job_pod("old-uid", 0, 1, "n1"), "pod-b")

    class GoneKube:  # the unit-test boundary: the API server answers 404 for llm-0-0
        def delete_pods(self, namespace: str, names: list[str], grace: int,
                        seen: Any = None) -> list[str]:
            return [n for n in names if n == "llm-0-0"]

    actuator = Actuator(kube=GoneKube(), settings=Settings(), ledger=Ledger())  # type: ignore[arg-type]
    actuator.apply(("team", "llm"), {}, SPEC, Decision(status=TrainingJobStatus(), delete=["llm-0-0", "llm-0-1"]))
    assert actuator.gone == ["llm-0-0"]
    ghosts = Ghosts()
    assert ghosts.mark([ghost, alive], "team", actuator.gone) == ["pod-a"]
    assert ghosts.mark([ghost, alive], "team", actuator.gone) == []  # reported once
    snap = Snapshot.take([node("n0"), node("n1")], ghosts.drop([ghost, alive]), Ledger())
    assert [p.name for p in snap.job_pods(("team", "llm"), "old-uid")] == ["llm-0-1"]
    inventory = snap.inventory(("team", "llm"), TopologyLevels(), [], {}, uid="new-uid")
    assert {n: info.free for n, info in inventory.nodes.items()} == {"n0": 8, "n1": 0}
    namesake = with_uid(job_pod("old-uid", 0, 0, "n0"), "pod-c")
    assert [p["metadata"]["uid"] for p in ghosts.drop([ghost, namesake])] == ["pod-c"]
    ghosts.drop([namesake])  # the index dropped it at last: nothing is kept for it
    assert ghosts.uids == set()


def test_the_resync_finds_ghosts_no_call_touched_with_two_lists() -> None:
    """A deleted job's pod (no loop of ours ever deletes it again) held its GPUs in the snapshot
    for good. Pods the index shows that a cached LIST and then a consistent LIST both lack are
    ghosts; a pod only the cached LIST lacks (created a moment ago) is not."""
    def with_uid(p: dict[str, Any], uid: str) -> dict[str, Any]:
        return {**p, "metadata": {**p["metadata"], "uid": uid}}

    index = [with_uid(job_pod("old-uid", 0, 0, "n0"), "gone"), with_uid(job_pod("old-uid", 0, 1, "n1"), "new"),
             with_uid(job_pod("old-uid", 1, 0, "n2"), "kept")]  # fmt: skip
    lists: list[bool] = []

    def list_uids(cached: bool) -> set[str]:  # the unit-test boundary: the API server's LISTs
        lists.append(cached)
        return {"kept"} if cached else {"kept", "new"}

    ghosts = Ghosts()
    found = ghosts.resync(index, list_uids, second_look=0)
    assert [p["metadata"]["uid"] for p in found] == ["gone"] and lists == [True, False]
    assert [p["metadata"]["uid"] for p in ghosts.drop(index)] == ["new", "kept"]
    lists.clear()
    assert ghosts.resync(index, lambda cached: lists.append(cached) or {"kept", "new"}, second_look=0) == []
    assert lists == [True]  # nothing suspect: no consistent LIST


def test_a_deleted_jobs_unseen_pods_leave_the_ledger_with_it() -> None:
    """A job deleted right after its pods were created (before any pass saw them in the watch)
    left them in the ledger for LEDGER_TTL: its namesake found 'its' pod names taken by a pod
    that no longer existed, and other jobs found the GPUs taken. The loop's end and the pod's
    DELETED event each drop them; a namesake's own entries stay."""
    key = ("team", "llm")

    def entry(uid: str, index: int) -> dict[str, Any]:
        return pod(JobMeta("llm", "team", uid), SPEC, PodPlan(attempt=0, index=index, node=f"n{index}",
                                                          data=2, resume_step=None))

    ledger = Ledger()
    ledger.record(key, entry("old-uid", 0))
    ledger.record(key, entry("old-uid", 1))
    snap = Snapshot.take([node("n0"), node("n1")], [], ledger)
    assert snap.foreign_problem(key, "new-uid", attempt=0) is not None, "the stale entry stands in the way"

    ledger.deleted(slim_pod(entry("other-uid", 0)))  # a namesake's pod of that name: not this entry
    assert len(ledger.unseen(lambda *_: False)) == 2
    ledger.deleted(slim_pod(entry("old-uid", 0)))
    assert [slim["metadata"]["name"] for _, slim in ledger.unseen(lambda *_: False)] == ["llm-0-1"]

    ledger.record(("other-team", "llm"), pod(JobMeta("llm", "other-team", "old-uid"), SPEC,
                                             PodPlan(attempt=0, index=0, node="n0", data=2, resume_step=None)))
    ledger.forget_owned("team", "old-uid")
    assert [slim["metadata"]["namespace"] for _, slim in ledger.unseen(lambda *_: False)] == ["other-team"]
    snap = Snapshot.take([node("n0"), node("n1")], [], ledger)
    assert snap.foreign_problem(key, "new-uid", attempt=0) is None
    inventory = snap.inventory(key, TopologyLevels(), [], {}, uid="new-uid")
    assert {n: info.free for n, info in inventory.nodes.items()} == {"n0": 0, "n1": 8}
