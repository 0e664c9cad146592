"""The reconciler under ordinary faults (issue: failure handling), pass by pass, no cluster.

Each test is a defect a user met: a healthy job restarted by an S3 blip, a
node whose pods keep crashing, a crashed pod whose logs vanished, pods that
never start, a spec edit that never reached the pods. `FakePlanner` (from
test_reconcile) stands in for the placement engine at the unit-test boundary.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from test_reconcile import T0, FakePlanner, gang, observed, run, running_job, spec
from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason
from topotrain.core.policy import NodeView, PodView
from topotrain.core.rank_table import RankTable
from topotrain.core.reconcile_status import STORE_ERROR_GRACE_SECONDS, CheckpointView

CKPT = CheckpointView(step=200, uri="s3://ckpt/runs/ns/job/step-0000000200")
DOWN = CheckpointView(reachable=False, error="Could not connect to the endpoint URL")


def beat(step: int, attempt: int = 0, trainer_time: Any = T0) -> CheckpointView:
    return replace(CKPT, progress_step=step, progress_time=trainer_time, progress_attempt=attempt)


def at(seconds: float) -> Any:
    return T0 + timedelta(seconds=seconds)


# --- 1. an unreachable checkpoint store is never a hang ------------------------------------


def test_store_outage_longer_than_every_timeout_never_restarts_a_running_gang() -> None:
    obs = running_job(spec=spec(progressTimeoutSeconds=60, startupTimeoutSeconds=120))
    _, obs = run(obs, pods=gang(0), now=at(10), checkpoint=beat(250))
    # The first failing reads are errors of a store that answered: reported unreachable only
    # once they have lasted STORE_ERROR_GRACE_SECONDS (test below).
    d, obs = run(obs, pods=gang(0), now=at(90), checkpoint=DOWN)
    assert d.status.condition(C.STORE_REACHABLE).reason == Reason.STORE_ERRORS  # type: ignore[union-attr]
    for t in (90 + STORE_ERROR_GRACE_SECONDS, 500, 5000):
        d, obs = run(obs, pods=gang(0), now=at(t), checkpoint=DOWN)
        assert d.launch is None and not d.delete and d.status.phase == "Running"
        cond = d.status.condition(C.STORE_REACHABLE)
        assert cond is not None and cond.status == "False"
        assert cond.reason == Reason.STORE_UNAVAILABLE and "Could not connect" in cond.message
        assert d.status.reason == Reason.STORE_UNAVAILABLE  # kubectl get tj says why
    # The store answers again with the step it held before the outage: the trainer could not
    # write progress meanwhile, so the hang clock starts afresh from the moment it answers.
    d, obs = run(obs, pods=gang(0), now=at(5001), checkpoint=beat(250))
    assert d.launch is None and d.status.condition(C.STORE_REACHABLE).status == "True"  # type: ignore[union-attr]
    d, obs = run(obs, pods=gang(0), now=at(5050), checkpoint=beat(250))
    assert d.launch is None
    # ... and hang detection resumes: the same step 61 s after the store came back is a hang.
    d, _ = run(obs, pods=gang(0), now=at(5062), checkpoint=beat(250))
    assert d.status.last_failure is not None
    assert d.status.last_failure.reason == Reason.PROGRESS_STALLED and d.launch is not None


def test_a_store_failing_a_share_of_its_reads_neither_flaps_the_condition_nor_pauses_hangs() -> None:
    """30% of reads failing for four minutes (found by reading the code: the condition flipped
    about 20 times, each flip a Warning Event and a pause of hang detection); a store down for
    longer than the grace is then reported at once, with one Event."""
    obs = running_job(spec=spec(progressTimeoutSeconds=60))
    warnings = 0
    step = 250
    for i, t in enumerate(range(10, 250, 4)):  # a pass every 4 s, every third read fails
        failing = i % 3 == 2
        step += 0 if failing else 1
        d, obs = run(obs, pods=gang(0), now=at(t), checkpoint=DOWN if failing else beat(step))
        cond = d.status.condition(C.STORE_REACHABLE)
        assert cond is not None and cond.status == "True", (t, cond)
        warnings += sum(1 for kind, reason, _ in d.events if reason == Reason.STORE_UNAVAILABLE)
        assert d.launch is None and not d.delete
    assert warnings == 0
    # A trainer that stops stepping while the store flaps is still found hung.
    for t in range(250, 330, 4):
        d, obs = run(obs, pods=gang(0), now=at(t), checkpoint=DOWN if t % 12 == 0 else beat(step))
        if d.status.last_failure is not None:
            break
    assert d.status.last_failure is not None and d.status.last_failure.reason == Reason.PROGRESS_STALLED
    # An outage: unreachable once it lasted the grace, and said once.
    obs = running_job()
    _, obs = run(obs, pods=gang(0), now=at(10), checkpoint=beat(250))
    events = []
    for t in range(12, 60, 2):
        d, obs = run(obs, pods=gang(0), now=at(t), checkpoint=DOWN)
        events += [reason for _, reason, _ in d.events if reason == Reason.STORE_UNAVAILABLE]
        expected = "False" if t - 12 >= STORE_ERROR_GRACE_SECONDS else "True"
        assert d.status.condition(C.STORE_REACHABLE).status == expected, t  # type: ignore[union-attr]
    assert events == [Reason.STORE_UNAVAILABLE]


def test_hang_clock_is_the_operators_not_the_trainers() -> None:
    """A trainer clock an hour behind with steps moving is no hang; a clock in the future with
    the step stuck is one."""
    obs = running_job(spec=spec(progressTimeoutSeconds=60))
    behind = T0 - timedelta(hours=1)
    for i, t in enumerate((10, 60, 110, 160)):
        d, obs = run(obs, pods=gang(0), now=at(t), checkpoint=beat(250 + i, trainer_time=behind))
        assert d.launch is None, f"pass at {t}s restarted a training job"
    ahead = T0 + timedelta(hours=1)
    _, obs = run(obs, pods=gang(0), now=at(200), checkpoint=beat(300, trainer_time=ahead))
    d, _ = run(obs, pods=gang(0), now=at(261), checkpoint=beat(300, trainer_time=ahead))
    assert d.status.last_failure is not None and d.status.last_failure.reason == Reason.PROGRESS_STALLED


# --- 4. failure classes with budgets of their own, bad nodes avoided -----------------------


def test_infrastructure_failures_do_not_use_the_application_budget() -> None:
    obs = running_job(spec=spec(maxRestarts=0, maxInfrastructureRestarts=5))
    lost = {k: v for k, v in obs.nodes.items() if k != "n1"}
    d, _ = run(obs, pods=gang(0), nodes=lost, now=at(5))
    assert d.status.phase == "Recovering" and d.launch is not None
    assert d.status.restarts_by_class is not None
    assert (d.status.restarts_by_class.application, d.status.restarts_by_class.infrastructure) == (0, 1)
    # An application failure with maxRestarts 0 fails the job, naming the budget.
    obs = running_job(spec=spec(maxRestarts=0, maxInfrastructureRestarts=5))
    pods = list(gang(0))
    pods[2] = replace(pods[2], phase="Failed", exit_code=1)
    d, _ = run(obs, pods=tuple(pods), now=at(5))
    assert d.status.phase == "Failed"
    failed = d.status.condition(C.FAILED)
    assert failed is not None and failed.reason == Reason.MAX_RESTARTS
    assert "spec.failurePolicy.maxRestarts (0)" in failed.message


def test_exhausted_infrastructure_budget_names_it() -> None:
    obs = running_job(spec=spec(maxInfrastructureRestarts=0))
    lost = {k: v for k, v in obs.nodes.items() if k != "n1"}
    d, _ = run(obs, pods=gang(0), nodes=lost, now=at(5))
    assert d.status.phase == "Failed" and d.status.reason == Reason.MAX_INFRA_RESTARTS
    assert "maxInfrastructureRestarts (0)" in (d.status.message or "")


def _crash_on(obs: Any, attempt: int, index: int, now: float) -> Any:
    pods = list(gang(attempt, nodes=_placement(obs)))
    pods[index] = replace(pods[index], phase="Failed", exit_code=1)
    d, after = run(obs, pods=tuple(pods), now=at(now))
    return d, after


def _placement(obs: Any) -> dict[int, str]:
    table = obs.rank_table
    return dict(table.assignments) if table is not None else {i: f"n{i}" for i in range(4)}


def test_a_node_that_keeps_crashing_the_job_is_avoided_by_its_replans() -> None:
    planner = FakePlanner()
    obs = running_job(spec=spec(nodeFailureThreshold=2), planner=planner)
    d, obs = _crash_on(obs, 0, 1, 5)  # pod 1 on n1 crashes: n1 counted once, not yet avoided
    assert [(r.node, r.failures, r.avoided) for r in d.status.node_failures] == [("n1", 1, False)]
    assert d.launch is not None and d.launch.assignments[1] == "n1"
    obs = replace(obs, rank_table=RankTable(1, 2, dict(d.launch.assignments)))
    _, obs = run(obs, pods=gang(1), now=at(6))
    d, obs = _crash_on(obs, 1, 1, 10)  # n1 again: now avoided
    assert [(r.node, r.failures, r.avoided) for r in d.status.node_failures] == [("n1", 2, True)]
    assert d.launch is not None and d.launch.assignments[1] != "n1"
    assert "replan lost=['n1']" in planner.calls
    assert any(reason == Reason.NODE_AVOIDED for _, reason, _ in d.events)


def test_the_failure_that_gets_a_node_avoided_is_charged_to_the_node_not_the_application() -> None:
    """A node whose pods always crash, maxRestarts 1, a spare node free: the second crash on it
    gets it avoided; that crash is the node's, so the job moves off it on the infrastructure
    budget instead of failing MaxRestartsExceeded in the same pass (found by reading the code:
    both restarts were charged to application)."""
    planner = FakePlanner()
    obs = running_job(spec=spec(nodeFailureThreshold=2, maxRestarts=1), planner=planner)
    d, obs = _crash_on(obs, 0, 1, 5)  # the first crash on n1: the application's, 1 of 1
    assert d.status.restarts_by_class is not None and d.status.restarts_by_class.application == 1
    assert d.launch is not None and d.launch.assignments[1] == "n1"
    obs = replace(obs, rank_table=RankTable(1, 2, dict(d.launch.assignments)))
    _, obs = run(obs, pods=gang(1), now=at(6))
    d, obs = _crash_on(obs, 1, 1, 10)  # n1 again: avoided, and this failure is n1's
    assert d.status.phase != "Failed", d.status.message
    assert d.launch is not None and d.launch.assignments[1] != "n1"
    used = d.status.restarts_by_class
    assert used is not None and (used.application, used.infrastructure) == (1, 1)
    assert d.status.last_failure is not None and "charged to the infrastructure budget" in d.status.last_failure.message
    # a third crash elsewhere is the application's again, and its budget is spent
    obs = replace(obs, rank_table=RankTable(2, 2, dict(d.launch.assignments)))
    _, obs = run(obs, pods=gang(2, nodes=dict(d.launch.assignments)), now=at(11))
    d, _ = _crash_on(obs, 2, 0, 15)
    assert d.status.phase == "Failed" and d.status.reason == Reason.MAX_RESTARTS


def test_avoided_nodes_are_used_again_when_nothing_else_fits() -> None:
    # A small pool whose every node reached the threshold (seen in the chaos soak: both jobs
    # stranded InsufficientCapacity forever). Avoiding must never strand the job.
    avoiding = FakePlanner(capacity=0, spare=[])  # with the avoided nodes left out: no room
    everything = FakePlanner(spare=[])  # the same cluster with them back in
    obs = running_job(spec=spec(nodeFailureThreshold=1), planner=avoiding)
    obs = replace(obs, unavoiding_planner=everything)
    d, obs = _crash_on(obs, 0, 1, 5)  # n1 fails the job once: avoided at threshold 1
    assert d.launch is not None, "the job was stranded by its avoided node"
    assert d.launch.assignments[1] == "n1" and everything.calls
    row = next(r for r in d.status.node_failures if r.node == "n1")
    assert (row.avoided, row.failures) == (False, 0)
    forgiven = [m for _, reason, m in d.events if reason == Reason.NODES_FORGIVEN]
    assert forgiven and "using n1 again" in forgiven[0]


def test_a_trainer_bug_failing_every_node_blames_no_node() -> None:
    obs = running_job()
    pods = tuple(replace(p, phase="Failed", exit_code=1) for p in gang(0))
    d, _ = run(obs, pods=pods, now=at(5))
    assert d.status.node_failures == []


# --- 5. the crashed pod's logs survive ------------------------------------------------------


def test_crashed_pod_is_kept_until_the_next_attempt_runs_and_its_message_is_in_status() -> None:
    obs = running_job()
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=3, reason="Error",
                      message="Traceback (most recent call last):\nRuntimeError: CUDA error: Xid 79")
    d, obs = run(obs, pods=tuple(pods), now=at(5))
    assert "job-0-1" not in d.delete
    assert d.status.last_failure is not None and "Xid 79" in d.status.last_failure.message
    crashed = pods[1]
    starting = (crashed, *gang(1, phase="Pending"))
    d, obs = run(obs, pods=starting, now=at(6))
    assert "job-0-1" not in d.delete  # the new attempt is not Running yet
    d, _ = run(obs, pods=(crashed, *gang(1)), now=at(8))
    assert d.status.phase == "Running" and "job-0-1" in d.delete


def test_a_failed_job_keeps_its_crashed_pods() -> None:
    obs = running_job(spec=spec(maxRestarts=0))
    pods = list(gang(0))
    pods[0] = replace(pods[0], phase="Failed", exit_code=1)
    d, obs = run(obs, pods=tuple(pods), now=at(5))
    assert d.status.phase == "Failed"
    d, _ = run(obs, pods=tuple(pods), now=at(6))
    assert "job-0-0" not in d.delete and "job-0-1" in d.delete


# --- 3. pods that never start, pods the API server refuses ---------------------------------


def test_pending_pods_say_why_and_restart_away_from_their_node_after_the_timeout() -> None:
    obs = running_job(spec=spec(schedulingTimeoutSeconds=300))
    pods = list(gang(0))
    pods[3] = replace(pods[3], phase="Pending", waiting="ImagePullBackOff",
                      waiting_message='Back-off pulling image "trainer:1"')
    d, obs = run(obs, pods=tuple(pods), now=at(100))
    ready = d.status.condition(C.READY)
    assert ready is not None and ready.status == "False"
    assert "3/4 pods Running" in ready.message and "ImagePullBackOff" in ready.message
    assert 'Back-off pulling image "trainer:1"' in (d.status.message or "")
    d, _ = run(obs, pods=tuple(pods), now=at(301))
    assert d.status.last_failure is not None
    assert d.status.last_failure.reason == Reason.PODS_NOT_STARTING
    assert "schedulingTimeoutSeconds" in d.status.last_failure.message
    assert [r.node for r in d.status.node_failures] == ["n3"]
    assert d.status.restarts_by_class is not None and d.status.restarts_by_class.infrastructure == 1


def _refused(obs: Any, now: float) -> Any:
    """What the edge writes when the API server refused the gang's pods."""
    from topotrain.core.reconcile_status import StatusBuilder

    sb = StatusBuilder(obs.status, obs.generation, at(now))
    sb.pods_refused(Reason.QUOTA_EXCEEDED, 'pods "job-0-3" is forbidden: exceeded quota: gpus')
    sb.summarize()
    return replace(obs, status=sb.status, last_refusal=at(now))


def test_refused_gang_retries_with_a_pause_and_fails_after_the_timeout() -> None:
    d, obs = run(observed(spec=spec(schedulingTimeoutSeconds=120)))
    assert d.launch is not None
    obs = _refused(obs, 0)
    assert obs.status.reason == Reason.QUOTA_EXCEEDED and "exceeded quota" in (obs.status.message or "")
    d, _ = run(obs, now=at(3))
    assert d.launch is None and d.requeue_after is not None and 0 < d.requeue_after <= 10
    d, _ = run(obs, now=at(11))
    assert d.launch is not None  # quota may have been freed: try again
    d, _ = run(obs, now=at(121))
    assert d.status.phase == "Failed" and d.status.reason == Reason.QUOTA_EXCEEDED
    assert "schedulingTimeoutSeconds 120" in (d.status.message or "")


def test_created_gang_clears_the_refusal() -> None:
    _, obs = run(observed())
    obs = _refused(obs, 0)
    d, _ = run(obs, pods=gang(0), now=at(12))
    created = d.status.condition(C.PODS_CREATED)
    assert created is not None and created.status == "True"


# --- 7. spec edits reach the pods -----------------------------------------------------------


def _templated(pods: tuple[PodView, ...], template: str) -> tuple[PodView, ...]:
    return tuple(replace(p, template=template) for p in pods)


def test_a_pod_template_change_checkpoints_first_then_rolls_the_gang_from_that_step() -> None:
    obs = replace(running_job(), template="old", generation=1)
    d, obs = run(obs, pods=_templated(gang(0), "old"))
    assert d.launch is None and d.status.observed_generation == 1
    edited = replace(obs, template="new", generation=2)
    # 1. The running gang is asked for a checkpoint and keeps training: nothing deleted yet.
    d, asked = run(edited, pods=_templated(gang(0), "old"), now=at(30))
    assert not d.delete and d.launch is None and d.checkpoint_request is not None
    value = d.checkpoint_request.value
    assert value.startswith("rollout-0-") and len(d.checkpoint_request.pods) == 4
    # 2. Its save of step 237 committed: the gang rolls onto the new template from there.
    saved = replace(CKPT, step=237, request=value, request_step=237)
    pods = tuple(replace(p, checkpoint_request=value) for p in _templated(gang(0), "old"))
    d, _ = run(asked, pods=pods, now=at(33), checkpoint=saved)
    assert sorted(d.delete) == [f"job-0-{i}" for i in range(4)]
    assert d.launch is not None and d.launch.attempt == 1 and d.launch.resume_step == 237
    recovering = d.status.condition(C.RECOVERING)
    assert recovering is not None and recovering.reason == Reason.SPEC_CHANGED
    assert "from step 237" in recovering.message
    assert d.status.restarts == 0  # a roll is not a failure
    assert d.status.observed_generation == 2  # the new pods are built from generation 2


def test_a_pod_template_change_rolls_from_the_latest_checkpoint_once_the_request_times_out() -> None:
    obs = replace(running_job(), template="old", generation=1)
    _, obs = run(obs, pods=_templated(gang(0), "old"))
    edited = replace(obs, template="new", generation=2)
    _, asked = run(edited, pods=_templated(gang(0), "old"), now=at(30))
    d, _ = run(asked, pods=_templated(gang(0), "old"), now=at(30 + 121))  # a trainer that never serves
    assert sorted(d.delete) == [f"job-0-{i}" for i in range(4)]
    assert d.launch is not None and d.launch.resume_step == 200
    assert Reason.CHECKPOINT_TIMED_OUT in [e[1] for e in d.events]


def test_observed_generation_waits_while_old_pods_keep_running() -> None:
    """A spec that cannot run yet (a config problem) keeps the old gang: not observed."""
    obs = replace(running_job(), template="old", generation=1)
    _, obs = run(obs, pods=_templated(gang(0), "old"))
    stuck = replace(obs, template="new", generation=2,
                    config_problem=(Reason.SECRET_NOT_FOUND, "Secret ns/x does not exist"))
    d, _ = run(stuck, pods=_templated(gang(0), "old"), now=at(30))
    assert d.launch is None and not d.delete and d.status.observed_generation == 1


# --- 8. a gang finished after an operator crash resumes from one step ----------------------


def test_half_created_first_attempt_takes_the_resume_step_of_its_pods() -> None:
    _, obs = run(observed())
    table = RankTable(0, 2, {i: f"n{i}" for i in range(4)})
    pods = tuple(replace(p, resume_step="200") for p in gang(0, phase="Pending", gated=True)[:2])
    d, _ = run(obs, pods=pods, rank_table=table, checkpoint=CKPT)
    assert d.launch is not None and d.launch.only == (2, 3) and d.launch.resume_step == 200
    # A newer commit since: the gated half is started over from it (all pods agree either way).
    d, _ = run(obs, pods=pods, rank_table=table, checkpoint=replace(CKPT, step=400))
    assert d.launch is None and sorted(d.delete) == ["job-0-0", "job-0-1"]


# --- time to first step: the recovery measure ------------------------------------------------


def test_time_to_first_step_is_measured_from_the_fault_to_the_new_attempts_first_step() -> None:
    from topotrain.checkpoints import AttemptStart

    obs = running_job()
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=1)
    _, obs = run(obs, pods=tuple(pods), now=at(5))  # fault detected at 5 s
    d, obs = run(obs, pods=gang(1), now=at(7))  # pods Running 2 s later
    assert d.status.recovery is not None and d.status.recovery.last_seconds == 2.0
    assert d.status.recovery.time_to_first_step_seconds is None and d.first_step is None
    start = AttemptStart(process=at(8), first_step=201, first_step_time=at(40), load_seconds=3.0)
    ckpt = replace(beat(201, attempt=1), progress_start=start)
    d, obs = run(obs, pods=gang(1), now=at(45), checkpoint=ckpt)  # seen at the next S3 poll
    rec = d.status.recovery
    assert rec is not None and rec.time_to_first_step_seconds == 35.0  # 40 - 5, the trainer's time
    assert rec.phases is not None
    assert (rec.phases.pods_running, rec.phases.process_start, rec.phases.checkpoint_load,
            rec.phases.startup_and_first_step) == (2.0, 1.0, 3.0, 29.0)
    assert d.first_step == (35.0, "application")
    again, _ = run(obs, pods=gang(1), now=at(50), checkpoint=ckpt)
    assert again.first_step is None  # once per recovery


def test_pods_running_phase_equals_the_recovery_time_at_sub_millisecond_clocks() -> None:
    """Both are shown to users (`status.recovery.lastSeconds`, `.phases.podsRunning`): the same
    interval must read the same, whatever the microseconds of the operator's clock."""
    from topotrain.checkpoints import AttemptStart

    obs = running_job()
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=1)
    _, obs = run(obs, pods=tuple(pods), now=at(5.0004))
    d, obs = run(obs, pods=gang(1), now=at(5.5059))
    assert d.status.recovery is not None
    last = d.status.recovery.last_seconds
    start = AttemptStart(process=at(6), first_step=201, first_step_time=at(9), load_seconds=1.0)
    d, _ = run(obs, pods=gang(1), now=at(10), checkpoint=replace(beat(201, attempt=1), progress_start=start))
    rec = d.status.recovery
    assert rec is not None and rec.phases is not None
    assert rec.phases.pods_running == last == 0.505


def test_an_implausible_trainer_clock_falls_back_to_the_operators_observation() -> None:
    from topotrain.checkpoints import AttemptStart

    obs = running_job()
    lost = {k: v for k, v in obs.nodes.items() if k != "n1"}
    _, obs = run(obs, pods=gang(0), nodes=lost, now=at(5))
    moved = gang(1, nodes={0: "n0", 1: "spare0", 2: "n2", 3: "n3"})
    _, obs = run(obs, pods=moved, nodes=lost, now=at(7))
    skewed = AttemptStart(process=at(-3600), first_step=201, first_step_time=at(-3500))
    d, _ = run(obs, pods=moved, nodes=lost, now=at(30),
               checkpoint=replace(beat(201, attempt=1), progress_start=skewed))
    assert d.status.recovery is not None and d.status.recovery.time_to_first_step_seconds == 25.0
    assert d.first_step == (25.0, "infrastructure")


def test_a_spec_with_no_allowed_degree_is_a_configuration_problem() -> None:
    """A spec stored before the allowed-degree rule (CEL now refuses it): no trainer is started
    to exit 78; ConfigValid says which field to fix."""
    from topotrain.core.planning import PlanOutcome
    from topotrain.degrees import REASON

    class NoDegree(FakePlanner):
        def plan(self, low: int, high: int) -> PlanOutcome:
            return PlanOutcome(False, reason=REASON, message="spec.parallelism.data=3 is not an "
                               "allowed data degree: training.globalBatch=64 ...")

    d, _ = run(observed(planner=NoDegree()))
    assert d.launch is None
    cond = d.status.condition(C.CONFIG_VALID)
    assert cond is not None and cond.status == "False" and cond.reason == REASON
    assert "spec.parallelism.data=3" in cond.message and d.status.reason == REASON


def test_a_namesakes_pod_in_the_way_is_waited_for_never_failed() -> None:
    from topotrain.core.reconcile_status import StatusBuilder

    _, obs = run(observed(spec=spec(schedulingTimeoutSeconds=60)))
    sb = StatusBuilder(obs.status, obs.generation, at(0))
    sb.pods_refused(Reason.FOREIGN_OBJECT, "409: pod job-0-1 exists and is not owned by this TrainingJob")
    obs = replace(obs, status=sb.status, last_refusal=at(0))
    d, _ = run(obs, now=at(5))
    assert d.launch is None and d.requeue_after is not None  # no hot loop of creates
    d, _ = run(obs, now=at(3600))
    assert d.status.phase != "Failed" and d.launch is not None


def test_pods_accepted_after_a_refusal_end_the_refusal_at_once() -> None:
    # The long chaos soak: quota lifted, the retry's pods created and deleted at once by a fault
    # before a pass saw them; the stale refusal then failed the job on schedulingTimeoutSeconds
    # measured from the first refusal, minutes before.
    from topotrain.core.reconcile_status import StatusBuilder

    obs = running_job()
    sb = StatusBuilder(obs.status, 1, at(0))
    sb.pods_refused(Reason.QUOTA_EXCEEDED, "403: exceeded quota")
    stale = replace(obs, status=sb.status.model_copy(deep=True))
    d, _ = run(stale, pods=(), now=at(5000))
    assert d.status.phase == "Failed" and d.status.reason == Reason.QUOTA_EXCEEDED  # without it
    edge = StatusBuilder(sb.status, 1, at(1))
    assert edge.pods_accepted(1, 4) is True
    cond = edge.status.condition(C.PODS_CREATED)
    assert cond is not None and cond.status == "True"
    d, _ = run(replace(obs, status=edge.status), pods=(), now=at(5000))
    assert d.status.phase != "Failed"
    assert StatusBuilder(edge.status, 1, at(5001)).pods_accepted(1, 4) is False  # nothing to clear


# --- a drain's SIGTERM saves are waited for -------------------------------------------------


def _evicted(pods: tuple[PodView, ...], grace: float = 30.0) -> tuple[PodView, ...]:
    """Every pod of the gang deleted gracefully (kubectl drain): Terminating, still Running."""
    return tuple(replace(p, terminating=True, grace_seconds=grace) for p in pods)


@pytest.mark.parametrize("in_place", [False, True], ids=["recreate", "in-place"])
def test_a_gracefully_deleted_gang_is_restarted_from_its_sigterm_save(in_place: bool) -> None:
    """The restart waits while the deleted pods may still be saving (within their grace period,
    while their node is Ready), then resumes from the save they committed."""
    obs = running_job(spec=spec(restartInPlace=in_place))
    pods = gang(0)
    evicting = _evicted(pods) if not in_place else (_evicted(pods[:1])[0], *pods[1:])
    d, obs = run(obs, pods=evicting, now=at(5))
    assert d.launch is None and not d.delete and d.relabel is None and d.status.restarts == 0
    assert d.requeue_after is not None and 0 < d.requeue_after <= 2.0
    ready = d.status.condition(C.READY)
    assert ready is not None and "waiting for the stopping pods' SIGTERM checkpoint" in ready.message
    assert "(up to 30s more)" in ready.message
    d, obs = run(obs, pods=evicting, now=at(15))  # still saving: still waiting, 20 s left
    assert d.launch is None and d.relabel is None and "(up to 20s more)" in d.status.condition(C.READY).message  # type: ignore[union-attr]
    # The trainers saved step 203, exited, and the pods are gone: now the gang restarts from it.
    saved = replace(CKPT, step=203, uri="s3://ckpt/runs/ns/job/step-0000000203")
    rest = () if not in_place else pods[1:]
    table = RankTable(0, 2, {i: f"n{i}" for i in range(4)})  # where the vanished pod ran
    d, _ = run(obs, pods=rest, now=at(19), checkpoint=saved, rank_table=table)
    assert d.status.restarts == 1 and d.status.last_failure is not None
    assert d.status.last_failure.reason == Reason.POD_DELETED
    if in_place:
        assert d.relabel is not None and d.relabel.resume_step == 203
    else:
        assert d.launch is not None and d.launch.resume_step == 203


def test_stopping_pods_are_waited_for_at_most_their_grace_period_and_never_on_a_lost_node() -> None:
    obs = running_job()
    d, waiting = run(obs, pods=_evicted(gang(0), grace=4), now=at(5))
    assert d.status.restarts == 0
    late, _ = run(waiting, pods=_evicted(gang(0), grace=4), now=at(10))  # past the grace: restart
    assert late.status.restarts == 1 and (late.launch is not None or late.delete)
    nodes = {**obs.nodes, **{f"n{i}": NodeView(f"n{i}", ready=False) for i in range(4)}}
    lost, _ = run(obs, pods=_evicted(gang(0)), nodes=nodes, now=at(5))
    assert lost.status.restarts == 1
