"""A job's passes read its rank table (a GET of the `<job>-ranks` ConfigMap) only when a decision
needs it: a restart, an in-place replacement, a gang still being created, a launch. Before, every
pass of every job made that GET, a Running job's heartbeat included: at 5,000 nodes and 200 jobs
about a quarter of the operator's API requests (bench/scale.py, "API requests/job").

`TableKube` is a fake of the operator's API client at the unit-test boundary; the real API server's
side of the same passes runs in the integration and end-to-end suites."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from topotrain.controller.indexes import job_pods_key, slim_pod
from topotrain.controller.process import Operator
from topotrain.controller.settings import Settings
from topotrain.core.decision import UNREAD, NeedsRankTable
from topotrain.core.manifests import NODE_ANNOTATION
from topotrain.core.rank_table import RankTable, parse_rank_table

from tests.unit.test_ownership import SPEC as GANG
from tests.unit.test_ownership import node
from tests.unit.test_reconcile import gang, observed, run

KEY = ("team", "llm")


class TableKube:
    """The API client at the unit-test boundary (a fake): keeps the rank table the operator
    applies and counts its reads; pods it is asked to create are recorded (the test puts them in
    the watch indexes, as the watch would)."""

    def __init__(self) -> None:
        self.table: Mapping[str, Any] | None = None
        self.table_reads = 0
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.relabeled: list[str] = []
        self.writes: list[dict[str, Any]] = []

    def existing(self, kind: str, namespace: str, name: str) -> None:
        return None

    def rank_table(self, namespace: str, job: str, uid: str | None = None) -> RankTable | None:
        self.table_reads += 1
        if self.table is None:
            return None
        parsed = parse_rank_table({**self.table.get("data", {}), **self.table.get("binaryData", {})})
        return None if parsed is None else RankTable(*parsed)

    def apply(self, manifest: Mapping[str, Any]) -> None:
        if manifest["kind"] == "ConfigMap":
            self.table = copy.deepcopy(dict(manifest))

    def apply_all(self, manifests: list[Mapping[str, Any]]) -> None:
        for manifest in manifests:
            self.apply(manifest)

    def create_pods(self, manifests: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
        self.created += copy.deepcopy(manifests)
        return [m["metadata"]["name"] for m in manifests], {}

    def release_pods(self, namespace: str, names: list[str]) -> list[str]:
        return []

    def delete_pods(self, namespace: str, names: list[str], grace_seconds: int,
                    seen: Mapping[str, tuple[str, str]] | None = None) -> list[str]:
        self.deleted += names
        return []

    def each_pod(self, names: list[str], call: Any) -> list[str]:
        self.relabeled += names  # an in-place restart moves the kept pods onto its attempt
        return []

    def patch_status(self, namespace: str, name: str, old: Mapping[str, Any], new: Mapping[str, Any],
                     uid: str | None = None, resource_version: str | None = None) -> str:
        self.writes.append(dict(new))
        return str(len(self.writes))


def shown(manifest: Mapping[str, Any], *, gated: bool, phase: str = "Running", exit_code: int | None = None
          ) -> dict[str, Any]:
    """The pod as the watch would show it: gated and pending, or bound to its planned node."""
    body = copy.deepcopy(dict(manifest))
    body["metadata"]["uid"] = f"uid-{body['metadata']['name']}"
    planned = body["metadata"]["annotations"][NODE_ANNOTATION]
    if gated:
        body["status"] = {"phase": "Pending"}
    else:
        body["spec"]["schedulingGates"] = []
        body["spec"]["nodeName"] = planned
        body["status"] = {"phase": phase}
        if exit_code is not None:
            body["status"]["containerStatuses"] = [
                {"name": "trainer", "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}}}]
    return slim_pod(body)


def indexes(pods: list[dict[str, Any]]) -> tuple[dict[Any, list[dict[str, Any]]], dict[Any, list[dict[str, Any]]]]:
    """kopf's indexes at the boundary: every pod under "all" and under its job."""
    return ({"all": pods, job_pods_key(KEY): pods}, {"all": [node("n0"), node("n1"), node("n2")]})


def test_a_running_jobs_passes_never_read_its_rank_table_and_a_failure_pass_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from topotrain.controller import loop as loop_module
    from topotrain.controller.loop import JobLoop

    monkeypatch.setattr(loop_module.kopf, "event", lambda *a, **kw: None)
    kube = TableKube()
    op = Operator(settings=Settings(), kube=kube)  # type: ignore[arg-type]
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1", "generation": 1},
            "spec": GANG.model_dump(by_alias=True, exclude_none=True)}  # fmt: skip
    loop = JobLoop(op, KEY, body)  # type: ignore[arg-type]

    asyncio.run(loop.pass_once(*indexes([])))  # type: ignore[arg-type]
    assert len(kube.created) == 2 and kube.table is not None, "the first pass launches the gang"
    reads = kube.table_reads

    # Both pods gated and none missing: released, without the table.
    asyncio.run(loop.pass_once(*indexes([shown(m, gated=True) for m in kube.created])))  # type: ignore[arg-type]
    running = [shown(m, gated=False) for m in kube.created]
    for _ in range(5):  # a Running job's passes
        asyncio.run(loop.pass_once(*indexes(running)))  # type: ignore[arg-type]
    assert kube.writes[-1]["phase"] == "Running", kube.writes[-1]
    assert kube.table_reads == reads, "a pass that needed no rank table read it"

    # Pod 1 vanished (deleted behind the operator's back): where it ran is in the rank table only,
    # and the restart re-plans the gang from it: that pass reads the table.
    asyncio.run(loop.pass_once(*indexes(running[:1])))  # type: ignore[arg-type]
    assert kube.table_reads == reads + 1
    assert kube.writes[-1]["phase"] != "Running", kube.writes[-1]
    assert kube.relabeled == [kube.created[0]["metadata"]["name"]], "the healthy pod is not kept in place"


def test_a_new_jobs_launch_reads_no_rank_table_and_a_restarted_operators_first_pass_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job with no status yet has no child of the operator's (the status is written before any
    child is made): its launching pass does not GET the rank table it is about to write (one
    round trip less on a busy API server, where a new job's first pass took over a second). A
    loop that starts on a job whose status was written (an operator restarted) reads it."""
    from topotrain.controller import loop as loop_module
    from topotrain.controller.loop import JobLoop

    monkeypatch.setattr(loop_module.kopf, "event", lambda *a, **kw: None)
    kube = TableKube()
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1", "generation": 1},
            "spec": GANG.model_dump(by_alias=True, exclude_none=True)}  # fmt: skip
    loop = JobLoop(Operator(settings=Settings(), kube=kube), KEY, body)  # type: ignore[arg-type]
    asyncio.run(loop.pass_once(*indexes([])))  # type: ignore[arg-type]
    assert len(kube.created) == 2 and kube.table is not None, "the first pass launches the gang"
    assert kube.table_reads == 0

    restarted = JobLoop(Operator(settings=Settings(), kube=kube), KEY,  # type: ignore[arg-type]
                        {**body, "status": kube.writes[-1]})
    asyncio.run(restarted.pass_once(*indexes([shown(m, gated=False) for m in kube.created])))  # type: ignore[arg-type]
    assert kube.table_reads == 1
    assert kube.writes[-1]["phase"] == "Running" and len(kube.created) == 2


def test_a_decision_that_needs_the_unread_table_asks_for_it_and_decides_from_it() -> None:
    """Finishing a half-created gang needs the table's assignments: taken as absent, the attempt
    would start over (every gated pod deleted). Unread, the decision asks for it instead."""
    _, obs = run(observed())
    half = tuple(replace(p, resume_step="200") for p in gang(0, phase="Pending", gated=True)[:2])
    with pytest.raises(NeedsRankTable):
        run(obs, pods=half, rank_table=UNREAD)
    table = RankTable(0, 2, {i: f"n{i}" for i in range(4)})
    d, _ = run(obs, pods=half, rank_table=table)
    assert d.launch is not None and d.launch.only == (2, 3) and not d.delete
    # A complete gated gang is released without it; a Running one decides without it.
    d, _ = run(obs, pods=gang(0, phase="Pending", gated=True), rank_table=UNREAD)
    assert sorted(d.release) == [f"job-0-{i}" for i in range(4)]
    d, _ = run(obs, pods=gang(0), rank_table=UNREAD)
    assert d.status.phase == "Running" and not d.delete and d.launch is None
