"""Planned changes lose no step (issue 16): a resize checkpoints the running gang first.

Pass by pass, no cluster: `kubectl scale` (or capacity coming back) asks the gang for a
checkpoint through its pods' annotation, the gang keeps training while it saves, and only
once the store's newest COMMITTED names the request is the gang replaced, resuming from
that step. The wait is bounded; a failure meanwhile is a failure like any other.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from test_reconcile import T0, FakePlanner, gang, observed, run, running_job, spec
from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason
from topotrain.core.decision import Decision, Observed
from topotrain.core.planned import CHECKPOINT_REQUEST_TIMEOUT, POLL_SECONDS
from topotrain.core.policy import PodView
from topotrain.core.reconcile_status import CheckpointView

LAST = CheckpointView(step=200, uri="s3://ckpt/runs/ns/job/step-0000000200")


def at(seconds: float) -> Any:
    return T0 + timedelta(seconds=seconds)


def served(value: str, step: int = 237) -> CheckpointView:
    """The store once the trainer committed the requested save (at the step it had reached)."""
    return replace(LAST, step=step, uri=f"s3://ckpt/runs/ns/job/step-{step:010d}", request=value,
                   request_step=step)


def asked(pods: tuple[PodView, ...], value: str) -> tuple[PodView, ...]:
    """The pods once the watch shows the operator's annotation."""
    return tuple(replace(p, checkpoint_request=value) for p in pods)


def scaled_to(data: int) -> Any:
    s = spec()
    s.parallelism.data = data
    return s


def shrink() -> tuple[Observed, tuple[PodView, ...]]:
    """Running at data=2 (4 pods); the user scales to data=1."""
    return replace(running_job(), spec=scaled_to(1)), gang(0)


def grow() -> tuple[Observed, tuple[PodView, ...]]:
    """Shrunk to data=1 (2 pods) earlier; capacity for data=2 is back."""
    obs = running_job()
    par = obs.status.parallelism
    assert par is not None
    status = obs.status.model_copy(update={"parallelism": par.model_copy(update={"data": 1})})
    return replace(obs, status=status), gang(0, n=2)


def request_of(d: Decision) -> str:
    req = d.status.checkpoint_request
    assert req is not None
    return req.value


@pytest.mark.parametrize(("start", "new_data"), [(shrink, 1), (grow, 2)], ids=["scale-down", "grow"])
def test_resize_checkpoints_first_and_resumes_from_the_requested_step(start: Any, new_data: int) -> None:
    obs, pods = start()
    d, obs = run(obs, pods=pods, now=at(10))
    # 1. Ask every pod, record it, keep training: nothing deleted, nothing launched.
    value = request_of(d)
    assert d.checkpoint_request is not None and d.checkpoint_request.value == value
    assert sorted(d.checkpoint_request.pods) == sorted(p.name for p in pods)
    assert not d.delete and d.launch is None and d.status.phase == "Running"
    assert d.status.checkpoint_request.state == "Pending"  # type: ignore[union-attr]
    assert d.requeue_after is not None and d.requeue_after <= POLL_SECONDS
    assert Reason.CHECKPOINT_REQUESTED in [e[1] for e in d.events]
    # 2. Saving: the pods carry the annotation, so nothing is patched again; still no change.
    d, obs = run(obs, pods=asked(pods, value), now=at(12))
    assert d.checkpoint_request is None and not d.delete and d.launch is None
    assert request_of(d) == value  # the same request, never a second one
    # 3. Committed: the gang is replaced at the new degree, resuming from the requested step.
    d, _ = run(obs, pods=asked(pods, value), now=at(15), checkpoint=served(value, 237))
    assert sorted(d.delete) == sorted(p.name for p in pods)
    assert d.launch is not None and d.launch.data == new_data and d.launch.attempt == 1
    assert d.launch.resume_step == 237
    assert d.status.recovery is not None and d.status.recovery.resume_step == 237
    assert d.status.checkpoint_request.state == "Committed"  # type: ignore[union-attr]
    assert d.status.checkpoint_request.step == 237  # type: ignore[union-attr]
    assert d.status.restarts == 0  # a planned change is not a failure
    assert Reason.CHECKPOINT_SERVED in [e[1] for e in d.events]


def test_a_newer_stale_commit_does_not_hide_the_served_request() -> None:
    """The gang an earlier resize replaced saved a newer step on its SIGTERM (naming its own,
    older request); the current gang's requested save is an older step. The resize still sees its
    request served and resumes from the requested step, not the stale newer one (CI: the grow
    waited until the job had finished)."""
    obs, pods = grow()
    d, obs = run(obs, pods=pods, now=at(10))
    value = request_of(d)
    stale = replace(LAST, step=260, uri="s3://ckpt/runs/ns/job/step-0000000260",
                    request="resize-0-old", request_step=None)
    d, obs = run(obs, pods=asked(pods, value), now=at(12), checkpoint=stale)
    assert d.launch is None and d.status.checkpoint_request.state == "Pending"  # type: ignore[union-attr]
    d, _ = run(obs, pods=asked(pods, value), now=at(14),
               checkpoint=replace(stale, request=value, request_step=237))
    assert d.launch is not None and d.launch.resume_step == 237 and d.launch.data == 2
    assert d.status.checkpoint_request.step == 237  # type: ignore[union-attr]


def test_an_operator_restart_mid_wait_asks_the_pods_that_lack_the_request_again() -> None:
    obs, pods = shrink()
    d, obs = run(obs, pods=pods, now=at(10))
    value = request_of(d)
    # The status was written, the patch reached only pod 0 before the operator died.
    half = (replace(pods[0], checkpoint_request=value), *pods[1:])
    d, _ = run(obs, pods=half, now=at(30))
    assert d.checkpoint_request is not None and d.checkpoint_request.value == value
    assert d.checkpoint_request.pods == ("job-0-1", "job-0-2", "job-0-3")


def test_an_older_commit_naming_another_request_does_not_count() -> None:
    obs, pods = shrink()
    d, obs = run(obs, pods=pods, now=at(10), checkpoint=served("resize-0-earlier", 150))
    d, _ = run(obs, pods=asked(pods, request_of(d)), now=at(20))
    assert d.launch is None and not d.delete


@pytest.mark.parametrize(("start", "new_data"), [(shrink, 1), (grow, 2)], ids=["scale-down", "grow"])
def test_checkpoint_on_demand_off_resizes_at_once_from_the_last_commit(start: Any, new_data: int) -> None:
    """TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT=0: no request, the gang changes in the first pass and
    resumes from the newest commit (what bench/planned.py compares against)."""
    obs, pods = start()
    d, _ = run(replace(obs, checkpoint_request_timeout=0.0), pods=pods, now=at(10))
    assert d.checkpoint_request is None and d.status.checkpoint_request is None
    assert Reason.CHECKPOINT_REQUESTED not in [e[1] for e in d.events]
    assert sorted(d.delete) == sorted(p.name for p in pods)
    assert d.launch is not None and d.launch.data == new_data and d.launch.resume_step == LAST.step


def test_a_longer_request_timeout_is_waited_for() -> None:
    obs, pods = shrink()
    obs = replace(obs, checkpoint_request_timeout=3 * CHECKPOINT_REQUEST_TIMEOUT)
    d, obs = run(obs, pods=pods, now=at(10))
    value = request_of(d)
    d, obs = run(obs, pods=asked(pods, value), now=at(10 + 2 * CHECKPOINT_REQUEST_TIMEOUT))
    assert d.launch is None and d.status.checkpoint_request.state == "Pending"  # type: ignore[union-attr]
    d, _ = run(obs, pods=asked(pods, value), now=at(10 + 3 * CHECKPOINT_REQUEST_TIMEOUT))
    assert d.launch is not None and d.status.checkpoint_request.state == "TimedOut"  # type: ignore[union-attr]


def test_timeout_falls_back_to_the_last_commit_with_an_event() -> None:
    obs, pods = shrink()
    d, obs = run(obs, pods=pods, now=at(10))
    value = request_of(d)
    d, obs = run(obs, pods=asked(pods, value), now=at(10 + CHECKPOINT_REQUEST_TIMEOUT - 1))
    assert d.launch is None and d.requeue_after is not None and d.requeue_after <= 1.0
    d, _ = run(obs, pods=asked(pods, value), now=at(10 + CHECKPOINT_REQUEST_TIMEOUT))
    assert d.launch is not None and d.launch.data == 1 and d.launch.resume_step == 200
    assert d.status.checkpoint_request.state == "TimedOut"  # type: ignore[union-attr]
    assert d.status.checkpoint_request.step == 200  # type: ignore[union-attr]
    warnings = [m for kind, reason, m in d.events
                if kind == "Warning" and reason == Reason.CHECKPOINT_TIMED_OUT]
    assert warnings and "last commit, step 200" in warnings[0] and "120s" in warnings[0]


def test_a_failure_while_waiting_is_handled_as_a_failure() -> None:
    obs, pods = shrink()
    d, obs = run(obs, pods=pods, now=at(10))
    crashed = list(asked(pods, request_of(d)))
    crashed[2] = replace(crashed[2], phase="Failed", exit_code=1)
    d, _ = run(obs, pods=tuple(crashed), now=at(14))
    assert d.status.last_failure is not None and d.status.last_failure.reason == Reason.POD_FAILED
    assert d.status.restarts == 1 and d.restart_reason == Reason.POD_FAILED
    assert d.launch is not None and d.launch.resume_step == 200  # the last commit, as any failure
    assert d.status.checkpoint_request.state == "Cancelled"  # type: ignore[union-attr]


def test_an_unreadable_store_holds_the_change_past_the_bound() -> None:
    """Without the store the resume step is unknown: the gang keeps training, nothing is lost."""
    obs, pods = shrink()
    d, obs = run(obs, pods=pods, now=at(10))
    down = CheckpointView(reachable=False, error="Could not connect to the endpoint URL")
    d, obs = run(obs, pods=asked(pods, request_of(d)), now=at(500), checkpoint=down)
    assert d.launch is None and not d.delete and d.status.phase == "Running"
    assert d.status.checkpoint_request.state == "Pending"  # type: ignore[union-attr]


def test_scaling_back_before_the_checkpoint_cancels_the_change() -> None:
    obs, pods = shrink()
    d, obs = run(obs, pods=pods, now=at(10))
    value = request_of(d)
    d, obs = run(obs, pods=asked(pods, value), now=at(12), spec=spec())
    assert d.launch is None and not d.delete
    assert d.status.checkpoint_request.state == "Cancelled"  # type: ignore[union-attr]
    # The request is a planned stop's: a trainer that served it waits at that step for a SIGTERM
    # that is not coming now. Clearing it on the pods lets the gang train on.
    assert d.checkpoint_request is not None and d.checkpoint_request.value == ""
    assert sorted(d.checkpoint_request.pods) == sorted(p.name for p in pods)
    d, _ = run(obs, pods=asked(pods, ""), now=at(14), spec=spec())
    assert d.checkpoint_request is None  # cleared: nothing more to patch


def test_a_new_request_after_a_finished_one_has_a_new_value() -> None:
    """The trainer acts on a changed value only: every request must differ from the last."""
    obs, pods = shrink()
    d, obs = run(obs, pods=pods, now=at(10))
    first = request_of(d)
    d, obs = run(obs, pods=asked(pods, first), now=at(12), spec=spec())  # cancelled
    d, _ = run(obs, pods=asked(pods, first), now=at(20), spec=scaled_to(1))
    assert request_of(d) != first and d.checkpoint_request is not None
    assert d.checkpoint_request.pods == tuple(p.name for p in pods)


def test_without_a_checkpoint_store_the_resize_is_immediate() -> None:
    _, obs = run(observed(checkpoint=None))
    _, obs = run(obs, pods=gang(0))
    d, _ = run(obs, pods=gang(0), spec=scaled_to(1).model_copy(update={"checkpoint": None}), checkpoint=None)
    assert d.launch is not None and d.launch.data == 1 and d.checkpoint_request is None


def test_no_request_when_there_is_no_room_to_grow() -> None:
    obs, pods = grow()
    d, _ = run(obs, pods=pods, planner=FakePlanner(capacity=2))
    assert d.checkpoint_request is None and d.status.checkpoint_request is None


# --- a cordoned node: the gang moves off it before the eviction, losing no step ---------------


class OffCordoned(FakePlanner):
    """Places the gang on the nodes `free` names, in order (the real planner leaves cordoned
    nodes out of its inventory), as many data replicas as fit."""

    def __init__(self, free: list[str]) -> None:
        super().__init__(capacity=len(free))
        self.free = free

    def plan(self, low: int, high: int) -> Any:
        outcome = super().plan(low, high)
        if not outcome.feasible:
            return outcome
        return replace(outcome, assignments={i: self.free[i] for i in outcome.assignments})


def cordoned(obs: Observed, *names: str) -> Observed:
    return replace(obs, nodes={**obs.nodes, **{n: replace(obs.nodes[n], cordoned=True) for n in names}})


def test_a_cordoned_node_checkpoints_the_gang_first_then_moves_it_off_from_that_step() -> None:
    free = ["n4", "n5", "n6", "n7"]
    obs = cordoned(replace(running_job(), planner=OffCordoned(free)), "n1")
    # 1. The running gang is asked for a checkpoint and keeps training: nothing deleted yet.
    d, waiting = run(obs, pods=gang(0), now=at(5))
    assert not d.delete and d.launch is None
    assert d.checkpoint_request is not None and d.checkpoint_request.value.startswith("drain-0-")
    assert d.status.phase == "Running" and d.requeue_after == POLL_SECONDS
    value = d.checkpoint_request.value
    # 2. Committed at step 237: the whole gang restarts off the cordoned node, from that step.
    d, after = run(waiting, pods=asked(gang(0), value), now=at(8), checkpoint=served(value))
    assert sorted(d.delete) == [f"job-0-{i}" for i in range(4)]
    assert d.launch is not None and d.launch.attempt == 1 and d.launch.resume_step == 237
    assert "n1" not in d.launch.assignments.values() and sorted(d.launch.assignments.values()) == free
    recovering = d.status.condition(C.RECOVERING)
    assert recovering is not None and recovering.reason == Reason.NODE_CORDONED
    assert "n1 cordoned" in recovering.message and "from step 237" in recovering.message
    assert d.status.restarts == 0 and d.restart_reason is None  # a move spends no failure budget
    assert d.status.recovery is not None and d.status.recovery.cause == "drain"
    assert Reason.CHECKPOINT_SERVED in [e[1] for e in d.events]
    # 3. Once the new attempt runs on schedulable nodes nothing more happens.
    moved = gang(1, nodes=dict(enumerate(free)))
    d, _ = run(after, pods=moved, now=at(20), checkpoint=served(value))
    assert d.launch is None and not d.delete and d.status.phase == "Running"


def test_a_cordoned_node_moves_the_gang_from_the_last_commit_once_the_request_times_out() -> None:
    obs = cordoned(replace(running_job(), planner=OffCordoned(["n4", "n5", "n6", "n7"])), "n0")
    _, waiting = run(obs, pods=gang(0), now=at(5))
    d, _ = run(waiting, pods=gang(0), now=at(5 + CHECKPOINT_REQUEST_TIMEOUT + 1))  # never served
    assert d.launch is not None and d.launch.resume_step == 200
    assert Reason.CHECKPOINT_TIMED_OUT in [e[1] for e in d.events]


def test_a_cordon_and_a_scale_down_move_the_gang_once_at_the_new_degree() -> None:
    obs = cordoned(replace(running_job(), planner=OffCordoned(["n4", "n5"])), "n2", "n3")
    obs = replace(obs, spec=scaled_to(1))
    _, waiting = run(obs, pods=gang(0), now=at(5))
    assert waiting.status.checkpoint_request is not None
    value = waiting.status.checkpoint_request.value
    d, _ = run(waiting, pods=asked(gang(0), value), now=at(8), checkpoint=served(value))
    assert d.launch is not None and d.launch.data == 1 and sorted(d.launch.assignments.values()) == ["n4", "n5"]
    recovering = d.status.condition(C.RECOVERING)
    assert recovering is not None and "n2, n3 cordoned" in recovering.message and "data 2 -> 1" in recovering.message


@pytest.mark.parametrize(
    "why", ["no room elsewhere", "room only for a smaller gang", "the operator is told not to", "a pod is Pending"]
)
def test_a_cordoned_node_leaves_the_gang_where_it_is(why: str) -> None:
    obs = cordoned(replace(running_job(), planner=OffCordoned(["n4", "n5", "n6", "n7"])), "n1")
    pods = gang(0)
    if why == "no room elsewhere":
        obs = replace(obs, planner=OffCordoned([]))
    elif why == "room only for a smaller gang":  # a cordon alone never shrinks a job (minData 1)
        obs = replace(obs, planner=OffCordoned(["n4", "n5"]))
    elif why == "the operator is told not to":
        obs = replace(obs, move_off_cordoned=False)
    else:
        pods = (*pods[:3], replace(pods[3], phase="Pending"))
    d, after = run(obs, pods=pods, now=at(5))
    assert d.launch is None and not d.delete and d.checkpoint_request is None
    assert after.status.checkpoint_request is None


def test_uncordoned_before_the_checkpoint_came_cancels_the_move() -> None:
    running = replace(running_job(), planner=OffCordoned(["n4", "n5", "n6", "n7"]))
    _, waiting = run(cordoned(running, "n1"), pods=gang(0), now=at(5))
    d, _ = run(replace(waiting, nodes=running.nodes), pods=gang(0), now=at(7))
    assert d.launch is None and not d.delete
    assert d.status.checkpoint_request is not None and d.status.checkpoint_request.state == "Cancelled"
