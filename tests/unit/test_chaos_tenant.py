"""Invariant 13 (testbed/chaos/checkers_tenant.py) on hand-written histories: the soak's
jobs recover from their own crashes as fast during another namespace's tarpit as outside
it; a stall while the tarpit lasts, or a tarpit the operator never reached, is named."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from testbed.chaos.catalogue import ISSUE_37, Kind, schedule
from testbed.chaos.checkers_tenant import check_tenant_isolation
from testbed.chaos.tenant import delete_until_gone, job_manifest, tarpit_jobs
from testbed.chaos.timeline import Timeline

NS = "chaos-x"
T0 = 1_000_000.0
WINDOW = (T0 + 1000, T0 + 1200)


def crash(index: int, job: str, at: float, seconds: float) -> list[dict[str, Any]]:
    """A trainer crash of `job` at `at`; its next attempt steps `seconds` later."""
    events = [{"event": "step", "step": 5, "attempt": 0, "time": at - 1},
              {"event": "start", "attempt": 1, "resume": 0, "time": at + 1},
              {"event": "step", "step": 1, "attempt": 1, "time": at + seconds}]  # fmt: skip
    return [{"t": at, "type": "fault", "index": index, "kind": Kind.TRAINER_CRASH.value, "jobs": [job]},
            {"t": at + seconds + 5, "type": "trainer-events", "job": job, "events": events}]  # fmt: skip


def history(during: float, requests: int = 7) -> list[dict[str, Any]]:
    """Six crashes outside the tarpit recovering in 10-14 s, five during it in `during` s."""
    records: list[dict[str, Any]] = []
    for i in range(6):
        records += crash(i, f"out-{i}", T0 + 100 * i, 10 + i % 5)
    records.append({"t": WINDOW[0], "type": "fault", "index": 50, "kind": Kind.TENANT_TARPIT.value,
                    "jobs": [], "namespace": f"{NS}-tenant", "tenant_jobs": 16})  # fmt: skip
    for i in range(5):
        records += crash(60 + i, f"in-{i}", WINDOW[0] + 20 + 30 * i, during)
    records.append({"t": WINDOW[1], "type": "heal", "index": 50, "kind": Kind.TENANT_TARPIT.value,
                    "requests": requests, "most_trickling": 2})  # fmt: skip
    return records


def judge(records: list[dict[str, Any]]) -> Any:
    return check_tenant_isolation(Timeline.of(records, NS))


def test_recoveries_as_fast_during_the_tarpit_hold_the_invariant() -> None:
    found = judge(history(during=12))
    assert found.ok and found.checked == 5, found.line()


def test_recoveries_that_wait_out_the_tarpit_are_a_violation() -> None:
    found = judge(history(during=60))  # a store-read deadline (30 s) and more over the usual 10-14 s
    assert not found.ok
    assert any("during a tenant tarpit" in d for d in found.details)
    assert any("usual median" in d for d in found.details)


def test_slower_recoveries_short_of_a_stall_are_judged_by_their_median() -> None:
    found = judge(history(during=40))  # under 14 + 30 s: no stall, but 3x the usual median
    assert not found.ok and not any("during a tenant tarpit" in d for d in found.details)
    assert any("usual median" in d for d in found.details)


def dense(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every crash overlapped by a second fault of the same job, 2 s after it (the long form's
    density): no recovery is clean, so the clean tier has nothing to judge."""
    crashes = [r for r in records if r["type"] == "fault" and r["kind"] == Kind.TRAINER_CRASH.value]
    shadows = [{**r, "t": r["t"] + 2, "index": 1000 + r["index"]} for r in crashes]
    heals = [{"t": r["t"] + 30, "type": "heal", "index": 1000 + r["index"], "kind": r["kind"]} for r in crashes]
    return sorted(records + shadows + heals, key=lambda r: r["t"])


@pytest.mark.parametrize(("during", "ok"), [(12, True), (60, False)])
def test_at_long_form_density_the_recoveries_are_judged_like_for_like(during: float, ok: bool) -> None:
    found = judge(dense(history(during=during)))
    assert found.ok is ok, found.line()
    assert any("judged at matched density" in n for n in found.notes), found.notes
    assert found.checked >= 5
    if not ok:  # both the stalls and the pooled medians say so
        assert any("during a tenant tarpit" in d for d in found.details), found.details
        assert any("took" in d and "x those outside" in d for d in found.details), found.details


def test_a_tarpit_the_operator_never_reached_proves_nothing() -> None:
    found = judge(history(during=12, requests=0))
    assert not found.ok and "no request" in found.details[0]


def test_without_a_tenant_tarpit_nothing_is_judged() -> None:
    records = [r for r in history(during=40) if r.get("index") != 50]
    found = judge(records)
    assert found.ok and found.checked == 0


def test_the_tenant_fault_is_drawn_by_the_long_form_and_not_by_the_bounded_soak() -> None:
    assert Kind.TENANT_TARPIT in ISSUE_37
    drawn = {f.kind for f in schedule(3701, 400, 1.2)}
    assert Kind.TENANT_TARPIT in drawn
    plan = schedule(7, 400, 1.0, {Kind.TENANT_TARPIT, Kind.TRAINER_CRASH})
    tarpits = [f for f in plan if f.kind == Kind.TENANT_TARPIT]
    assert all(a.at + a.duration <= b.at for a, b in itertools.pairwise(tarpits))  # one at a time


def test_the_tenant_jobs_take_no_gpu_of_the_soak_and_name_the_tarpit() -> None:
    body = job_manifest("tarpit-0001-00", f"{NS}-tenant", "http://127.0.0.1:4000")
    assert body["spec"]["checkpoint"]["endpoint"] == "http://127.0.0.1:4000"
    assert body["spec"]["worker"]["nodeSelector"] == {"topotrain.io/chaos-tenant": "no-such-pool"}
    sizes = {tarpit_jobs(f) for f in schedule(5, 300, 1.0, {Kind.TENANT_TARPIT})}
    assert min(sizes) >= 8 and max(sizes) == 16


def test_a_heals_delete_is_asked_again_while_the_api_server_is_away() -> None:
    """The soak with Kueue, seed 3702: an apiserver-restart during a kueue-preempt's heal left its
    preemptor Workload behind, holding the queue's quota for good."""
    calls: list[str] = []

    def flaky() -> None:
        calls.append("x")
        if len(calls) < 3:
            raise ConnectionRefusedError("the API server is restarting")

    delete_until_gone(flaky, pause=0.0)
    assert len(calls) == 3

    def gone() -> None:
        raise ApiException(status=404)

    delete_until_gone(gone, pause=0.0)  # already gone: done

    def refused() -> None:
        raise ApiException(status=403)

    with pytest.raises(ApiException):
        delete_until_gone(refused, pause=0.0)
