"""In-place restart decisions, pass by pass (the fake planner of test_reconcile.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from topotrain.api.status import Reason
from topotrain.checkpoints import WorkerFailure
from topotrain.core.decision import Decision, Observed
from topotrain.core.policy import NodeView, PodView
from topotrain.core.status_lifecycle import RETARGETED

from tests.unit.test_reconcile import T0, FakePlanner, gang, observed, run, spec


def addr(pod: str) -> str:
    return f"{pod}.job.ns.svc"


def running_inplace(**failure: Any) -> Observed:
    """A Running gang of attempt 0 whose spec restarts in place (the default)."""
    obs = observed(spec=spec(restartInPlace=True, **failure))
    _, obs = run(obs)
    _, obs = run(obs, pods=gang(0, phase="Pending", gated=True))
    _, obs = run(obs, pods=gang(0))
    return obs


def crash(index: int, code: int = 137) -> tuple[PodView, ...]:
    pods = list(gang(0))
    pods[index] = replace(pods[index], phase="Failed", exit_code=code)
    return tuple(pods)


def test_a_crashed_trainer_keeps_the_healthy_pods_and_replaces_only_its_own() -> None:
    obs = running_inplace()
    d, after = run(obs, pods=crash(1), now=T0 + timedelta(seconds=5))
    assert d.delete == [] and d.relabel is not None
    assert sorted(d.relabel.pods) == ["job-0-0", "job-0-2", "job-0-3"]
    assert (d.relabel.attempt, d.relabel.resume_step, d.relabel.master_addr) == (1, 200, addr("job-0-0"))
    assert d.launch is not None and d.launch.in_place and d.launch.only == (1,)
    assert d.launch.attempt == 1 and d.launch.assignments[1] == "n1" and d.launch.resume_step == 200
    assert d.launch.master_addr == addr("job-0-0")
    st = d.status
    assert st.attempt == 1 and st.restarts == 1 and st.restarts_by_class is not None
    assert st.restarts_by_class.application == 1 and st.phase == "Recovering"
    assert st.recovery is not None and st.recovery.mode == "inPlace"
    assert st.recovery.replaced_indices == [1] and st.last_failure is not None
    assert st.last_failure.reason == Reason.POD_FAILED
    assert any(r == Reason.RESTARTED_IN_PLACE for _, r, _ in d.events)

    # The watch has not shown the new labels yet: nothing is deleted or created twice.
    replacement = PodView("job-1-1", 1, 1, phase="Pending", planned_node="n1", gated=True)
    stale = (*crash(1), replacement)
    d2, after = run(after, pods=stale, now=T0 + timedelta(seconds=6))
    assert d2.delete == [] and d2.launch is None and d2.release == ["job-1-1"]
    assert d2.relabel is not None and sorted(d2.relabel.pods) == ["job-0-0", "job-0-2", "job-0-3"]

    # Every pod of attempt 1 Running: recovered; the crashed pod's logs are no longer kept.
    moved = tuple(replace(p, attempt=1) for p in gang(0) if p.index != 1)
    now = (*crash(1)[1:2], *moved, replace(replacement, phase="Running", node="n1", gated=False))
    d3, _ = run(after, pods=now, now=T0 + timedelta(seconds=8))
    assert d3.status.phase == "Running" and d3.recovered_seconds == pytest.approx(3.0)
    assert d3.delete == ["job-0-1"] and d3.relabel is None and d3.launch is None


def test_a_step_committed_before_the_replacement_exists_moves_the_attempt_on_to_it() -> None:
    """CI's chaos soak (invariant 1): the dying gang's rank 0 committed step 210 after the restart
    in place was decided (told 200); the replacement pod was created only later (its create was
    refused, or the backoff ran), still told 200. Now the attempt's pods move on to attempt 2,
    told 210, and no restart is counted."""
    from tests.unit.test_reconcile_faults import CKPT

    obs = running_inplace()
    d, after = run(obs, pods=crash(1), now=T0 + timedelta(seconds=5))
    assert d.launch is not None and d.launch.resume_step == 200
    moved = tuple(replace(p, attempt=1) for p in gang(0) if p.index != 1)
    seen = (crash(1)[1], *moved)  # the move was seen; the replacement pod never appeared
    newer = replace(CKPT, step=210, uri="s3://ckpt/runs/ns/job/step-0000000210")
    d2, after = run(after, pods=seen, now=T0 + timedelta(seconds=30), checkpoint=newer)
    assert d2.relabel is not None and sorted(d2.relabel.pods) == ["job-0-0", "job-0-2", "job-0-3"]
    assert (d2.relabel.attempt, d2.relabel.resume_step) == (2, 210)
    assert d2.launch is not None and (d2.launch.attempt, d2.launch.only, d2.launch.resume_step) == (2, (1,), 210)
    assert d2.status.attempt == 2 and d2.status.restarts == 1 and d2.delete == []
    # The chaos soak tells a retarget from a second restart by this (testbed/chaos/causes.py).
    rec = d2.status.recovery
    assert rec is not None and (rec.resume_reason or "").startswith(RETARGETED)
    assert any(r == Reason.RESTARTED_IN_PLACE and "step 210 was committed" in m for _, r, m in d2.events)
    # Without a newer commit the replacement is simply created again for attempt 1.
    _, again = run(obs, pods=crash(1), now=T0 + timedelta(seconds=5))
    d3, _ = run(again, pods=seen, now=T0 + timedelta(seconds=30))
    assert d3.launch is not None and (d3.launch.attempt, d3.launch.resume_step) == (1, 200)
    assert d3.relabel is None


def test_pod_zero_replaced_gets_the_new_attempts_name_as_rank_zero_address() -> None:
    d, _ = run(running_inplace(), pods=crash(0), now=T0 + timedelta(seconds=5))
    assert d.relabel is not None and d.relabel.master_addr == addr("job-1-0")
    assert d.launch is not None and d.launch.only == (0,)


def test_a_deleted_pod_is_replaced_in_place() -> None:
    pods = list(gang(0))
    pods[2] = replace(pods[2], terminating=True)
    # While it stops (its trainer may be saving a SIGTERM checkpoint), nothing is replaced yet.
    d, obs = run(running_inplace(), pods=tuple(pods), now=T0 + timedelta(seconds=5))
    assert d.launch is None and d.relabel is None and d.status.restarts == 0
    # Stopped (Failed with the trainer's exit 75) but still listed: its index is replaced in place.
    pods[2] = replace(pods[2], phase="Failed", exit_code=75)
    d, _ = run(obs, pods=tuple(pods), now=T0 + timedelta(seconds=8))
    assert d.launch is not None and d.launch.only == (2,) and d.status.last_failure is not None
    assert d.status.last_failure.reason == Reason.POD_DELETED
    assert d.launch.release is True  # a stopped pod holds no GPUs


def test_a_hang_restarts_every_pod_in_place_and_creates_none() -> None:
    obs = running_inplace(progressTimeoutSeconds=60, startupTimeoutSeconds=60)
    late = T0 + timedelta(seconds=200)
    d, _ = run(obs, now=late)
    assert d.status.last_failure is not None
    assert d.status.last_failure.reason == Reason.PROGRESS_STALLED
    assert d.launch is None and d.delete == [] and d.relabel is not None
    assert sorted(d.relabel.pods) == [f"job-0-{i}" for i in range(4)] and d.relabel.attempt == 1


def reported(obs: Observed, attempt: int, node_rank: int = 1, code: int = 137) -> Observed:
    """`obs` with failure.json naming a crash of pod `node_rank` in `attempt`."""
    assert obs.checkpoint is not None
    report = WorkerFailure(attempt, node_rank, code, T0, pod=f"job-0-{node_rank}")
    return replace(obs, checkpoint=replace(obs.checkpoint, worker_failure=report))


def test_a_reported_crash_restarts_every_pod_in_place_at_once() -> None:
    """A supervisor with warm spares reports its rank's crash and keeps its pod Running: the
    gang restarts in place with every pod kept, nothing created, from the last commit."""
    obs = running_inplace()
    d, after = run(reported(obs, 0), now=T0 + timedelta(seconds=5))
    assert d.status.last_failure is not None and d.status.last_failure.reason == Reason.POD_FAILED
    assert "job-0-1's trainer exited with code 137" in d.status.last_failure.message
    assert d.launch is None and d.delete == [] and d.relabel is not None
    assert sorted(d.relabel.pods) == [f"job-0-{i}" for i in range(4)]
    assert (d.relabel.attempt, d.relabel.resume_step) == (1, 200)
    assert d.status.restarts_by_class is not None and d.status.restarts_by_class.application == 1
    assert d.status.node_failures is not None and "n1" in str(d.status.node_failures)
    # The report stays in the store: it names attempt 0, so attempt 1 is not restarted again.
    moved = tuple(replace(p, attempt=1) for p in gang(0))
    d2, _ = run(after, pods=moved, now=T0 + timedelta(seconds=7))
    assert d2.relabel is None and d2.status.attempt == 1 and d2.status.restarts == 1


def test_a_reported_non_retryable_code_fails_the_job() -> None:
    obs = running_inplace(nonRetryableExitCodes=[78, 3])
    d, _ = run(reported(obs, 0, code=3), now=T0 + timedelta(seconds=5))
    assert d.status.phase == "Failed" and d.status.last_failure is not None
    assert d.status.last_failure.reason == Reason.NON_RETRYABLE and sorted(d.delete) == [
        f"job-0-{i}" for i in range(4)]


def _recreates(d: Decision) -> bool:
    return d.relabel is None and bool(d.delete) and (d.launch is None or not d.launch.in_place)


def test_fallbacks_recreate_the_gang() -> None:
    later = T0 + timedelta(seconds=5)
    # restartInPlace: false
    obs = observed(spec=spec(restartInPlace=False))
    _, obs = run(obs)
    _, obs = run(obs, pods=gang(0))
    assert _recreates(run(obs, pods=crash(1), now=later)[0])
    obs = running_inplace()
    # two pods failed
    two = list(crash(1))
    two[2] = replace(two[2], phase="Failed", exit_code=1)
    assert _recreates(run(obs, pods=tuple(two), now=later)[0])
    # a NotReady node with nowhere to move its pod (no spare left to the incremental re-plan)
    nodes = {**obs.nodes, "n1": NodeView("n1", ready=False)}
    assert isinstance(obs.planner, FakePlanner)
    assert _recreates(run(replace(obs, planner=FakePlanner(spare=[])), nodes=nodes, now=later)[0])
    # a lost node holding two pods of the gang
    two_on_n1 = gang(0, nodes={0: "n0", 1: "n1", 2: "n1", 3: "n3"})
    obs_two = running_inplace()
    _, obs_two = run(obs_two, pods=two_on_n1)
    assert _recreates(run(obs_two, pods=two_on_n1, nodes=nodes, now=later)[0])
    # a pod evicted by a drain: its node is cordoned, so no replacement is pinned there
    drained = list(gang(0))
    drained[1] = replace(drained[1], terminating=True, phase="Failed", exit_code=75)  # saved, stopped
    cordoned = {**obs.nodes, "n1": NodeView("n1", cordoned=True)}
    assert _recreates(run(obs, pods=tuple(drained), nodes=cordoned, now=later)[0])
    # a crash while a kept pod's node is cordoned: the gang moves off it once
    kept_cordoned = {**obs.nodes, "n2": NodeView("n2", cordoned=True)}
    assert _recreates(run(obs, pods=crash(1), nodes=kept_cordoned, now=later)[0])
    # an eviction
    evicted = list(gang(0))
    evicted[1] = replace(evicted[1], phase="Failed", reason="Evicted")
    assert _recreates(run(obs, pods=tuple(evicted), now=later)[0])
    # the recreate baseline strategy
    d = run(replace(obs, strategy="recreate"), pods=crash(1), now=later)[0]
    assert d.relabel is None and d.launch is None and d.delete
    # a crash while another pod of the gang is not Running
    pending = list(crash(1))
    pending[3] = replace(pending[3], phase="Pending")
    assert _recreates(run(obs, pods=tuple(pending), now=later)[0])


def test_a_second_failure_before_the_in_place_attempt_trained_recreates() -> None:
    obs = running_inplace()
    _, after = run(obs, pods=crash(1), now=T0 + timedelta(seconds=5))
    moved = [replace(p, attempt=1) for p in gang(0) if p.index != 1]
    moved[0] = replace(moved[0], phase="Failed", exit_code=1)
    pods = (*crash(1)[1:2], *moved, PodView("job-1-1", 1, 1, phase="Running", node="n1"))
    d2, _ = run(after, pods=pods, now=T0 + timedelta(seconds=9))
    assert d2.status.attempt == 2 and d2.relabel is None
    assert d2.status.recovery is not None and d2.status.recovery.mode != "inPlace"
    assert sorted(d2.delete) == ["job-0-2", "job-0-3", "job-1-1"]


def test_backoff_delays_only_the_replacement_pod() -> None:
    obs = running_inplace(backoffSeconds=10)
    d, after = run(obs, pods=crash(1), now=T0 + timedelta(seconds=5))
    assert d.relabel is not None and d.launch is None and d.delete == []
    assert d.requeue_after == pytest.approx(10)
    moved = tuple(replace(p, attempt=1) for p in gang(0) if p.index != 1)
    d2, after = run(after, pods=(*crash(1)[1:2], *moved), now=T0 + timedelta(seconds=9))
    assert d2.launch is None and d2.delete == [] and d2.status.restarts == 1  # no new failure
    d3, _ = run(after, pods=(*crash(1)[1:2], *moved), now=T0 + timedelta(seconds=16))
    assert d3.launch is not None and d3.launch.only == (1,) and d3.launch.in_place


def test_a_lost_node_with_one_pod_keeps_the_rest_and_replaces_it_where_the_replan_says() -> None:
    """A node holding one pod of the gang goes NotReady (or is deleted): the other pods are kept
    and moved to the next attempt; only the lost index gets a new pod, on the node the
    incremental re-plan chose (the fake planner's spare0), and the lost pod is deleted."""
    later = T0 + timedelta(seconds=5)
    for lost in (NodeView("n1", ready=False), None):
        obs = running_inplace()
        nodes = {**obs.nodes, "n1": lost} if lost is not None else {
            k: v for k, v in obs.nodes.items() if k != "n1"}
        d, after = run(obs, nodes=nodes, now=later)
        assert d.delete == ["job-0-1"], "the lost node's pod goes in the same pass"
        assert d.relabel is not None and sorted(d.relabel.pods) == ["job-0-0", "job-0-2", "job-0-3"]
        assert d.launch is not None and d.launch.in_place and d.launch.only == (1,)
        assert d.launch.assignments[1] == "spare0" and d.launch.attempt == 1
        st = d.status
        assert st.recovery is not None and st.recovery.mode == "inPlace"
        assert st.recovery.replaced_indices == [1] and st.last_failure is not None
        assert st.last_failure.reason in (Reason.NODE_NOT_READY, Reason.NODE_LOST)
        assert st.restarts_by_class is not None and st.restarts_by_class.infrastructure == 1
        assert st.placement is not None and st.placement.mode == "incremental"
        # The next pass (labels not yet seen): the lost pod of attempt 0 is deleted, the kept
        # ones are not, and the replacement is not created twice.
        replacement = PodView("job-1-1", 1, 1, phase="Pending", planned_node="spare0", gated=True)
        d2, _ = run(after, pods=(*gang(0), replacement), now=later + timedelta(seconds=1))
        assert d2.delete == ["job-0-1"] and d2.launch is None
        assert d2.relabel is not None and sorted(d2.relabel.pods) == ["job-0-0", "job-0-2", "job-0-3"]


def test_a_lost_index_zero_gets_a_new_master_address() -> None:
    """Pod 0's node is lost: the kept pods rendezvous at the replacement pod 0's address."""
    obs = running_inplace()
    nodes = {**obs.nodes, "n0": NodeView("n0", ready=False)}
    d, _ = run(obs, nodes=nodes, now=T0 + timedelta(seconds=5))
    assert d.launch is not None and d.launch.in_place and d.launch.only == (0,)
    assert d.relabel is not None and d.relabel.master_addr == addr("job-1-0")
    assert d.launch.master_addr == addr("job-1-0")


def test_a_failure_after_a_spec_edit_recreates_instead_of_keeping_pods_of_the_old_spec() -> None:
    """Chaos soak seed 119 (issue 37, roll-crash then pod-deleted): a pod deleted right after a
    spec edit, before the roll, was restarted in place: the kept pod ran the old spec's template
    beside a replacement built from the new one, one gang of two specs. The gang is recreated."""
    old = tuple(replace(p, template="old") for p in gang(0))
    obs = running_inplace()
    _, obs = run(replace(obs, template="old"), pods=old)
    pods = list(old)
    pods[1] = replace(pods[1], phase="Failed", exit_code=75)  # deleted, stopped
    d, _ = run(replace(obs, template="new"), pods=tuple(pods), now=T0 + timedelta(seconds=5))
    assert _recreates(d) and d.status.attempt == 1
    # the same failure on the spec the pods run stays in place
    d, _ = run(obs, pods=tuple(pods), now=T0 + timedelta(seconds=5))
    assert d.relabel is not None and d.launch is not None and d.launch.only == (1,)


def test_a_spec_edit_during_the_backoff_recreates_rather_than_replace_from_the_new_spec() -> None:
    """Issue 37's long soak (seed 3701, invariant 10): the in-place restart was decided on the old
    spec; the spec was edited while its replacement pod waited out the backoff; the replacement
    was then created from the new template beside the kept pods of the old one, a gang of two
    specs. Now the kept pods go and the whole gang starts on the new template, no restart
    counted beyond the first."""
    old = tuple(replace(p, template="old") for p in gang(0))
    obs = running_inplace(backoffSeconds=10)
    _, obs = run(replace(obs, template="old"), pods=old)
    pods = list(old)
    pods[1] = replace(pods[1], phase="Failed", exit_code=137)
    d, after = run(obs, pods=tuple(pods), now=T0 + timedelta(seconds=5))
    assert d.relabel is not None and d.launch is None and d.status.restarts == 1  # in the backoff
    moved = tuple(replace(p, attempt=1) for p in old if p.index != 1)
    seen = (pods[1], *moved)
    d2, _ = run(replace(after, template="new"), pods=seen, now=T0 + timedelta(seconds=16))
    assert d2.relabel is None
    assert sorted(d2.delete) == ["job-0-0", "job-0-2", "job-0-3"]
    assert d2.launch is not None and not d2.launch.in_place and d2.launch.only == ()
    assert d2.launch.attempt == 2 and len(d2.launch.assignments) == 4
    assert d2.status.attempt == 2 and d2.status.restarts == 1
    assert any(r == Reason.SPEC_CHANGED for _, r, _ in d2.events)
    # The same pass without the edit creates the replacement in place, on the spec all pods run.
    d3, _ = run(after, pods=seen, now=T0 + timedelta(seconds=16))
    assert d3.launch is not None and d3.launch.in_place and d3.launch.only == (1,)
    assert d3.delete == []


def test_a_backoff_written_by_a_clock_that_ran_ahead_waits_its_own_length_here() -> None:
    """The long soak, seed 3701: a replica whose wall clock ran 560 s ahead recorded a failure;
    the replica on the true clock that took over waited out the backoff from that future time
    (about 560 s in BackoffWaiting). A time ahead of this pass's clock is brought back to now."""
    obs = running_inplace(backoffSeconds=10)
    skewed = T0 + timedelta(seconds=5 + 560)
    d, after = run(obs, pods=crash(1), now=skewed)  # the skewed replica's pass
    assert d.relabel is not None and d.launch is None and d.status.last_failure is not None
    moved = tuple(replace(p, attempt=1) for p in gang(0) if p.index != 1)
    d2, after = run(after, pods=(*crash(1)[1:2], *moved), now=T0 + timedelta(seconds=9))
    assert d2.launch is None and d2.requeue_after is not None and d2.requeue_after <= 10
    rec, failure = d2.status.recovery, d2.status.last_failure
    assert rec is not None and failure is not None and rec.started == failure.time  # still a backoff
    d3, _ = run(after, pods=(*crash(1)[1:2], *moved), now=T0 + timedelta(seconds=20))
    assert d3.launch is not None and d3.launch.only == (1,) and d3.launch.in_place
