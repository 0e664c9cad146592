"""spec.activeDeadlineSeconds, spec.ttlSecondsAfterFinished and status.progress's rate, percent
and ETA (issue 36): pure, pass by pass, `now` given."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from test_reconcile import T0, gang, run, running_job, spec
from topotrain.api.status import ProgressStatus, Reason
from topotrain.core.progress_rate import WINDOW_SECONDS, advance, duration, total_steps
from topotrain.core.reconcile_status import CheckpointView
from topotrain.core.status_edits import iso

CKPT = CheckpointView(step=200, uri="s3://ckpt/runs/ns/job/step-0000000200")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def with_spec(**fields: Any) -> Any:
    return spec().model_copy(update=fields)


# --- the deadline ---------------------------------------------------------------------------


def test_before_the_deadline_the_job_runs_and_the_next_pass_comes_by_it() -> None:
    obs = running_job(spec=with_spec(active_deadline_seconds=100))
    d, _ = run(obs, pods=gang(0), now=at(60))
    assert d.status.phase == "Running" and not d.delete
    assert d.requeue_after is not None and d.requeue_after <= 40


def test_a_running_gang_past_its_deadline_saves_a_checkpoint_then_fails() -> None:
    obs = running_job(spec=with_spec(active_deadline_seconds=100))
    d, obs = run(obs, pods=gang(0), now=at(101))
    ask = d.checkpoint_request
    assert ask is not None and d.status.phase == "Running" and not d.delete
    assert d.status.checkpoint_request is not None and d.status.checkpoint_request.reason == "deadline"
    served = replace(CKPT, step=230, request=ask.value, request_step=230)
    d, _ = run(obs, pods=gang(0), now=at(105), checkpoint=served)
    assert d.status.phase == "Failed" and d.status.reason == Reason.DEADLINE_EXCEEDED
    assert "spec.activeDeadlineSeconds (100s)" in (d.status.message or "")
    assert sorted(d.delete) == [f"job-0-{i}" for i in range(4)]
    assert d.status.checkpoint_request.state == "Committed"  # type: ignore[union-attr]


@pytest.mark.parametrize("case", ["no checkpoint store", "gang not Running"])
def test_past_the_deadline_without_a_gang_to_save_the_job_fails_at_once(case: str) -> None:
    obs = running_job(spec=with_spec(active_deadline_seconds=100))
    pods = gang(0)
    if case == "gang not Running":
        pods = tuple(replace(p, phase="Pending") if p.index == 3 else p for p in pods)
        _, obs = run(obs, pods=pods, now=at(50))
    checkpoint = None if case == "no checkpoint store" else CKPT
    d, _ = run(obs, pods=pods, now=at(150), checkpoint=checkpoint)
    assert d.status.phase == "Failed" and d.status.reason == Reason.DEADLINE_EXCEEDED
    assert d.checkpoint_request is None and len(d.delete) == 4


def test_a_job_that_never_started_has_no_deadline_running() -> None:
    obs = running_job(spec=with_spec(active_deadline_seconds=100))
    obs = replace(obs, status=obs.status.model_copy(update={"start_time": None}))
    d, _ = run(obs, pods=gang(0), now=at(10_000))
    assert d.status.phase != "Failed"


# --- the time to live -----------------------------------------------------------------------


def test_a_finished_job_is_deleted_once_its_time_to_live_passes() -> None:
    obs = running_job(spec=with_spec(ttl_seconds_after_finished=60))
    d, obs = run(obs, pods=gang(0, phase="Succeeded"), now=at(10))
    assert d.status.phase == "Succeeded" and not d.delete_job
    d, obs = run(obs, pods=(), now=at(40))
    assert not d.delete_job and d.requeue_after == pytest.approx(30)
    d, _ = run(obs, pods=(), now=at(71))
    assert d.delete_job and d.status.phase == "Succeeded"


def test_without_a_time_to_live_a_finished_job_is_kept() -> None:
    obs = running_job()
    _, obs = run(obs, pods=gang(0, phase="Succeeded"), now=at(10))
    d, _ = run(obs, pods=(), now=at(10**6))
    assert not d.delete_job


# --- progress -------------------------------------------------------------------------------


def beat(step: int, attempt: int = 0) -> ProgressStatus:
    return ProgressStatus(step=step, attempt=attempt)


def test_the_rate_percent_and_eta_follow_the_heartbeats() -> None:
    p = advance(None, beat(100), 1000, at(0))
    assert (p.percent_complete, p.steps_per_second, p.eta, p.window_step) == (10.0, None, None, 100)
    p = advance(p, beat(150), 1000, at(25))  # 50 steps in 25 s
    assert p.steps_per_second == 2.0 and p.eta == duration(425) == "7m"
    assert p.estimated_completion_time == iso(at(25 + 425)) and p.percent_complete == 15.0
    p = replace_observed(p, 25)
    p = advance(p, beat(1000), 1000, at(450))
    assert p.percent_complete == 100.0 and p.eta == "0s"


def replace_observed(p: ProgressStatus, seconds: float) -> ProgressStatus:
    return p.model_copy(update={"observed_time": iso(at(seconds))})


def test_the_window_slides_so_the_rate_follows_the_last_minutes() -> None:
    p = advance(None, beat(0), 10_000, at(0))
    p = replace_observed(advance(p, beat(100), 10_000, at(100)), 100)  # 1 step/s
    # past the window: the rate still spans from the anchor, then the anchor moves up
    p = advance(p, beat(110), 10_000, at(WINDOW_SECONDS + 10))
    assert p.steps_per_second == pytest.approx(110 / (WINDOW_SECONDS + 10), abs=1e-4)
    assert (p.window_step, p.window_time) == (100, iso(at(100)))
    p = replace_observed(p, WINDOW_SECONDS + 10)
    p = advance(p, beat(130), 10_000, at(WINDOW_SECONDS + 20))  # slower lately
    assert p.steps_per_second == pytest.approx(30 / (WINDOW_SECONDS - 80), abs=1e-4)


@pytest.mark.parametrize("new", [beat(120, attempt=1), beat(50)])
def test_a_new_attempt_or_an_older_step_starts_the_window_afresh(new: ProgressStatus) -> None:
    p = advance(advance(None, beat(100), 1000, at(0)), beat(200), 1000, at(50))
    p = advance(p, new, 1000, at(60))
    assert p.steps_per_second is None and p.eta is None and (p.window_step, p.window_time) == (new.step, iso(at(60)))


@pytest.mark.parametrize(("training", "total"), [
    ({"steps": 500}, 500), ({}, None), ({"steps": 0}, None), ({"steps": "500"}, None), ({"steps": True}, None),
])
def test_the_runs_length_comes_from_training_steps(training: dict[str, Any], total: int | None) -> None:
    assert total_steps(training) == total
    p = advance(advance(None, beat(0), total, at(0)), beat(10), total, at(10))
    assert p.steps_per_second == 1.0 and (p.eta is None) == (total is None)


@pytest.mark.parametrize(("seconds", "words"), [(0, "0s"), (59.4, "59s"), (61, "1m"), (3660, "1h01m"),
                                                (90_000, "1d01h")])
def test_the_eta_is_short(seconds: float, words: str) -> None:
    assert duration(seconds) == words


def test_the_status_carries_the_rate_between_passes() -> None:
    obs = running_job(spec=with_spec(training={"steps": 1000}))
    d, obs = run(obs, pods=gang(0), now=at(10), checkpoint=replace(CKPT, progress_step=300, progress_attempt=0))
    d, obs = run(obs, pods=gang(0), now=at(20), checkpoint=replace(CKPT, progress_step=300, progress_attempt=0))
    d, _ = run(obs, pods=gang(0), now=at(30), checkpoint=replace(CKPT, progress_step=340, progress_attempt=0))
    progress = d.status.progress
    assert progress is not None and progress.steps_per_second == 2.0 and progress.percent_complete == 34.0
    assert progress.eta == "5m" and progress.total_steps == 1000
