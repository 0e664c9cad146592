"""Which job loops a watch event wakes (handlers_jobs.Operator): a job's own pods always;
freed GPUs and node changes only the jobs they can affect."""

from __future__ import annotations

import asyncio

from topotrain.api import TrainingJobSpec
from topotrain.handlers_jobs import Operator, wants_capacity
from topotrain.settings import Settings
from topotrain.status import CurrentParallelism, TrainingJobStatus

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
    op.forget(growing)
    op.wake_for_node("n3")
    assert woken() == set()
