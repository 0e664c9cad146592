"""How the Actuator starts a gang's pods: all created gated, then released together; a single
pod (a one-pod gang, an in-place restart's replacement) created ungated in one call, except
under Kueue, whose own gates the release removes too; with `--pod-binding operator`, created
bound to their planned nodes."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import TrainingJobStatus
from topotrain.controller.act import Actuator
from topotrain.controller.settings import Settings
from topotrain.controller.snapshot import Ledger
from topotrain.core.decision import Decision, Launch
from topotrain.core.manifests import GANG_GATE


class RecordingKube:
    """The unit-test boundary: records the pod calls, the API server accepts everything."""

    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []
        self.released: list[str] = []

    def apply(self, manifest: dict[str, Any]) -> None:
        pass

    def apply_all(self, manifests: list[dict[str, Any]]) -> None:
        for manifest in manifests:
            self.apply(manifest)

    def create_pods(self, manifests: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
        self.created += manifests
        return [m["metadata"]["name"] for m in manifests], {}

    def release_pods(self, namespace: str, names: list[str]) -> list[str]:
        self.released += names
        return []


def spec(data: int) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "trainer:1", "parallelism": {"tensor": 8, "pipeline": 1, "data": data},
        "worker": {"gpusPerPod": 8},
    })


@pytest.mark.parametrize(("pods", "only", "release", "queued", "gated", "released"), [
    (1, (), True, False, False, []),  # a one-pod gang: one call
    (2, (), True, False, True, ["llm-0-0", "llm-0-1"]),  # a gang: gated, then released together
    (2, (1,), True, False, False, []),  # one replacement pod
    (1, (), True, True, True, ["llm-0-0"]),  # under Kueue: released (Kueue's gates too)
    (1, (), False, False, True, []),  # older pods still hold the node: a later pass releases it
])
def test_pods_are_gated_unless_one_pod_starts_alone(pods: int, only: tuple[int, ...], release: bool,
                                                   queued: bool, gated: bool, released: list[str]) -> None:
    kube = RecordingKube()
    ledger = Ledger()
    actuator = Actuator(kube=kube, settings=Settings(), ledger=ledger)  # type: ignore[arg-type]
    actuator.queued = queued
    launch = Launch(attempt=0, data=pods, pool="H100-80GB", assignments={i: f"n{i}" for i in range(pods)},
                    resume_step=None, mode="initial", only=only, release=release)
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "u"}}
    assert actuator.apply(("team", "llm"), body, spec(pods), Decision(status=TrainingJobStatus(), launch=launch)) == {}
    assert len(kube.created) == len(only or range(pods))
    for manifest in kube.created:
        assert (manifest["spec"].get("schedulingGates") == [{"name": GANG_GATE}]) is gated
    assert kube.released == released
    # the ledger holds the pods as created: a gated entry would be "released" again by a pass
    assert all(bool(slim["spec"]["schedulingGates"]) is gated for _, slim in ledger.unseen(lambda *_: False))


@pytest.mark.parametrize(("only", "release", "queued", "bound"), [
    ((), True, False, True),  # a gang on free nodes: created bound, nothing to release
    ((1,), True, False, True),  # one replacement pod: bound to its planned node
    ((), True, True, False),  # under Kueue: gated for Kueue, the scheduler binds
    ((), False, False, False),  # older pods still hold the nodes: gated, released later
])
def test_with_operator_binding_a_free_gang_is_created_on_its_planned_nodes(
        only: tuple[int, ...], release: bool, queued: bool, bound: bool) -> None:
    """`--pod-binding operator`: a gang whose nodes are free is created with spec.nodeName set to
    each pod's planned node and no gate (no release call, no scheduler bind); a queued gang or
    one waiting on older pods keeps the gated path."""
    kube, ledger = RecordingKube(), Ledger()
    actuator = Actuator(kube=kube, settings=Settings(pod_binding="operator"), ledger=ledger)  # type: ignore[arg-type]
    actuator.queued = queued
    launch = Launch(attempt=0, data=2, pool="H100-80GB", assignments={0: "n0", 1: "n1"},
                    resume_step=None, mode="initial", only=only, release=release)
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "u"}}
    assert actuator.apply(("team", "llm"), body, spec(2), Decision(status=TrainingJobStatus(), launch=launch)) == {}
    indices = only or (0, 1)
    assert len(kube.created) == len(indices)
    for manifest, i in zip(kube.created, indices, strict=True):
        assert manifest["spec"].get("nodeName") == (f"n{i}" if bound else None)
        assert bool(manifest["spec"].get("schedulingGates")) is not bound
    assert kube.released == ([] if bound or not release else [f"llm-0-{i}" for i in indices])
    # the ledger holds each bound pod on its node, as the fleet's accounting will once watched
    held = {slim["metadata"]["name"]: slim["spec"]["nodeName"] for _, slim in ledger.unseen(lambda *_: False)}
    assert held == {f"llm-0-{i}": (f"n{i}" if bound else None) for i in indices}


def test_a_released_gang_is_not_released_again_while_the_watch_catches_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass after a launch often still sees the pods gated (their change is not in the watch
    yet) and decides to release them: the Actuator skips what it released moments ago (in a
    burst of 100 new jobs every gang was released twice), and releases them again later."""
    from topotrain.controller import act

    kube = RecordingKube()
    actuator = Actuator(kube=kube, settings=Settings(), ledger=Ledger())  # type: ignore[arg-type]
    launch = Launch(attempt=0, data=2, pool="H100-80GB", assignments={0: "n0", 1: "n1"},
                    resume_step=None, mode="initial")
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "u"}}
    actuator.apply(("team", "llm"), body, spec(2), Decision(status=TrainingJobStatus(), launch=launch))
    assert kube.released == ["llm-0-0", "llm-0-1"]
    again = Decision(status=TrainingJobStatus(), release=["llm-0-0", "llm-0-1"])
    actuator.apply(("team", "llm"), body, spec(2), again)
    assert kube.released == ["llm-0-0", "llm-0-1"], "released twice"
    monkeypatch.setattr(act, "RELEASED_MEMORY", 0.0)  # long after: still gated, so released
    actuator.apply(("team", "llm"), body, spec(2), again)
    assert kube.released == ["llm-0-0", "llm-0-1"] * 2


class SlowKube(RecordingKube):
    """The unit-test boundary: the API server takes its time creating the pods (until `go`)."""

    def __init__(self) -> None:
        super().__init__()
        self.creating, self.go = threading.Event(), threading.Event()

    def create_pods(self, manifests: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
        self.creating.set()
        assert self.go.wait(10)
        return super().create_pods(manifests)


def test_a_loop_cancelled_while_its_pods_are_created_keeps_their_holds_until_the_creates_end() -> None:
    """A job's loop cancelled (its job deleted, the operator stopping) while its API thread still
    creates a gang: the GPUs those pods take stay held in the ledger (another job's plan must not
    take them) until the creates have returned, and the created pods' holds stay until the watch
    shows them; a loop that ends with nothing in flight forgets its entries at once."""
    kube, ledger = SlowKube(), Ledger()
    actuator = Actuator(kube=kube, settings=Settings(), ledger=ledger)  # type: ignore[arg-type]
    launch = Launch(attempt=0, data=2, pool="H100-80GB", assignments={0: "n0", 1: "n1"},
                    resume_step=None, mode="initial")
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "u"}}
    decision = Decision(status=TrainingJobStatus(), launch=launch)
    actuator.reserve(("team", "llm"), body, spec(2), decision)  # under the plan lock

    def held() -> set[str]:
        return {slim["metadata"]["name"] for _, slim in ledger.unseen(lambda *_: False)}

    async def cancelled_mid_create() -> None:
        task = asyncio.create_task(actuator.apply_in_thread(("team", "llm"), body, spec(2), decision))
        await asyncio.to_thread(kube.creating.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        actuator.job_ended("team", "u")  # the loop's end (JobLoop.run)
        assert held() == {"llm-0-0", "llm-0-1"}, "the GPUs being taken are still held"
        kube.go.set()
        for _ in range(200):
            if len(kube.released) == 2:
                break
            await asyncio.sleep(0.01)

    asyncio.run(cancelled_mid_create())
    assert [m["metadata"]["name"] for m in kube.created] == ["llm-0-0", "llm-0-1"]
    time.sleep(0.1)  # (the worker thread's last lines after the release)
    assert held() == {"llm-0-0", "llm-0-1"}, "created pods hold their GPUs until the watch shows them"

    idle = Actuator(kube=RecordingKube(), settings=Settings(), ledger=ledger)  # type: ignore[arg-type]
    idle.job_ended("team", "u")
    assert held() == set(), "nothing in flight: the ended job's entries are forgotten at once"
