"""A pass's writes are fenced: the status write carries the resourceVersion the pass decided
from, is made even when the status did not change if pods follow, and a refusal ends the pass
before any pod is touched.

`FencedKube` is a fake of the operator's API client at the unit-test boundary; the API server's
own refusals are shown in tests/integration/test_operator_leadership.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from topotrain.api.status import TrainingJobStatus
from topotrain.controller.kube import ApiException, StaleWrite
from topotrain.controller.process import Operator
from topotrain.controller.settings import Settings

from tests.unit.test_ownership import SPEC as GANG
from tests.unit.test_ownership import node


class FencedKube:
    """The API client at the unit-test boundary (a fake): status writes are recorded with the
    resourceVersion they test, and refused as stale while `stale`; pod calls are recorded."""

    def __init__(self, stale: bool = False) -> None:
        self.stale = stale
        self.writes: list[tuple[dict[str, Any], str | None]] = []
        self.pod_calls: list[str] = []

    def patch_status(self, namespace: str, name: str, old: Mapping[str, Any], new: Mapping[str, Any],
                     uid: str | None = None, resource_version: str | None = None) -> str:
        if self.stale:
            raise StaleWrite("TrainingJob changed since it was read", ApiException(status=409))
        self.writes.append((dict(new), resource_version))
        return str(100 + len(self.writes))

    def existing(self, kind: str, namespace: str, name: str) -> None:
        return None

    def rank_table(self, namespace: str, job: str, uid: str | None = None) -> None:
        return None

    def apply(self, manifest: Mapping[str, Any]) -> None:
        self.pod_calls.append(f"apply {manifest['kind']}")

    def apply_all(self, manifests: list[Mapping[str, Any]]) -> None:
        for manifest in manifests:
            self.apply(manifest)

    def create_pods(self, manifests: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
        self.pod_calls += [f"create {m['metadata']['name']}" for m in manifests]
        return [m["metadata"]["name"] for m in manifests], {}

    def release_pods(self, namespace: str, names: list[str]) -> list[str]:
        self.pod_calls += [f"release {n}" for n in names]
        return []


def test_an_unchanged_status_is_still_written_with_its_version_when_pods_follow() -> None:
    kube = FencedKube()
    op = Operator(settings=Settings(), kube=kube)  # type: ignore[arg-type]
    key, status = ("team", "llm"), TrainingJobStatus(phase="Running")
    version = asyncio.run(op.write_status(key, "uid-1", status, "41"))
    assert kube.writes[-1][1] == "41" and version == "101"
    # Nothing changed and no pod follows: no write.
    assert asyncio.run(op.write_status(key, "uid-1", status, version)) == "101"
    assert len(kube.writes) == 1
    # Nothing changed, but the pass goes on to touch pods: written, testing the version.
    assert asyncio.run(op.write_status(key, "uid-1", status, version, fenced=True)) == "102"
    assert kube.writes[-1] == (status.to_wire(), "101")


def test_a_stale_status_write_ends_the_pass_before_any_pod_is_created(monkeypatch: pytest.MonkeyPatch) -> None:
    from topotrain.controller import loop as loop_module
    from topotrain.controller.loop import JobLoop

    monkeypatch.setattr(loop_module.kopf, "event", lambda *a, **kw: None)
    kube = FencedKube(stale=True)
    op = Operator(settings=Settings(), kube=kube)  # type: ignore[arg-type]
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1", "generation": 1,
                         "resourceVersion": "7"},
            "spec": GANG.model_dump(by_alias=True, exclude_none=True)}  # fmt: skip
    loop = JobLoop(op, ("team", "llm"), body)  # type: ignore[arg-type]
    indexes = ({"all": []}, {"all": [node("n0"), node("n1"), node("n2")]})  # kopf's, at the boundary
    with pytest.raises(StaleWrite):
        asyncio.run(loop.pass_once(*indexes))  # type: ignore[arg-type]
    assert kube.pod_calls == [], "pods were touched after the status write was refused"
    assert op.ledger.unseen(lambda job, pod: False) == [], "the refused launch still holds GPUs"
    # The next pass, from a fresh read, goes through and launches the gang.
    kube.stale = False
    asyncio.run(loop.pass_once(*indexes))  # type: ignore[arg-type]
    assert kube.writes[0][1] == "7" and any(c.startswith("create ") for c in kube.pod_calls)
