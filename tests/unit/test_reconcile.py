"""The reconciler's decisions, pass by pass, with a fake planner (no cluster).

`FakePlanner` stands in for the placement engine at the unit-test boundary: it
places pod i on node f"n{i}" unless told the capacity is smaller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason, TrainingJobStatus
from topotrain.core.decision import Decision, Observed
from topotrain.core.planning import PlanOutcome
from topotrain.core.policy import NodeView, PodView
from topotrain.core.rank_table import RankTable
from topotrain.core.reconcile import reconcile
from topotrain.core.reconcile_status import CheckpointView

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class FakePlanner:
    """Fake placement engine: `capacity` pods fit, on nodes n0, n1, ... (spares after)."""

    gpus_per_pod: int = 2
    per_replica: int = 2  # tensor*pipeline/gpusPerPod pods per data replica
    capacity: int = 100
    spare: list[str] = field(default_factory=lambda: ["spare0", "spare1"])
    calls: list[str] = field(default_factory=list)

    def plan(self, low: int, high: int) -> PlanOutcome:
        self.calls.append(f"plan {low}-{high}")
        for data in range(high, low - 1, -1):
            pods = data * self.per_replica
            if pods <= self.capacity:
                nodes = {i: f"n{i}" for i in range(pods)}
                return PlanOutcome(True, pool="H100", data=data, assignments=nodes, cost=1.0,
                                   nodes=pods, racks=1, blocks=1)
        return PlanOutcome(False, reason=Reason.INSUFFICIENT_CAPACITY, message="no room")

    def replan(self, previous: Mapping[int, str], lost: frozenset[str], low: int, high: int
               ) -> PlanOutcome:
        self.calls.append(f"replan lost={sorted(lost)}")
        out, spare = dict(previous), list(self.spare)
        for index, node in sorted(previous.items()):
            if node in lost:
                if not spare:
                    result = self.plan(low, high)
                    return replace(result, mode="full")
                out[index] = spare.pop(0)
        return PlanOutcome(True, pool="H100", data=high, assignments=out, cost=1.0,
                           mode="incremental", nodes=len(out), racks=1, blocks=1)


def spec(**failure: Any) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "trainer:1",
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 2, "minData": 1},
        "worker": {"gpusPerPod": 2},
        "checkpoint": {"uri": "s3://ckpt/runs"},
        # restartInPlace: these tests hold the recreate path; test_reconcile_inplace.py the other
        "failurePolicy": {"backoffSeconds": 0, "restartInPlace": False, **failure},
    })


def observed(**kw: Any) -> Observed:
    base: dict[str, Any] = dict(
        name="job", namespace="ns", generation=1, spec=spec(), status=TrainingJobStatus(),
        pods=(), nodes={f"n{i}": NodeView(f"n{i}") for i in range(8)}, planner=FakePlanner(),
        now=T0, checkpoint=CheckpointView(step=200, uri="s3://ckpt/runs/ns/job/step-0000000200"),
    )
    base["nodes"] = {**base["nodes"], "spare0": NodeView("spare0"), "spare1": NodeView("spare1")}
    base.update(kw)
    return Observed(**base)


def gang(attempt: int, n: int = 4, phase: str = "Running", gated: bool = False,
         nodes: Mapping[int, str] | None = None) -> tuple[PodView, ...]:
    nodes = nodes or {i: f"n{i}" for i in range(n)}
    return tuple(
        PodView(f"job-{attempt}-{i}", i, attempt, phase=phase, planned_node=nodes[i],
                node="" if gated else nodes[i], gated=gated)
        for i in range(n)
    )


def run(obs: Observed, **kw: Any) -> tuple[Decision, Observed]:
    """One pass, then the observation the next pass would see (status written back)."""
    decision = reconcile(replace(obs, **kw) if kw else obs)
    return decision, replace(obs, **kw, status=decision.status) if kw else replace(obs, status=decision.status)


def test_new_job_is_placed_and_created_gated() -> None:
    d, _ = run(observed())
    assert d.launch is not None and d.launch.attempt == 0 and d.launch.data == 2
    assert dict(d.launch.assignments) == {0: "n0", 1: "n1", 2: "n2", 3: "n3"}
    assert d.launch.resume_step == 200
    assert d.status.phase == "Starting" and d.status.selector == "topotrain.io/job=job"
    assert d.status.condition(C.SCHEDULABLE).status == "True"  # type: ignore[union-attr]


def test_gated_complete_gang_is_released_together() -> None:
    _, obs = run(observed())
    d, _ = run(obs, pods=gang(0, phase="Pending", gated=True))
    assert sorted(d.release) == [f"job-0-{i}" for i in range(4)] and d.launch is None


def test_half_created_gang_is_finished_from_the_rank_table() -> None:
    _, obs = run(observed())
    table = RankTable(0, 2, {i: f"n{i}" for i in range(4)})
    half = tuple(replace(p, resume_step="200") for p in gang(0, phase="Pending", gated=True)[:2])
    d, _ = run(obs, pods=half, rank_table=table)
    assert d.launch is not None and d.launch.only == (2, 3) and d.launch.resume_step == 200
    assert not d.delete


def test_a_half_created_gang_told_an_older_step_than_the_newest_commit_starts_over() -> None:
    """CI's chaos soak (invariant 1): pods created later for an attempt kept the step its first
    pods were told, though a newer one had been committed meanwhile (by the dying gang's rank 0).
    Nothing of a gated gang runs yet: it is deleted and launched again from the newest commit."""
    _, obs = run(observed())
    table = RankTable(0, 2, {i: f"n{i}" for i in range(4)})
    half = tuple(replace(p, resume_step="190") for p in gang(0, phase="Pending", gated=True)[:2])
    d, _ = run(obs, pods=half, rank_table=table)
    assert d.launch is None and sorted(d.delete) == ["job-0-0", "job-0-1"]


def test_all_running_sets_running_and_ready() -> None:
    _, obs = run(observed())
    d, _ = run(obs, pods=gang(0))
    assert d.status.phase == "Running" and d.status.condition(C.READY).status == "True"  # type: ignore[union-attr]
    assert d.recovered_seconds is None


def running_job(**kw: Any) -> Observed:
    _, obs = run(observed(**kw))
    _, obs = run(obs, pods=gang(0))
    return obs


def test_pod_failure_restarts_with_next_attempt_and_committed_step() -> None:
    obs = running_job()
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=1)
    d, after = run(obs, pods=tuple(pods), now=T0 + timedelta(seconds=5))
    assert sorted(d.delete) == ["job-0-0", "job-0-2", "job-0-3"]  # the crashed pod keeps its logs
    assert d.launch is not None and d.launch.attempt == 1 and d.launch.resume_step == 200
    assert d.status.restarts == 1 and d.status.last_failure.exit_code == 1  # type: ignore[union-attr]
    assert d.status.phase == "Recovering" and d.restart_reason == Reason.POD_FAILED
    # replacements Running: recovery time measured from detection
    d2, _ = run(after, pods=gang(1), now=T0 + timedelta(seconds=7))
    assert d2.status.phase == "Running" and d2.recovered_seconds == pytest.approx(2.0)
    assert d2.status.recovery.last_seconds == pytest.approx(2.0)  # type: ignore[union-attr]


def test_non_retryable_exit_fails_at_once() -> None:
    obs = running_job()
    pods = list(gang(0))
    pods[0] = replace(pods[0], phase="Failed", exit_code=78)
    d, _ = run(obs, pods=tuple(pods))
    assert d.status.phase == "Failed" and d.launch is None and d.status.restarts == 0
    assert d.status.condition(C.FAILED).reason == Reason.NON_RETRYABLE  # type: ignore[union-attr]


def test_max_restarts_exhausted_fails() -> None:
    obs = running_job(spec=spec(maxRestarts=1))
    obs = replace(obs, status=obs.status.model_copy(update={"restarts": 1}))
    pods = list(gang(0))
    pods[2] = replace(pods[2], phase="Failed", exit_code=137)
    d, _ = run(obs, pods=tuple(pods))
    assert d.status.phase == "Failed" and d.launch is None
    assert d.status.condition(C.FAILED).reason == Reason.MAX_RESTARTS  # type: ignore[union-attr]


def test_backoff_waits_then_launches_incrementally() -> None:
    obs = running_job(spec=spec(backoffSeconds=10))
    pods = list(gang(0))
    pods[3] = replace(pods[3], phase="Failed", exit_code=1)
    d, after = run(obs, pods=tuple(pods))
    assert d.launch is None and d.requeue_after == 10 and d.status.attempt == 1
    table = RankTable(0, 2, {i: f"n{i}" for i in range(4)})
    d2, after = run(after, pods=(), rank_table=table, now=T0 + timedelta(seconds=4))
    assert d2.launch is None and d2.requeue_after == pytest.approx(6)
    d3, _ = run(after, now=T0 + timedelta(seconds=10))
    assert d3.launch is not None and d3.launch.attempt == 1 and d3.launch.mode == "incremental"


def test_node_not_ready_replaces_only_its_pod_on_a_spare() -> None:
    obs = running_job()
    nodes = {**obs.nodes, "n2": NodeView("n2", ready=False)}
    d, _ = run(obs, pods=gang(0), nodes=nodes)
    assert d.launch is not None and d.launch.mode == "incremental"
    assert dict(d.launch.assignments) == {0: "n0", 1: "n1", 2: "spare0", 3: "n3"}
    assert d.status.last_failure.reason == Reason.NODE_NOT_READY  # type: ignore[union-attr]


def test_a_gang_with_a_rank_on_a_lost_node_is_deleted_without_waiting_for_its_save() -> None:
    """Its healthy ranks' SIGTERM checkpoint cannot commit without the lost node's ranks: they are
    deleted with a grace of 1 s, so the next attempt does not wait 30 s for their GPUs. A crashed
    rank on a healthy node leaves the others their grace period (they may still save)."""
    obs = running_job()
    nodes = {**obs.nodes, "n2": NodeView("n2", ready=False)}
    lost, _ = run(obs, pods=gang(0), nodes=nodes)
    assert lost.delete and lost.delete_now
    pods = list(gang(0))
    pods[3] = replace(pods[3], phase="Failed", exit_code=1)
    crashed, _ = run(obs, pods=tuple(pods))
    assert crashed.delete and not crashed.delete_now


def test_node_loss_without_spare_shrinks_to_min_data() -> None:
    obs = running_job()
    planner = FakePlanner(capacity=2, spare=[])
    nodes = {k: v for k, v in obs.nodes.items() if k != "n1"}
    d, _ = run(obs, pods=gang(0), nodes=nodes, planner=planner)
    assert d.launch is not None and d.launch.data == 1
    assert d.status.parallelism.data == 1  # type: ignore[union-attr]
    assert d.status.recovery.mode == "shrink"  # type: ignore[union-attr]


def test_shrunk_job_grows_back_when_capacity_returns() -> None:
    obs = running_job()
    obs = replace(obs, status=obs.status.model_copy(update={"parallelism": obs.status.parallelism.model_copy(update={"data": 1})}))  # type: ignore[union-attr]
    small = FakePlanner(capacity=2)
    d, _ = run(obs, pods=gang(0, n=2), planner=small)
    assert d.launch is None and not d.delete  # no room yet: keep running at data=1
    d1, obs = run(obs, pods=gang(0, n=2), planner=FakePlanner())
    assert d1.launch is None and d1.checkpoint_request is not None  # a checkpoint first
    saved = replace(obs.checkpoint, step=230, request=d1.checkpoint_request.value, request_step=230)
    d2, _ = run(obs, pods=gang(0, n=2), planner=FakePlanner(), checkpoint=saved)
    assert d2.launch is not None and d2.launch.data == 2 and d2.launch.attempt == 1
    assert d2.launch.resume_step == 230
    assert sorted(d2.delete) == ["job-0-0", "job-0-1"]
    assert d2.status.restarts == 0  # a resize is not a failure


def test_kubectl_scale_down_restarts_at_the_new_degree() -> None:
    obs = running_job()
    scaled = spec()
    scaled.parallelism.data = 1
    d, obs = run(obs, pods=gang(0), spec=scaled)
    assert d.launch is None and not d.delete and d.checkpoint_request is not None
    saved = replace(obs.checkpoint, step=230, request=d.checkpoint_request.value, request_step=230)
    d, _ = run(obs, pods=gang(0), checkpoint=saved)
    assert d.launch is not None and d.launch.data == 1 and d.launch.resume_step == 230


def test_stale_progress_restarts() -> None:
    obs = running_job(spec=spec(progressTimeoutSeconds=60))
    ckpt = CheckpointView(step=200, uri="s3://x/step", progress_step=250,
                          progress_time=T0 + timedelta(seconds=10), progress_attempt=0)
    seen, obs = run(obs, pods=gang(0), now=T0 + timedelta(seconds=10), checkpoint=ckpt)
    assert seen.launch is None
    d, _ = run(obs, pods=gang(0), now=T0 + timedelta(seconds=71), checkpoint=ckpt)
    assert d.status.last_failure.reason == Reason.PROGRESS_STALLED  # type: ignore[union-attr]
    assert d.launch is not None and d.launch.attempt == 1


def test_an_earlier_attempts_heartbeat_gives_the_new_trainer_its_startup_time() -> None:
    """After a restart progress.json is still attempt 0's: attempt 1's trainer is
    starting (startupTimeoutSeconds), not hanging, until that runs out."""
    obs = running_job(spec=spec(progressTimeoutSeconds=60, startupTimeoutSeconds=900))
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=1)
    _, after = run(obs, pods=tuple(pods), now=T0 + timedelta(seconds=5))
    _, after = run(after, pods=gang(1), now=T0 + timedelta(seconds=7))  # attempt 1 Running
    old = CheckpointView(step=200, uri="s3://x/step", progress_step=250,
                         progress_time=T0, progress_attempt=0)
    starting, _ = run(after, pods=gang(1), now=T0 + timedelta(seconds=600), checkpoint=old)
    assert starting.launch is None and starting.status.phase == "Running"
    hung, _ = run(after, pods=gang(1), now=T0 + timedelta(seconds=1000), checkpoint=old)
    failure = hung.status.last_failure
    assert failure is not None and failure.reason == Reason.PROGRESS_STALLED
    assert "while starting" in failure.message and hung.launch is not None
    assert hung.launch.attempt == 2
    # once attempt 1 reports, the (shorter) progress timeout applies again
    beat = replace(old, progress_time=T0 + timedelta(seconds=590), progress_attempt=1)
    fine, after = run(after, pods=gang(1), now=T0 + timedelta(seconds=620), checkpoint=beat)
    assert fine.launch is None
    late, _ = run(after, pods=gang(1), now=T0 + timedelta(seconds=700), checkpoint=beat)
    assert late.launch is not None and "has not changed" in late.status.last_failure.message  # type: ignore[union-attr]


def test_fresh_progress_keeps_running() -> None:
    obs = running_job(spec=spec(progressTimeoutSeconds=60))
    ckpt = CheckpointView(step=200, uri="s3://x/step", progress_step=250,
                          progress_time=T0 + timedelta(seconds=290), progress_attempt=0)
    d, _ = run(obs, pods=gang(0), now=T0 + timedelta(seconds=300), checkpoint=ckpt)
    assert d.launch is None and d.status.phase == "Running"
    assert d.status.progress.step == 250  # type: ignore[union-attr]


def test_operator_restart_mid_launch_keeps_pod_attempt() -> None:
    """Pods of attempt 1 exist but the status write was lost: no new attempt, no duplicates."""
    obs = running_job()
    d, _ = run(obs, pods=gang(1, phase="Pending", gated=True))
    assert d.launch is None and sorted(d.release) == [f"job-1-{i}" for i in range(4)]
    assert d.status.attempt == 1


def test_same_input_same_decision() -> None:
    obs = running_job()
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=1)
    assert reconcile(replace(obs, pods=tuple(pods))) == reconcile(replace(obs, pods=tuple(pods)))


@pytest.mark.parametrize(
    ("problem", "reason"),
    [
        ((Reason.SECRET_NOT_FOUND, "secret ckpt-creds not found"), Reason.SECRET_NOT_FOUND),
        ((Reason.SECRET_FORBIDDEN, "forbidden"), Reason.SECRET_FORBIDDEN),
    ],
)
def test_config_problem_blocks_start_with_a_condition(problem: tuple[str, str], reason: str) -> None:
    d, _ = run(observed(config_problem=problem))
    assert d.launch is None and d.status.phase == "Pending"
    assert d.status.condition(C.CONFIG_VALID).reason == reason  # type: ignore[union-attr]


def test_each_new_config_problem_is_announced_once() -> None:
    """A job refused for its namesake's checkpoints and then for its namesake's pods said
    nothing the second time (the condition stayed False): an Event per new reason, none per
    pass while it lasts, and the launch once it is gone."""
    first, obs = run(observed(config_problem=(Reason.FOREIGN_CHECKPOINTS, "step 100 is another job's")))
    assert [e[1] for e in first.events] == [Reason.FOREIGN_CHECKPOINTS]
    again, obs = run(obs)
    assert again.events == []
    other, obs = run(obs, config_problem=(Reason.FOREIGN_OBJECT, "Pod ns/job-0-0 is another job's"))
    assert [(e[0], e[1]) for e in other.events] == [("Warning", Reason.FOREIGN_OBJECT)]
    assert other.status.condition(C.CONFIG_VALID).reason == Reason.FOREIGN_OBJECT  # type: ignore[union-attr]
    fixed, _ = run(obs, config_problem=None)
    assert fixed.launch is not None


def test_unplaceable_job_waits_with_reason() -> None:
    d, _ = run(observed(planner=FakePlanner(capacity=1)))
    cond = d.status.condition(C.SCHEDULABLE)
    assert d.launch is None and cond is not None and cond.status == "False"
    assert cond.reason == Reason.INSUFFICIENT_CAPACITY and d.status.phase == "Pending"


def test_unreachable_checkpoint_store_never_starts_from_scratch() -> None:
    obs = running_job()
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=1)
    d, _ = run(obs, pods=tuple(pods), checkpoint=CheckpointView(reachable=False, error="timeout"))
    assert d.launch is None and d.delete  # old gang torn down, new one waits for S3


def test_all_succeeded_completes_and_deletes_pods() -> None:
    obs = running_job()
    d, after = run(obs, pods=gang(0, phase="Succeeded"))
    assert d.status.phase == "Succeeded" and len(d.delete) == 4
    d2, _ = run(after, pods=())
    assert d2.status.phase == "Succeeded" and d2.launch is None


def test_older_attempt_pods_are_deleted() -> None:
    obs = running_job()
    obs = replace(obs, status=obs.status.model_copy(update={"attempt": 1}))
    d, _ = run(obs, pods=gang(0) + gang(1))
    assert sorted(d.delete) == [f"job-0-{i}" for i in range(4)]


def test_status_unchanged_on_a_quiet_pass() -> None:
    obs = running_job()
    d1, after = run(obs, pods=gang(0), now=T0 + timedelta(seconds=30))
    d2, _ = run(after, pods=gang(0), now=T0 + timedelta(seconds=60))
    assert d1.status == d2.status and not d2.events


def test_no_hang_detection_without_a_checkpoint_store() -> None:
    obs = running_job(spec=spec(progressTimeoutSeconds=60), checkpoint=None)
    d, _ = run(obs, pods=gang(0), now=T0 + timedelta(hours=2), checkpoint=None)
    assert d.launch is None and d.status.phase == "Running"


def test_replacement_gate_opens_only_after_the_old_gang_is_gone() -> None:
    obs = running_job()
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=1)
    d, after = run(obs, pods=tuple(pods))
    assert d.launch is not None and d.launch.release is False
    terminating = tuple(replace(p, terminating=True) for p in pods)
    d2, after = run(after, pods=terminating + gang(1, phase="Pending", gated=True))
    assert not d2.release and d2.launch is None
    d3, _ = run(after, pods=gang(1, phase="Pending", gated=True))
    assert sorted(d3.release) == [f"job-1-{i}" for i in range(4)]


def test_a_pod_terminating_long_past_its_grace_period_is_deleted_again() -> None:
    """Long soak seed 1302: a gang stayed gated for ever behind an old pod the watch cache still
    showed Terminating on a Ready node it needed (its deletion was missed while the API server
    restarted). Past its grace period by more than OVERDUE_SECONDS such a pod is deleted again:
    a ghost's 404 is what lets the operator drop it (test_snapshot: Ghosts)."""
    from topotrain.core.reconcile import OVERDUE_SECONDS

    obs = running_job()
    pods = list(gang(0))
    pods[1] = replace(pods[1], phase="Failed", exit_code=1)
    _, after = run(obs, pods=tuple(pods))
    deadline = (T0 + timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    old = tuple(replace(p, terminating=True, deletion_deadline=deadline) for p in pods)
    new = gang(1, phase="Pending", gated=True)
    soon = T0 + timedelta(seconds=30 + OVERDUE_SECONDS - 1)
    d2, after = run(after, pods=old + new, now=soon)
    assert not d2.release and not d2.delete  # within its grace (and the slack): left alone
    late = T0 + timedelta(seconds=30 + OVERDUE_SECONDS + 1)
    d3, after = run(after, pods=old + new, now=late)
    assert not d3.release and sorted(d3.delete) == sorted(p.name for p in old)
    # ... but never on a node that is not Ready: no kubelet there to finish it, as expected.
    lost = {k: replace(v, ready=False) for k, v in after.nodes.items()}
    d4, _ = run(after, pods=old + new, now=late, nodes=lost)
    assert not set(d4.delete) & {p.name for p in old}
