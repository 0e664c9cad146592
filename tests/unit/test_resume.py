"""A planned change cannot be taken back by the gang it replaced (issue 37 item 6).

Reproduced on the testbed before the fix: after a `spec.training.lr` edit the roll restored
step 303, the old gang trained on and its SIGTERM save committed step 320 (old lr, same request
id, attempt 0's shards); the new gang crashed before its first commit and the restart resumed
from 320. These tests hold the pieces that prevent it, without a cluster: the request value
that marks a planned stop (the trainer pauses on it), the floor a planned change records, the
store's scan for the newest commit above that floor (against `FakeS3Client`, the in-memory S3
fake of test_checkpoints.py, a unit-test boundary), and the pass's choice of resume step and
the reason it gives. The real trainer and operator are held to it by
tests/e2e/test_planned_floor.py and tests/trainer/test_trainer.py.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from test_checkpoints import FakeS3Client
from test_reconcile import T0, gang, run, running_job, spec
from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason
from topotrain.checkpoints import (
    SCAN_READS,
    CheckpointError,
    CheckpointStore,
    CommittedCheckpoint,
    attempt_dir,
)
from topotrain.contract import planned_stop_attempt, planned_stop_request
from topotrain.core import resume
from topotrain.core.reconcile_status import CheckpointView

MESH = {"tensor": 1, "pipeline": 1, "data": 2}
URI = "s3://ckpt/runs/ns/job"


def at(seconds: float) -> Any:
    return T0 + timedelta(seconds=seconds)


def view(step: int, **kw: Any) -> CheckpointView:
    return CheckpointView(step=step, uri=f"{URI}/step-{step:010d}", **kw)


@pytest.fixture
def store() -> CheckpointStore:
    return CheckpointStore(URI, client=FakeS3Client())  # type: ignore[arg-type]


def commit(store: CheckpointStore, step: int, attempt: int, request: str = "") -> None:
    store.write_commit(step, MESH, 10, shards=attempt_dir(attempt, "abcd1234"), request=request,
                       attempt=attempt)  # fmt: skip


# --- the request value: a planned stop, of one attempt ---------------------------------------


def test_a_planned_stop_request_names_its_attempt() -> None:
    value = planned_stop_request("rollout", 7, "2026-01-01T00:00:10.000Z")
    assert value.startswith("rollout-7-") and planned_stop_attempt(value) == 7
    for other in ("req-1", "", "resize-3-2026-01-01T00:00:10.000Z", "rollout-x-t+stop", "+stop"):
        assert planned_stop_attempt(other) is None, other


# --- which commits a restart may resume from ---------------------------------------------------


@pytest.mark.parametrize(
    ("step", "saved_by", "shards", "admitted"),
    [
        (303, 0, "", True),  # the step the roll restored
        (290, 0, "", True),  # history before it
        (320, 0, "", False),  # the replaced gang's late commit: old-spec work
        (320, None, "attempt-0-9f2c41d0", False),  # (its attempt read off the shards directory)
        (310, 1, "", True),  # the changed gang's own commit
        (330, 2, "", True),  # a later attempt's
        (330, None, "", True),  # an older trainer's commit, with no attempt on record: as before
    ],
)
def test_the_floor_admits_history_and_the_new_gangs_commits_only(
    step: int, saved_by: int | None, shards: str, admitted: bool
) -> None:
    floor = resume.Floor("rollout", attempt=1, step=303)
    found = CommittedCheckpoint(step, f"{URI}/step-{step:010d}", T0, shards=shards, saved_by=saved_by)
    assert floor.admits(found) is admitted


def test_a_change_that_started_fresh_admits_no_commit_of_the_replaced_gang() -> None:
    floor = resume.Floor("resize", attempt=3, step=None)
    assert not floor.admits(CommittedCheckpoint(5, "s3://b/p/step-0000000005", T0, saved_by=2))
    assert floor.admits(CommittedCheckpoint(5, "s3://b/p/step-0000000005", T0, saved_by=3))


def test_the_store_yields_the_newest_commit_above_the_floor(store: CheckpointStore) -> None:
    request = planned_stop_request("rollout", 0, "2026-01-01T00:00:30.000Z")
    commit(store, 300, 0)
    commit(store, 303, 0, request)  # served the roll's request
    commit(store, 320, 0, request)  # the old gang's SIGTERM save: same request id, old lr
    store.client.put_object(Bucket="ckpt", Key="runs/ns/job/step-0000000325/attempt-0-x/0.distcp",
                            Body=b"partial")  # fmt: skip
    floor = resume.Floor("rollout", attempt=1, step=303)
    found, skipped = store.newest_resumable(floor.admits)
    assert found is not None and found.step == 303
    assert skipped is not None and (skipped.step, skipped.attempt) == (320, 0)
    commit(store, 310, 1, request)  # the new gang's first own commit
    found, skipped = store.newest_resumable(floor.admits)
    assert found is not None and found.step == 310 and skipped is not None and skipped.step == 320
    found, skipped = store.newest_resumable()  # no planned change yet: the newest, as ever
    assert found is not None and found.step == 320 and skipped is None


def test_the_scan_for_a_resumable_commit_is_bounded(store: CheckpointStore) -> None:
    """A bucket whose newest step directories are all uncommitted (the user's to fill) costs a
    bounded number of reads, and says so, instead of a GET per directory."""
    commit(store, 1, 0)
    client = store.client
    for step in range(2, SCAN_READS + 10):
        client.put_object(Bucket="ckpt", Key=f"runs/ns/job/step-{step:010d}/junk", Body=b"x")
    reads = 0
    original = client.get_object

    def counting(**kw: Any) -> Any:
        nonlocal reads
        reads += 1
        return original(**kw)

    client.get_object = counting  # type: ignore[method-assign]
    with pytest.raises(CheckpointError, match=f"newest {SCAN_READS} step directories"):
        store.newest_resumable()
    assert reads == SCAN_READS


# --- the pass: the roll records its floor, a restart resumes above it and says why -----------


def _rolled() -> tuple[Any, str]:
    """A running gang (attempt 0) rolled onto a new template from the step its request saved, 303."""
    obs = replace(running_job(), template="old", generation=1)
    old = tuple(replace(p, template="old") for p in gang(0))
    _, obs = run(obs, pods=old)
    d, obs = run(replace(obs, template="new", generation=2), pods=old, now=at(30))
    assert d.checkpoint_request is not None
    value = d.checkpoint_request.value
    asked = tuple(replace(p, checkpoint_request=value) for p in old)
    d, obs = run(obs, pods=asked, now=at(33), checkpoint=view(303, request=value, request_step=303))
    assert d.launch is not None and d.launch.attempt == 1 and d.launch.resume_step == 303
    return d, value


def test_a_roll_records_the_step_it_restored_and_why() -> None:
    d, _ = _rolled()
    assert resume.floor(d.status) == resume.Floor("rollout", 1, 303)
    wire = d.status.to_wire()
    assert wire["plannedRestore"] == {"reason": "rollout", "attempt": 1, "step": 303}
    assert d.status.recovery is not None and d.status.recovery.resume_step == 303
    assert d.status.recovery.resume_reason == "the checkpoint the rollout asked for"


def _new_gang_crashes_before_its_first_commit(**spec_fields: Any) -> Any:
    """After the lr roll (step 303 restored), the store also holds the old gang's step 320 (the
    observer skipped it, resume.Floor); a pod of the new gang fails before its first commit."""
    d, _ = _rolled()
    obs = replace(running_job(), template="new", generation=2, status=d.status)
    if spec_fields:
        obs = replace(obs, spec=spec(**spec_fields))
    new = tuple(replace(p, template="new") for p in gang(1))
    seen = view(303, skipped_step=320, skipped_attempt=0)
    _, obs = run(obs, pods=new, now=at(40), checkpoint=seen)
    crashed = list(new)
    crashed[1] = replace(crashed[1], phase="Failed", exit_code=1)
    d, _ = run(obs, pods=tuple(crashed), now=at(45), checkpoint=seen)
    return d


def test_a_crash_of_the_new_gang_before_its_first_commit_resumes_from_the_rolls_step() -> None:
    """The store holds the old gang's step 320 (the observer skipped it, resume.Floor): the
    restart resumes from 303, and status and the Event say which step and why."""
    d = _new_gang_crashes_before_its_first_commit()
    assert d.launch is not None and d.launch.attempt == 2 and d.launch.resume_step == 303
    rec = d.status.recovery
    assert rec is not None and rec.resume_step == 303 and rec.resume_reason is not None
    assert rec.resume_reason.startswith("the newest commit of the current spec; step 320, "
                                        "committed by attempt 0 after the rollout to attempt 1 "
                                        "restored step 303")  # fmt: skip
    restarted = [m for _, r, m in d.events if r == Reason.RESTARTED]
    assert restarted and restarted[0].startswith("attempt 2 from step 303: the newest commit of the current spec")
    # the floor stays until the next planned change: a later restart keeps the same rule
    assert resume.floor(d.status) == resume.Floor("rollout", 1, 303)


def test_an_in_place_restart_says_which_step_and_why() -> None:
    d = _new_gang_crashes_before_its_first_commit(restartInPlace=True)
    rec = d.status.recovery
    assert rec is not None and rec.mode == "inPlace" and rec.resume_step == 303
    recovering = d.status.condition(C.RECOVERING)
    assert recovering is not None and recovering.reason == Reason.RESTARTED_IN_PLACE
    assert "attempt 2 from step 303 (the newest commit of the current spec; step 320" in recovering.message


def test_a_cancelled_planned_stop_is_cleared_only_on_the_pods_that_carry_it() -> None:
    obs = running_job()
    d, obs = run(replace(obs, spec=_scaled(1)), pods=gang(0), now=at(10))
    assert d.checkpoint_request is not None
    value = d.checkpoint_request.value
    assert planned_stop_attempt(value) == 0
    pods = tuple(replace(p, checkpoint_request=value if p.index < 2 else "") for p in gang(0))
    d, _ = run(obs, spec=_scaled(2), pods=pods, now=at(12))  # scaled back: called off
    assert d.checkpoint_request is not None and d.checkpoint_request.value == ""
    assert sorted(d.checkpoint_request.pods) == ["job-0-0", "job-0-1"]


def _scaled(data: int) -> Any:
    s = spec()
    s.parallelism.data = data
    return s
