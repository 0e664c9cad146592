"""Status transitions applied in one place (core/transitions.py): a pass's steps collect what
should change, `settle` gives the one status write; what the controller learns acting on a
decision (refused or accepted pods, a checkpoint prefix taken over) is an input of the next
pass, which says it in that pass's own single write."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason, TrainingJobStatus
from topotrain.checkpoints import PrefixOwner
from topotrain.controller.process import Operator
from topotrain.controller.settings import Settings
from topotrain.core.decision import Decision, PodsAccepted
from topotrain.core.reconcile import reconcile
from topotrain.core.reconcile_status import StatusBuilder
from topotrain.core.transitions import refusal_condition, reject_spec, settle

from tests.unit.test_reconcile import observed

T0 = datetime(2026, 1, 1, tzinfo=UTC)
QUOTA = "403: pods \"job-0-3\" is forbidden: exceeded quota: gpus"


def seen(status: TrainingJobStatus) -> dict[str, Any]:
    """What `kubectl get tj -o yaml` shows of the status."""
    return status.to_wire()


def test_two_steps_that_set_conditions_give_one_write_with_both() -> None:
    sb = StatusBuilder(TrainingJobStatus(), generation=3, now=T0)
    sb.config_invalid(Reason.SECRET_NOT_FOUND, "secret s3 not found")  # one step
    sb.admission(False, "Pending", "waiting for quota in queue q")  # another
    decision = settle(Decision(status=sb.status), sb)
    conds = {c.type: c for c in decision.status.conditions}
    assert conds[C.CONFIG_VALID].status == "False" and conds[C.ADMITTED].status == "False"
    assert conds[C.CONFIG_VALID].observed_generation == 3
    assert conds[C.ADMITTED].last_transition_time == "2026-01-01T00:00:00.000Z"
    # status.reason speaks of the condition that explains the phase, once both are in
    assert (decision.status.reason, decision.status.message) == (Reason.SECRET_NOT_FOUND, "secret s3 not found")
    assert decision.events == [("Warning", Reason.SECRET_NOT_FOUND, "secret s3 not found"),
                               ("Normal", "Pending", "waiting for quota in queue q")]
    # Settling again adds nothing: an Event marks a flip, never a repeat.
    again = StatusBuilder(decision.status, 3, T0 + timedelta(seconds=5))
    again.config_invalid(Reason.SECRET_NOT_FOUND, "secret s3 not found")
    assert settle(Decision(status=again.status), again).events == []


def test_the_api_servers_refusals_map_to_reasons_a_user_can_act_on() -> None:
    assert refusal_condition({"job-0-3": QUOTA}).reason == Reason.QUOTA_EXCEEDED
    assert refusal_condition({"a": "422: spec.resources: invalid"}).reason == Reason.POD_SPEC_INVALID
    assert refusal_condition({"a": "409: pod a exists and is not owned by this TrainingJob"}).reason == (
        Reason.FOREIGN_OBJECT)
    two = refusal_condition({"b": "500: webhook down", "a": "500: webhook down"})
    assert two.reason == Reason.POD_CREATE_REFUSED
    assert two.message == "the API server refused pod a (+1 more): 500: webhook down; the gang was not started"


def _launched() -> tuple[Any, Decision]:
    obs = observed()
    first = reconcile(obs)
    assert first.launch is not None and first.status.phase == "Starting"
    return obs, first


def test_a_refusal_is_said_by_the_next_pass_as_the_edge_once_said_it() -> None:
    obs, first = _launched()
    refusal = refusal_condition({"job-0-3": QUOTA})
    at = obs.now + timedelta(milliseconds=50)
    # What the controller used to write itself after acting: the launch's status, refused.
    edge = StatusBuilder(first.status, obs.generation, at)
    edge.pods_refused(refusal.reason, refusal.message)
    edge.summarize()
    after = reconcile(replace(obs, status=first.status, now=at, refusal=refusal, last_refusal=at))
    assert seen(after.status) == seen(edge.status)
    assert after.status.phase == "Pending" and after.status.start_time is None
    assert after.status.reason == Reason.QUOTA_EXCEEDED
    assert after.launch is None and after.requeue_after is not None  # the create is retried later
    assert ("Warning", Reason.QUOTA_EXCEEDED, refusal.message) in after.events


def test_pods_accepted_after_a_refusal_clear_it_though_the_pods_never_show() -> None:
    obs, first = _launched()
    refused = reconcile(replace(obs, status=first.status, refusal=refusal_condition({"job-0-3": QUOTA}),
                                last_refusal=obs.now))
    # A later launch is accepted whole; its pods are gone before any pass sees them.
    later = obs.now + timedelta(seconds=20)
    relaunch = reconcile(replace(obs, status=refused.status, now=later))
    assert relaunch.launch is not None
    accepted = reconcile(replace(obs, status=relaunch.status, now=later,
                                 accepted=PodsAccepted(relaunch.launch.attempt, 4)))
    created = accepted.status.condition(C.PODS_CREATED)
    assert created is not None and (created.status, created.reason) == ("True", Reason.PODS_CREATED_OK)
    assert created.message == "attempt 0: 4 pods created"


def test_a_prefix_taken_over_is_said_once_in_status_and_in_one_event() -> None:
    obs, first = _launched()
    record = PrefixOwner(uid="new", created=T0, resumed_uid="old-uid", resumed_step=100)
    taken = reconcile(replace(obs, status=first.status, took_over=record))
    assert taken.status.resumed_from is not None
    assert (taken.status.resumed_from.uid, taken.status.resumed_from.step) == ("old-uid", 100)
    said = [e for e in taken.events if e[1] == Reason.RESUMED_FOREIGN]
    assert said and "TrainingJob uid old-uid, from step 100" in said[0][2]
    again = reconcile(replace(obs, status=taken.status, took_over=record))
    assert not [e for e in again.events if e[1] == Reason.RESUMED_FOREIGN]


def test_a_spec_that_does_not_parse_sets_config_valid_and_nothing_else() -> None:
    _, first = _launched()
    rejected = reject_spec(first.status, ["1 validation error", "parallelism.tensor", "  bad"], T0)
    cond = rejected.status.condition(C.CONFIG_VALID)
    assert cond is not None and (cond.status, cond.reason) == ("False", Reason.INVALID_SPEC)
    assert cond.message == "1 validation error parallelism.tensor   bad"
    others = [c for c in rejected.status.conditions if c.type != C.CONFIG_VALID]
    assert others == [c for c in first.status.conditions if c.type != C.CONFIG_VALID]
    assert rejected.status.phase == first.status.phase and not rejected.events


# --- at the controller: one status write per pass ----------------------------------------------

class RefusingKube:
    """The API client at the unit-test boundary (a fake): refuses every pod create once, then
    creates them; records each status write."""

    def __init__(self) -> None:
        self.writes: list[dict[str, Any]] = []
        self.refuse = True

    def existing(self, kind: str, namespace: str, name: str) -> None:
        return None

    def rank_table(self, namespace: str, job: str, uid: str | None = None) -> None:
        return None

    def apply(self, manifest: Mapping[str, Any]) -> None:
        return None

    def apply_all(self, manifests: list[Mapping[str, Any]]) -> None:
        for manifest in manifests:
            self.apply(manifest)

    def create_pods(self, manifests: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
        names = [m["metadata"]["name"] for m in manifests]
        if self.refuse:
            self.refuse = False
            return names[1:], {names[0]: QUOTA}
        return names, {}

    def delete_pods(self, namespace: str, names: list[str], grace_seconds: int,
                    seen: Mapping[str, tuple[str, str]] | None = None) -> list[str]:
        return []

    def release_pods(self, namespace: str, names: list[str]) -> list[str]:
        return []

    def patch_status(self, namespace: str, name: str, old: Mapping[str, Any], new: Mapping[str, Any],
                     uid: str | None = None, resource_version: str | None = None) -> str:
        self.writes.append(dict(new))
        return str(len(self.writes))


def test_a_refused_pass_and_the_next_each_write_status_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from topotrain.controller import loop as loop_module
    from topotrain.controller.loop import JobLoop

    from tests.unit.test_ownership import SPEC as GANG
    from tests.unit.test_ownership import node

    events: list[tuple[str, str]] = []
    monkeypatch.setattr(loop_module.kopf, "event", lambda body, *, type, reason, message: events.append(
        (type, reason)))
    kube = RefusingKube()
    op = Operator(settings=Settings(), kube=kube)  # type: ignore[arg-type]
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1", "generation": 1},
            "spec": GANG.model_dump(by_alias=True, exclude_none=True)}  # fmt: skip
    loop = JobLoop(op, ("team", "llm"), body)  # type: ignore[arg-type]
    indexes = ({"all": []}, {"all": [node("n0"), node("n1"), node("n2")]})  # kopf's, at the boundary

    requeue = asyncio.run(loop.pass_once(*indexes))  # type: ignore[arg-type]
    assert len(kube.writes) == 1 and kube.writes[0]["phase"] == "Starting"  # intent, before acting
    assert requeue == 0.0, "the refusal is said by the next pass, at once"
    asyncio.run(loop.pass_once(*indexes))  # type: ignore[arg-type]
    assert len(kube.writes) == 2
    refused = kube.writes[1]
    assert refused["phase"] == "Pending" and refused["reason"] == Reason.QUOTA_EXCEEDED
    cond = next(c for c in refused["conditions"] if c["type"] == C.PODS_CREATED)
    assert cond["status"] == "False" and "exceeded quota" in cond["message"]
    assert ("Warning", Reason.QUOTA_EXCEEDED) in events
    # The retry, CREATE_RETRY seconds on, is accepted: one write says the gang is created.
    assert loop.last_refusal is not None
    loop.last_refusal -= timedelta(seconds=60)
    asyncio.run(loop.pass_once(*indexes))  # type: ignore[arg-type]
    asyncio.run(loop.pass_once(*indexes))  # type: ignore[arg-type]
    created = next(c for c in kube.writes[-1]["conditions"] if c["type"] == C.PODS_CREATED)
    assert created["status"] == "True", kube.writes[-1]
    assert len(kube.writes) == 4


def test_an_unparsable_spec_is_said_in_one_write() -> None:
    from topotrain.controller.loop import JobLoop

    kube = RefusingKube()
    op = Operator(settings=Settings(), kube=kube)  # type: ignore[arg-type]
    body = {"metadata": {"name": "llm", "namespace": "team", "uid": "uid-1", "generation": 1},
            "spec": {"image": "trainer:1", "parallelism": {"tensor": "many"}}}  # fmt: skip
    loop = JobLoop(op, ("team", "llm"), body)  # type: ignore[arg-type]
    assert asyncio.run(loop.pass_once({"all": []}, {"all": []})) is None  # type: ignore[arg-type]
    assert len(kube.writes) == 1
    cond = kube.writes[0]["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == (C.CONFIG_VALID, "False", Reason.INVALID_SPEC)
    assert "validation error" in cond["message"]
