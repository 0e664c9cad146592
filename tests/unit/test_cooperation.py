"""status.trainer and the TrainerCooperation condition: what a user reads of the cooperation the
operator has seen from the trainer (core/cooperation.py, through the pass's StatusBuilder)."""

from __future__ import annotations

from datetime import UTC, datetime

from topotrain.api.status import CheckpointRequestStatus, Reason, TrainerStatus, TrainingJobStatus
from topotrain.api.status import ConditionType as C
from topotrain.contract import CONTRACT_VERSION
from topotrain.core.cooperation import Seen, seen, verdict
from topotrain.core.reconcile_status import CheckpointView, StatusBuilder

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def observed(status: TrainingJobStatus, view: CheckpointView | None) -> TrainingJobStatus:
    sb = StatusBuilder(status, 1, NOW)
    sb.observe_checkpoint(view)
    return sb.status


def test_a_trainer_that_writes_no_heartbeat_is_shown_with_hang_detection_off() -> None:
    status = observed(TrainingJobStatus(phase="Running"), CheckpointView(step=4, uri="s3://b/j/step-4"))
    cond = status.condition(C.TRAINER_COOPERATION)
    assert cond is not None and cond.status == "False" and cond.reason == Reason.TRAINER_PARTIAL
    assert "hang detection off: no heartbeat seen" in cond.message
    assert "commit" not in cond.message, "a commit was seen"
    assert status.trainer == TrainerStatus(heartbeat=False, commits=True)


def test_a_cooperating_trainer_is_shown_with_what_was_seen_and_its_contract_version() -> None:
    view = CheckpointView(step=4, uri="s3://b/j/step-4", progress_step=6, progress_attempt=0,
                          progress_contract=CONTRACT_VERSION)  # fmt: skip
    request = CheckpointRequestStatus(value="r1", attempt=0, time="2026-01-01T00:00:00Z",
                                      state="Committed", step=6)  # fmt: skip
    status = observed(TrainingJobStatus(phase="Running", checkpoint_request=request), view)
    cond = status.condition(C.TRAINER_COOPERATION)
    assert cond is not None and cond.status == "True" and cond.reason == Reason.TRAINER_COOPERATES
    assert cond.message == f"heartbeat and commits seen, checkpoint requests honoured (contract version {CONTRACT_VERSION})"
    wire = status.to_wire()["trainer"]
    assert wire == {"heartbeat": True, "commits": True, "checkpointRequests": "Honoured",
                    "contractVersion": CONTRACT_VERSION}  # fmt: skip


def test_what_was_seen_once_is_kept_while_the_store_cannot_be_read() -> None:
    first = observed(TrainingJobStatus(phase="Running"),
                     CheckpointView(step=4, uri="s3://b/j/step-4", progress_step=5, progress_contract=1))
    later = observed(first, CheckpointView(reachable=False, error="503"))
    assert later.trainer == first.trainer and later.condition(C.TRAINER_COOPERATION) == first.condition(
        C.TRAINER_COOPERATION)
    # a later pass without the commit (retention, a new prefix) still remembers one was seen
    assert seen(first.trainer, Seen(heartbeat=True, contract=1)).commits


def test_an_older_sdk_a_timed_out_request_and_no_store_are_each_named_with_their_cost() -> None:
    old_sdk = TrainerStatus(heartbeat=True, commits=True, contract_version=None)
    said = verdict(old_sdk, store=True, ran=True, operator_contract=2)
    assert said.status == "False" and "older than the operator's contract version 2" in said.message
    newer = verdict(TrainerStatus(heartbeat=True, commits=True, contract_version=3), store=True, ran=True,
                    operator_contract=2)  # fmt: skip
    assert "contract version 3, the operator 2: upgrade the operator" in newer.message
    timed_out = seen(TrainerStatus(heartbeat=True, commits=True, contract_version=1),
                     Seen(heartbeat=True, contract=1, commit=True, request_state="TimedOut"))
    said = verdict(timed_out, store=True, ran=True, operator_contract=1)
    assert said.reason == Reason.TRAINER_PARTIAL and "checkpoint request timed out" in said.message
    bare = observed(TrainingJobStatus(phase="Running"), None)
    cond = bare.condition(C.TRAINER_COOPERATION)
    assert cond is not None and cond.reason == Reason.NO_CHECKPOINT_STORE and "hang detection off" in cond.message


def test_before_the_gang_runs_nothing_is_claimed() -> None:
    status = observed(TrainingJobStatus(phase="Starting"), CheckpointView())
    cond = status.condition(C.TRAINER_COOPERATION)
    assert cond is not None and cond.status == "Unknown" and cond.reason == Reason.TRAINER_NOT_SEEN
