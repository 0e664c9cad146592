"""Which job loops a watch event wakes (controller/process.py Operator): a job's own pods always;
freed GPUs and node changes only the jobs they can affect."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import CurrentParallelism, TrainingJobStatus
from topotrain.controller.process import Operator, wants_capacity
from topotrain.controller.settings import Settings

SPEC = TrainingJobSpec.model_validate({
    "image": "trainer:1", "parallelism": {"tensor": 8, "pipeline": 1, "data": 4, "minData": 1},
    "worker": {"gpusPerPod": 8},
})  # fmt: skip


def status(phase: str, data: int | None = None) -> TrainingJobStatus:
    par = None if data is None else CurrentParallelism(tensor=8, pipeline=1, data=data)
    return TrainingJobStatus(phase=phase, parallelism=par)


def test_only_jobs_that_could_move_on_want_capacity() -> None:
    assert wants_capacity(status("Pending"), SPEC)
    assert wants_capacity(status("Recovering", 4), SPEC)
    assert wants_capacity(status("Running", 2), SPEC)  # below spec: it may grow
    assert not wants_capacity(status("Running", 4), SPEC)
    assert not wants_capacity(status("Succeeded", 4), SPEC)
    assert not wants_capacity(status("Failed"), SPEC)
    assert not wants_capacity(status("Suspended"), SPEC)  # only its spec can move it on


def test_freed_gpus_and_node_changes_wake_only_the_jobs_they_can_affect() -> None:
    op = Operator(settings=Settings(), kube=None)  # type: ignore[arg-type]
    full, waiting, growing = ("ns", "full"), ("ns", "waiting"), ("ns", "growing")
    for key in (full, waiting, growing):
        op.wakers[key] = asyncio.Event()
    op.note(full, False, frozenset({"n1", "n2"}))
    op.note(waiting, True, frozenset())
    op.note(growing, True, frozenset({"n3"}))

    def woken() -> set[tuple[str, str]]:
        out = {k for k, e in op.wakers.items() if e.is_set()}
        for e in op.wakers.values():
            e.clear()
        return out

    op.wake_for_capacity()
    assert woken() == {waiting, growing}
    op.wake_for_node("n2")  # a node of the full-size job
    assert woken() == {full, waiting, growing}
    op.wake_for_node("n9")
    assert woken() == {waiting, growing}
    op.note(waiting, False, frozenset({"n9"}))  # placed and Running at full size now
    op.wake_for_capacity()
    assert woken() == {growing}
    op.forget(growing, op.wakers[growing])
    op.wake_for_node("n3")
    assert woken() == set()


def test_a_stopping_loop_leaves_the_state_of_its_re_created_namesake_alone() -> None:
    """A job deleted and re-created under its name: the new object's loop starts while the old
    one is still stopping. The old loop's end must not drop the new one's waker, capacity wish
    or written status, and the new loop never builds on the old object's status (CI saw a
    re-created job never start: the old loop's leftovers were taken for the new job's)."""
    op = Operator(settings=Settings(), kube=None)  # type: ignore[arg-type]
    key = ("ns", "llm")
    old_event = op.wakers[key] = asyncio.Event()
    op.written[key] = ("old-uid", {"phase": "Running", "startTime": "2026-12-03T10:49:13Z"})
    assert op.last_written(key, "new-uid") is None, "a namesake's status is not this object's"
    new_event = op.wakers[key] = asyncio.Event()  # the new object's loop starts
    op.written[key] = ("new-uid", {"phase": "Pending"})
    op.note(key, True, frozenset({"n1"}))
    op.forget(key, old_event)  # then the old loop ends
    assert op.wakers[key] is new_event and op.last_written(key, "new-uid") == {"phase": "Pending"}
    op.wake_for_capacity()
    assert new_event.is_set(), "the new job still wakes for capacity"
    op.forget(key, new_event)
    assert key not in op.wakers and key not in op.written and not op.wants_capacity


def test_a_resync_that_finds_a_ghost_wakes_its_job_and_the_jobs_waiting_for_capacity() -> None:
    from dataclasses import replace

    from topotrain.controller import snapshot

    ghost = {"metadata": {"name": "old-0-0", "namespace": "ns", "uid": "u1", "labels": {"topotrain.io/job": "old"}}}

    class Index(dict[str, list[dict[str, object]]]):  # kopf's index at the unit-test boundary
        pass

    class Lists:  # the API server's LISTs at the unit-test boundary: the pod is gone
        calls = 0

        def pod_uids(self, namespaces: tuple[str, ...], *, cached: bool) -> set[str]:
            Lists.calls += 1
            return set()

    op = Operator(settings=replace(Settings(), resync_seconds=60), kube=Lists())  # type: ignore[arg-type]
    old, waiting = ("ns", "old"), ("ns", "waiting")
    for key in (old, waiting):
        op.wakers[key] = asyncio.Event()
    op.note(waiting, True, frozenset())
    snapshot.SECOND_LOOK_SECONDS, saved = 0.0, snapshot.SECOND_LOOK_SECONDS
    try:
        asyncio.run(op.resync_if_due(Index(all=[ghost])))  # type: ignore[arg-type]
        assert Lists.calls == 0  # not due yet: the first resync waits for start-up
        op._next_resync = 0.0
        asyncio.run(op.resync_if_due(Index(all=[ghost])))  # type: ignore[arg-type]
    finally:
        snapshot.SECOND_LOOK_SECONDS = saved
    assert Lists.calls == 2 and op.ghosts.uids == {"u1"}
    assert op.wakers[old].is_set() and op.wakers[waiting].is_set()
    op.wakers[old].clear()
    asyncio.run(op.resync_if_due(Index(all=[ghost])))  # type: ignore[arg-type]
    assert Lists.calls == 2 and not op.wakers[old].is_set()  # the next one waits its interval


def test_only_a_decision_that_claims_gpus_needs_the_plan_lock() -> None:
    """JobLoop._decide says whether the decision planned or launches pods: only then is it made
    again under the process-wide lock; a Running job's pass never waits for another's plan."""
    from topotrain.controller.loop import JobLoop, WatchLook
    from topotrain.core.planning import WouldPlan

    from tests.unit.test_ownership import SPEC as GANG
    from tests.unit.test_ownership import job_pod, node

    op = Operator(settings=Settings(), kube=None)  # type: ignore[arg-type]
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1", "generation": 1},
            "spec": GANG.model_dump(by_alias=True, exclude_none=True)}  # fmt: skip
    loop = JobLoop(op, ("team", "llm"), body)  # type: ignore[arg-type]
    nodes = [node("n0"), node("n1"), node("n2")]

    def look(pods: list[dict[str, Any]]) -> Any:  # kopf's indexes at the unit-test boundary
        return WatchLook(op, ("team", "llm"), {"all": pods}, {"all": nodes}).take()  # type: ignore[arg-type]

    new, _, claims = loop._decide(GANG, TrainingJobStatus(), look([]), None, None, None)
    assert new.launch is not None and claims, "a new job plans and creates its gang"
    pods = [job_pod("uid-1", 0, i, node_name) for i, node_name in sorted(new.launch.assignments.items())]
    running, used, claims = loop._decide(GANG, new.status, look(pods), None, None, None)
    assert running.launch is None and not claims and running.status.phase == "Running"
    assert used == frozenset(new.launch.assignments.values())
    # The first look of a pass, without the lock, stops where it would plan (it is redone under
    # the lock); a Running job's pass decides without planning all the same.
    with pytest.raises(WouldPlan):
        loop._decide(GANG, TrainingJobStatus(), look([]), None, None, None, probe=True)
    probed, _, claims = loop._decide(GANG, new.status, look(pods), None, None, None, probe=True)
    assert probed.launch is None and probed.status.phase == "Running" and not claims



def test_a_locked_decision_reserves_its_launch_unless_the_store_is_stale() -> None:
    """Under the plan lock, one hop to the planner's own thread decides and records the launch's
    pods in the ledger; a launch of a job with a checkpoint store whose view is not fresh reserves
    nothing (the store is read again and the decision retaken)."""
    from topotrain.controller.loop import JobLoop, WatchLook

    from tests.unit.test_ownership import SPEC as GANG
    from tests.unit.test_ownership import node

    op = Operator(settings=Settings(), kube=None)  # type: ignore[arg-type]
    nodes = [node("n0"), node("n1"), node("n2")]
    checkpointed = TrainingJobSpec.model_validate(
        {**GANG.model_dump(by_alias=True, exclude_none=True), "checkpoint": {"uri": "s3://ckpt/runs"}})
    for spec, stale in ((GANG, False), (checkpointed, True)):
        body = {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1", "generation": 1},
                "spec": spec.model_dump(by_alias=True, exclude_none=True)}  # fmt: skip
        loop = JobLoop(op, ("team", "llm"), body)  # type: ignore[arg-type]
        take = WatchLook(op, ("team", "llm"), {"all": []}, {"all": nodes}).take()  # type: ignore[arg-type]
        decision, used, was_stale = op.planner.submit(
            loop._decide_locked, spec, TrainingJobStatus(), take, None, None, None, False).result(timeout=30)
        assert decision.launch is not None and used == frozenset(decision.launch.assignments.values())
        assert was_stale is stale
        pods = {f"llm-0-{i}" for i in decision.launch.assignments}
        assert {name for _, name in op.ledger.entries} == (set() if stale else pods)
        op.ledger.entries.clear()
