"""Defects the chaos soak (testbed/chaos, docs/reliability.md) found in the
reconciler, each pinned pass by pass without a cluster."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from test_reconcile import T0, gang, run, running_job, spec
from topotrain.api.status import Reason
from topotrain.core.reconcile_status import CheckpointView

CKPT = CheckpointView(step=200, uri="s3://ckpt/runs/ns/job/step-0000000200")


def test_a_running_gang_that_vanished_whole_is_a_failure_not_a_silent_relaunch() -> None:
    """Seen in the soak: a one-pod job's pod deleted (or a lost node's pods garbage-collected)
    is gone before any pass sees it terminating. The operator used to relaunch the same
    attempt as if it had never started: no failure recorded, no budget used, and
    TOPOTRAIN_ATTEMPT reused, so the vanished run's heartbeat passed for the new run's."""
    obs = running_job(spec=spec(maxInfrastructureRestarts=5))
    assert obs.status.phase == "Running" and obs.status.attempt == 0
    d, _ = run(obs, pods=(), now=T0 + timedelta(seconds=5))
    assert d.launch is not None and d.launch.attempt == 1 and d.launch.resume_step == 200
    assert d.status.attempt == 1 and d.status.restarts == 1
    assert d.status.last_failure is not None and d.status.last_failure.reason == Reason.POD_DELETED
    assert d.status.restarts_by_class is not None and d.status.restarts_by_class.infrastructure == 1


def test_a_vanished_gang_spends_the_infrastructure_budget() -> None:
    obs = running_job(spec=spec(maxInfrastructureRestarts=0))
    d, _ = run(obs, pods=(), now=T0 + timedelta(seconds=5))
    assert d.launch is None and d.status.phase == "Failed"
    assert d.status.reason == Reason.MAX_INFRA_RESTARTS


def test_a_restart_long_after_the_first_start_gets_its_own_startup_window() -> None:
    """Seen in the soak: when a pass never saw the new attempt's pods Pending (on KWOK they
    run at once), the Ready condition stayed True from the first attempt, so the startup
    window of every attempt after `startupTimeoutSeconds` was already spent: each new gang
    was restarted as a hang within a second of starting, until the budget ran out."""
    obs = running_job(spec=spec(progressTimeoutSeconds=20, startupTimeoutSeconds=60))
    beat = replace(CKPT, progress_step=250, progress_time=T0, progress_attempt=0)
    _, obs = run(obs, pods=gang(0), now=T0 + timedelta(seconds=10), checkpoint=beat)
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=1)
    d, obs = run(obs, pods=tuple(pods), now=T0 + timedelta(seconds=100), checkpoint=beat)
    assert d.launch is not None and d.launch.attempt == 1
    # The next pass already sees attempt 1 Running; its trainer has not reported yet.
    for seconds in (101, 130, 159):
        d, obs = run(obs, pods=(pods[1], *gang(1)), now=T0 + timedelta(seconds=seconds), checkpoint=beat)
        assert d.launch is None and d.status.attempt == 1, f"restarted as a hang at +{seconds}s"
    d, _ = run(obs, pods=(pods[1], *gang(1)), now=T0 + timedelta(seconds=175), checkpoint=beat)
    assert d.status.last_failure is not None and d.status.last_failure.reason == Reason.PROGRESS_STALLED
