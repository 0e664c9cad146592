"""The bundled trainer, run as real multi-process torch.distributed (gloo on CPU)
with the testbed's real S3 server (versitygw).

Tolerances: a parallel run reduces in a different order than the single-process
reference, so its losses and gradient norms agree to LOSS_TOL (observed: a few
1e-7 at tp=2, pp=2, dp=2). Gradient clipping at 1.0 is active (norms start near
2.8), so gradients reduced by sum instead of mean, or a wrong microbatch scale,
change the clipped update and the logged norm, and fail these comparisons.
A resume at the same mesh must reproduce the uninterrupted losses bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from topotrain.checkpoints import CheckpointStore, ServedRequest
from topotrain.contract import (
    ATTEMPT_ANNOTATION,
    CHECKPOINT_REQUEST,
    CONTROL_DIR_ENV,
    HOLD_RELEASE,
    RESUME_STEP_ANNOTATION,
    format_control,
    planned_stop_request,
)
from topotrain_trainer.config import EXIT_BAD_CONFIG, TrainingConfig
from topotrain_trainer.control import EXIT_STOPPED
from topotrain_trainer.supervisor import SPARE_DELAY_ENV

from testbed import faults
from testbed.procs import wait_until

from .harness import REPO_ROOT, TrainerRun, descendants, trainer_env
from .reference import reference_run

if TYPE_CHECKING:
    from testbed.s3 import S3Server

pytestmark = [pytest.mark.trainer, pytest.mark.slow]

LOSS_TOL = 1e-5
STEPS, INTERVAL, GLOBAL_BATCH = 9, 3, 8


def training(tmp: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "model": "tiny", "seq_len": 32, "global_batch": GLOBAL_BATCH, "micro_batch": 1,
        "warmup_steps": 2, "steps": STEPS, "progress_every": 1, "metrics_port": 0,
        "staging_dir": str(tmp), **overrides,
    }  # fmt: skip


def store_for(s3: S3Server, uri: str) -> CheckpointStore:
    return CheckpointStore(uri, client=s3.client())


def fresh_uri(s3: S3Server) -> str:
    bucket = s3.create_bucket(f"trainer-{uuid.uuid4().hex[:8]}")
    return f"s3://{bucket}/trainer/test"


@dataclass(frozen=True)
class Baseline:
    uri: str
    losses: dict[int, float]
    grad_norms: dict[int, float]


@pytest.fixture(scope="module")
def baseline(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """An uninterrupted dp=2 run with a committed checkpoint every 3 steps (all kept)."""
    uri = fresh_uri(s3)
    run = TrainerRun(
        trainer_env(
            data=2,
            training=training(tmp_path_factory.mktemp("baseline")),
            s3_env=s3.env(),
            checkpoint_uri=uri,
            interval=INTERVAL,
        )
    )
    assert run.finish() == 0, run.tail()
    assert [c.step for c in store_for(s3, uri).list_committed()] == [3, 6, 9]
    return Baseline(uri, run.losses(), run.grad_norms())


def test_bad_training_config_exits_with_ex_config(tmp_path: Path) -> None:
    env = trainer_env(data=2, training=training(tmp_path, global_batch=7))
    done = subprocess.run(
        [sys.executable, "-m", "topotrain_trainer"], env=env, cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == EXIT_BAD_CONFIG == 78
    message = json.loads(done.stdout.strip().splitlines()[-1])
    assert message["event"] == "bad_config"
    assert "globalBatch=7" in message["error"]


def test_uninterrupted_dp2_matches_reference(baseline: Baseline, tmp_path: Path) -> None:
    ref_losses, _ = reference_run(TrainingConfig.from_mapping(training(tmp_path)))
    assert [baseline.losses[s] for s in range(1, STEPS + 1)] == pytest.approx(
        ref_losses, abs=LOSS_TOL
    )


def _versitygw_pid(s3: S3Server) -> int:
    pid = s3._process.pid()  # the testbed tracks the server's pid; we pause it in place
    assert pid is not None
    return pid


def test_exact_resume_after_kill_following_commit_and_during_in_flight_save(
    s3: S3Server, baseline: Baseline, tmp_path: Path
) -> None:
    uri = fresh_uri(s3)
    store = store_for(s3, uri)

    def launch(resume: int | None, attempt: int) -> TrainerRun:
        return TrainerRun(trainer_env(data=2, training=training(tmp_path), s3_env=s3.env(),
                                      checkpoint_uri=uri, interval=INTERVAL, keep=1,
                                      resume_step=resume, attempt=attempt))  # fmt: skip

    # 1. Kill every process once a checkpoint has been committed.
    first = launch(None, 0)
    first.wait_for("checkpoint_committed", step=3)
    first.kill()
    committed = store.latest_committed()
    assert committed is not None and committed.step in (3, 6)

    # An older commit whose retention never ran (its trainer was killed between COMMITTED and
    # retention): the next attempt applies retention as it starts, not only after its first commit.
    store.write_commit(1, {"dp": 2}, 0)
    # 2. Resume, then kill while the next save is uploading (S3 paused, so it cannot finish).
    second = launch(committed.step, 1)
    restored = second.wait_for("restored")
    assert restored["consumed_samples"] == committed.step * GLOBAL_BATCH
    assert 1 in second.wait_for("retention_applied")["deleted"]
    assert [c.step for c in store.list_committed()] == [committed.step]
    in_flight = committed.step + INTERVAL
    os.kill(_versitygw_pid(s3), signal.SIGSTOP)
    try:
        second.wait_for("checkpoint_saved", step=in_flight)
        second.kill()
    finally:
        os.kill(_versitygw_pid(s3), signal.SIGCONT)
    assert store.read_commit(in_flight) is None, "an interrupted save must never be COMMITTED"
    latest = store.latest_committed()
    assert latest is not None and latest.step == committed.step

    # 3. Resume again and train to the end: the losses are the uninterrupted run's, exactly.
    third = launch(latest.step, 2)
    assert third.finish() == 0, third.tail()
    for run in (second, third):
        for step, loss in run.losses().items():
            assert loss == baseline.losses[step], f"step {step} differs after resume"
    assert sorted(third.losses()) == list(range(latest.step + 1, STEPS + 1))
    assert [c.step for c in store.list_committed()][-1] == STEPS
    progress = store.read_progress()
    assert progress is not None and (progress.step, progress.attempt) == (STEPS, 2)


@pytest.mark.parametrize(
    ("pipeline", "data", "schedule"),
    [(2, 1, "gpipe"), (1, 4, "1f1b")],
    ids=["pp2-dp1-gpipe", "pp1-dp4"],
)
def test_resume_at_another_data_degree_continues_the_same_samples(
    s3: S3Server, baseline: Baseline, tmp_path: Path, pipeline: int, data: int, schedule: str
) -> None:
    """Saved at dp=2 (pp=1); resumed at dp=1 split into two GPipe stages, and at dp=4,
    with the same global batch (gradient accumulation adapts)."""
    config = training(tmp_path, schedule=schedule)
    run = TrainerRun(
        trainer_env(
            pipeline=pipeline,
            data=data,
            training=config,
            s3_env=s3.env(),
            checkpoint_uri=baseline.uri,
            resume_step=3,
        )
    )
    assert run.finish() == 0, run.tail()
    restored = next(e for e in run.events if e["event"] == "restored")
    assert (restored["step"], restored["consumed_samples"]) == (3, 3 * GLOBAL_BATCH)
    assert sorted(run.losses()) == list(range(4, STEPS + 1))
    for step, loss in run.losses().items():
        assert loss == pytest.approx(baseline.losses[step], abs=LOSS_TOL), f"step {step}"
    done = run.events[-1]
    assert (done["event"], done["consumed_samples"]) == ("done", STEPS * GLOBAL_BATCH)


def test_a_checkpoint_saved_after_a_resize_resumes_at_its_own_mesh(
    s3: S3Server, baseline: Baseline, tmp_path: Path
) -> None:
    """dp=2 -> dp=1 (a resize: the RNG state of the other mesh is not loaded) -> a save at dp=1
    -> a resume at dp=1. The save after the resize must carry the RNG state again: it did not,
    and the next restart of a job that had shrunk or grown failed with "Missing key in
    checkpoint state_dict: app.rng_rank0" (found by bench/planned.py: scale down, up, drain)."""
    uri = fresh_uri(s3)
    # Every run has the baseline's schedule (STEPS): the learning rate depends on it.
    first = TrainerRun(trainer_env(data=2, training=training(tmp_path), s3_env=s3.env(),
                                   checkpoint_uri=uri, interval=INTERVAL))  # fmt: skip
    assert first.finish() == 0, first.tail()
    resized = TrainerRun(trainer_env(data=1, training=training(tmp_path), s3_env=s3.env(),
                                     checkpoint_uri=uri, interval=INTERVAL, resume_step=3, attempt=1))  # fmt: skip
    assert resized.finish() == 0, resized.tail()
    assert dict(store_for(s3, uri).read_commit(6).mesh)["data"] == 1  # type: ignore[union-attr]
    again = TrainerRun(trainer_env(data=1, training=training(tmp_path), s3_env=s3.env(),
                                   checkpoint_uri=uri, interval=INTERVAL, resume_step=6, attempt=2))  # fmt: skip
    assert again.finish() == 0, again.tail()
    assert not [e for e in again.events if e["event"] == "restore_without_rng"], "step 6 lacks its RNG state"
    restored = next(e for e in again.events if e["event"] == "restored")
    assert restored["step"] == 6
    assert sorted(again.losses()) == [7, 8, 9]
    for step, loss in again.losses().items():
        assert loss == pytest.approx(baseline.losses[step], abs=LOSS_TOL), f"step {step}"


@pytest.fixture
def s3_restarted_after(s3: S3Server) -> Iterator[S3Server]:
    yield s3
    if not s3.running():
        s3.start()


def test_s3_outage_during_async_save_fails_that_checkpoint_only(
    s3_restarted_after: S3Server, baseline: Baseline, tmp_path: Path
) -> None:
    s3 = s3_restarted_after
    uri = fresh_uri(s3)
    store = store_for(s3, uri)
    s3.stop()  # the outage covers the first save
    run = TrainerRun(trainer_env(data=2, training=training(tmp_path), s3_env=s3.env(),
                                 checkpoint_uri=uri, interval=INTERVAL))  # fmt: skip
    run.wait_for("checkpoint_failed", step=3)
    run.signal_all(signal.SIGSTOP)  # hold training while S3 comes back
    s3.start()
    run.signal_all(signal.SIGCONT)
    assert run.finish() == 0, run.tail()

    outcomes = {
        e["step"]: e["event"]
        for e in run.events
        if e["event"] in ("checkpoint_committed", "checkpoint_failed")
    }
    failed = sorted(s for s, outcome in outcomes.items() if outcome == "checkpoint_failed")
    assert failed[0] == 3 and store.read_commit(3) is None
    # Save 6 may have begun uploading in the moment between the failure line and the
    # freeze; then it fails too. Every save after the last failure must commit.
    assert failed in ([3], [3, 6])
    for step in (s for s in (6, 9) if s > failed[-1]):
        assert outcomes[step] == "checkpoint_committed"
        assert store.read_commit(step) is not None
    assert [c.step for c in store.list_committed()][-1] == STEPS
    assert run.losses() == baseline.losses  # an outage never perturbs training


def test_3d_parallel_matches_single_process_reference(tmp_path: Path) -> None:
    """tp=2, pp=2, dp=2 against the single-process reference, across a sequence-length change
    (training.seqLenSchedule: windows of 16 for two steps, then whole 32-token samples): the
    pipeline's schedule is built again for the new activation shape, on every stage at once."""
    config = training(tmp_path, steps=3, schedule="1f1b", seq_len_schedule="0:16;2:32")
    run = TrainerRun(trainer_env(tensor=2, pipeline=2, data=2, training=config))
    assert run.finish() == 0, run.tail()
    # the eight ranks were forked from the pod's one forker (topotrain_sdk.forker): importing the
    # trainer leaves it single-threaded, so forking is safe and none started a fresh interpreter
    assert [e["forked"] for e in _of(run, "workers_started")] == [8], run.tail()
    ref_losses, ref_norms = reference_run(TrainingConfig.from_mapping(config))
    assert list(run.losses()) == [1, 2, 3]
    for step, loss in run.losses().items():
        assert loss == pytest.approx(ref_losses[step - 1], abs=LOSS_TOL), f"step {step}"
        assert run.grad_norms()[step] == pytest.approx(ref_norms[step - 1], rel=LOSS_TOL)
    assert ref_losses[-1] < ref_losses[0]  # it learns


def _write_control(control_dir: Path, annotations: dict[str, str]) -> None:
    """Write the control file as the kubelet does: whole, swapped in by a rename."""
    staged = control_dir / ".annotations.new"
    staged.write_text(format_control(annotations))
    staged.replace(control_dir / "annotations")


def _request_checkpoint(control_dir: Path, value: str) -> None:
    _write_control(control_dir, {CHECKPOINT_REQUEST: value})


def _of(run: TrainerRun, event: str) -> list[dict[str, Any]]:
    return [e for e in run.events if e.get("event") == event]


HOLD = 5  # training.holdAtStep of the stop test: the run cannot end before its SIGTERM


def test_checkpoint_request_and_sigterm_lose_no_step(
    s3: S3Server, baseline: Baseline, tmp_path: Path
) -> None:
    """No interval saves. A checkpoint request through the control file saves the next step
    and training goes on; SIGTERM to the pod's first process (what the kubelet signals) saves
    the current step, waits for COMMITTED and exits EXIT_STOPPED. The resume from that step
    reads only each rank's share of it and reproduces the uninterrupted losses bit for bit.

    Both runs hold at step HOLD (training.holdAtStep, a test aid): the SIGTERM lands while the
    first still trains, however fast the machine; the resume is released through the control
    file and goes on past the hold."""
    uri = fresh_uri(s3)
    store = store_for(s3, uri)
    control = tmp_path / "control"
    control.mkdir()

    def launch(resume: int | None, attempt: int) -> TrainerRun:
        env = trainer_env(data=2, training=training(tmp_path, hold_at_step=HOLD, hold_attempts=2), s3_env=s3.env(),
                          checkpoint_uri=uri, interval=0, resume_step=resume, attempt=attempt)  # fmt: skip
        env[CONTROL_DIR_ENV] = str(control)
        return TrainerRun(env)

    first = launch(None, 0)
    first.wait_for("step", step=1)
    _request_checkpoint(control, "req-1")  # served at a later boundary, or while held
    first.wait_for("held", step=HOLD)
    wait_until(lambda: bool(_of(first, "checkpoint_requested")), timeout=600, what="req-1 served")
    first.proc.send_signal(signal.SIGTERM)  # the kubelet signals the container's first process
    assert first.finish() == EXIT_STOPPED, first.tail()
    served, stopped = _of(first, "checkpoint_requested")[0], _of(first, "stopped")[0]
    committed = next(e for e in _of(first, "checkpoint_committed") if e["step"] == served["step"])
    stop_step = int(stopped["step"])
    assert served["step"] <= stop_step == HOLD and stopped["committed"] is True
    assert committed["request"] == "req-1"
    request_commit, stop_commit = store.read_commit(served["step"]), store.read_commit(stop_step)
    assert request_commit is not None and request_commit.request == "req-1"
    assert stop_commit is not None, "the stop's checkpoint must be COMMITTED before the exit"
    progress = store.read_progress()
    assert progress is not None and progress.checkpoint_request == ServedRequest("req-1", served["step"])
    assert max(first.losses()) == stop_step

    # the annotation still says req-1 (already served), and now releases the hold
    _write_control(control, {CHECKPOINT_REQUEST: "req-1", HOLD_RELEASE: "yes"})
    second = launch(stop_step, 1)
    assert second.finish() == 0, second.tail()
    restored = next(e for e in second.events if e["event"] == "restored")
    assert restored["step"] == stop_step
    assert [e["event"] for e in second.events if e["event"] in ("held", "released")] == ["held", "released"]
    assert len(restored["bytes_read"]) == 2
    assert all(0 < read < 0.75 * restored["step_bytes"] for read in restored["bytes_read"]), restored
    assert not [e for e in second.events if e["event"] == "checkpoint_requested"]
    assert sorted(second.losses()) == list(range(stop_step + 1, STEPS + 1))
    for run in (first, second):
        for step, loss in run.losses().items():
            assert loss == baseline.losses[step], f"step {step} differs after the stop"


def test_a_planned_stop_trains_no_step_after_its_checkpoint(s3: S3Server, tmp_path: Path) -> None:
    """The operator asks a planned stop's checkpoint (`planned_stop_request`, before a roll, a
    resize or a drain) and stops the gang once it is committed. The gang saves the step it
    reached and trains no further step (issue 37 item 6: an old gang that trained on committed
    old-spec steps on its SIGTERM, and a restart resumed from them); periodic saves every 2
    steps would commit such steps too. Cleared (the change was called off), it trains on; the
    SIGTERM after a second planned stop commits nothing newer than that request's step.

    A hold late in the run (training.holdAtStep, a test aid) keeps it from ending first."""
    uri = fresh_uri(s3)
    store = store_for(s3, uri)
    control = tmp_path / "control"
    control.mkdir()
    env = trainer_env(data=2, training=training(tmp_path, steps=40, hold_at_step=30), s3_env=s3.env(),
                      checkpoint_uri=uri, interval=2, attempt=3)  # fmt: skip
    env[CONTROL_DIR_ENV] = str(control)
    run = TrainerRun(env)
    run.wait_for("step", step=1)
    first = planned_stop_request("rollout", 3, "2026-01-01T00:00:10.000Z")
    _request_checkpoint(control, first)
    paused = run.wait_for("paused")
    served = int(_of(run, "checkpoint_requested")[0]["step"])
    assert int(paused["step"]) == served
    wait_until(lambda: (c := store.latest_committed()) is not None and c.step >= served,
               timeout=120, what=f"step {served} committed")  # fmt: skip
    time.sleep(3)  # the gang would train several steps in this time
    assert max(run.losses()) == served, "a step was trained after the planned stop's checkpoint"
    commit = store.latest_committed()
    assert commit is not None and (commit.step, commit.request, commit.attempt) == (served, first, 3)

    _write_control(control, {CHECKPOINT_REQUEST: ""})  # the operator cleared it: called off
    assert int(run.wait_for("resumed")["step"]) == served
    run.wait_for("step", step=served + 1)
    second = planned_stop_request("resize", 3, "2026-01-01T00:00:20.000Z")
    _request_checkpoint(control, second)
    again = int(run.wait_for("paused")["step"])
    assert again > served
    run.proc.send_signal(signal.SIGTERM)  # the stop that follows a planned stop's checkpoint
    assert run.finish() == EXIT_STOPPED, run.tail()
    stopped = _of(run, "stopped")[0]
    assert int(stopped["step"]) == again and stopped["committed"] is True
    assert max(run.losses()) == again
    assert max(store.step_dirs()) == again, "nothing newer than the served step may be committed"
    newest = store.latest_committed()
    assert newest is not None and (newest.step, newest.request) == (again, second)


def test_warm_spares_run_the_next_attempt_in_place_from_its_checkpoint(
    s3: S3Server, baseline: Baseline, tmp_path: Path
) -> None:
    """`warmSpares`: the pod's supervisor keeps one interpreter per local rank with torch and the
    trainer imported. When the operator bumps the attempt (the control file, as the kubelet
    writes it), those processes become the new attempt's ranks: they restore the committed step
    and reproduce the uninterrupted losses exactly."""
    uri = fresh_uri(s3)
    control = tmp_path / "control"
    control.mkdir()
    env = trainer_env(data=2, training=training(tmp_path, warm_spares=True), s3_env=s3.env(),
                      checkpoint_uri=uri, interval=INTERVAL)  # fmt: skip
    env[CONTROL_DIR_ENV] = str(control)
    env[SPARE_DELAY_ENV] = "0"
    run = TrainerRun(env)
    assert run.wait_for("spares_started")["spares"] == 2
    # the spares name themselves, so a fault injector signalling "the ranks" leaves them be (and
    # the pod's forker, the ranks' parent, too)
    wait_until(lambda: len(descendants(run.proc.pid)) == 5 and len(faults.trainer_processes(run.proc.pid)) == 2,
               timeout=120, what="the forker, two ranks and two waiting spares")  # fmt: skip
    run.wait_for("checkpoint_committed", step=INTERVAL)
    staged = control / ".annotations.new"
    staged.write_text(format_control({ATTEMPT_ANNOTATION: "1", RESUME_STEP_ANNOTATION: str(INTERVAL)}))
    staged.replace(control / "annotations")
    started = run.wait_for("workers_started")
    assert (started["attempt"], started["warm"]) == (1, 2), run.tail()
    assert run.finish() == 0, run.tail()
    restored = [e for e in run.events if e["event"] == "restored"]
    assert [e["step"] for e in restored] == [INTERVAL], run.tail()
    assert sorted(run.losses()) == list(range(1, STEPS + 1))
    for step, loss in run.losses().items():
        assert loss == baseline.losses[step], f"step {step} differs after the warm restart"
