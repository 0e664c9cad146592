"""Invariant 10 (testbed.chaos.checkers_roll) on hand-written histories: after a spec roll,
no restart resumes from a step the replaced gang saved after the roll's step."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from testbed.chaos import checkers, checkers_roll
from testbed.chaos.catalogue import CLASSIC, GLOBAL, ISSUE_37, Kind, schedule
from tests.unit.test_chaos_checkers import T0, api, created, job, pod, s3, timeline


def tpod(attempt: int, template: str, resume: str | None, created_at: float, **kw: Any) -> dict[str, Any]:
    return {**pod("a", attempt, 0, resume=resume, created=created_at, **kw), "template": template}


def saved(t: float, *saves: tuple[int, float, int | None]) -> dict[str, Any]:
    """An S3 listing whose new markers name who saved them."""
    record = s3(t, {"a": [(step, m) for step, m, _ in saves]})
    return {**record, "saved": {"a": [list(s) for s in saves]}}


def rolled(resume: str | None, *, resaved_by_new_gang: bool = False) -> list[dict[str, Any]]:
    """Attempt 0 (spec A) saves 10 and 20; the roll to attempt 1 (spec B) restores 20; the old
    gang still saves 30 (after the roll restored 20) before it stops; attempt 1 crashes before
    its first commit and attempt 2 resumes from `resume`."""
    history = [
        created("a"),
        api(T0 + 1, [tpod(0, "A", None, T0 + 1)]),
        saved(T0 + 12, (10, T0 + 11, 0)),
        saved(T0 + 22, (20, T0 + 21, 0)),
        api(T0 + 25, [tpod(0, "A", None, T0 + 1, phase="Failed"), tpod(1, "B", "20", T0 + 25)]),
        saved(T0 + 27, (30, T0 + 26, 0)),
    ]
    if resaved_by_new_gang:
        history.append(saved(T0 + 40, (30, T0 + 39, 1)))
    history.append(api(T0 + 50, [tpod(1, "B", "20", T0 + 25, phase="Failed"), tpod(2, "B", resume, T0 + 50)]))
    return history


def test_a_restart_after_a_roll_from_the_rolls_step_passes() -> None:
    verdict = checkers_roll.check_roll_floor(timeline(rolled("20")))
    assert verdict.ok and verdict.checked == 1


def test_a_restart_after_a_roll_from_the_replaced_gangs_later_step_is_a_violation() -> None:
    verdict = checkers_roll.check_roll_floor(timeline(rolled("30")))
    assert not verdict.ok
    assert verdict.details == ("a attempt 2 resumed from step 30, saved by attempt 0 under the old spec "
                               "after the roll to attempt 1 restored step 20",)  # fmt: skip


def test_a_step_the_rolled_gang_saved_again_is_its_own() -> None:
    assert checkers_roll.check_roll_floor(timeline(rolled("30", resaved_by_new_gang=True))).ok


def test_the_saver_is_the_one_when_the_pods_were_created_not_later() -> None:
    # The new gang saves step 30 again only after attempt 2's pods were created: too late.
    history = rolled("30")
    history.append(saved(T0 + 60, (30, T0 + 59, 2)))
    assert not checkers_roll.check_roll_floor(timeline(history)).ok


def test_the_trainers_commit_events_name_a_saver_the_listings_missed() -> None:
    history = [r for r in rolled("30") if not (r["type"] == "s3" and r["t"] == T0 + 27)]
    events = [{"event": "commit", "step": 30, "attempt": 0, "time": T0 + 26.5}]
    history.append({"t": T0 + 99, "type": "trainer-events", "job": "a", "events": events})
    verdict = checkers_roll.check_roll_floor(timeline(history))
    assert not verdict.ok and "saved by attempt 0" in verdict.details[0]
    # Without any record of who saved it: a note, not a verdict.
    history.pop()
    verdict = checkers_roll.check_roll_floor(timeline(history))
    assert verdict.ok and "whose saver was never seen" in verdict.notes[0]


def test_an_attempt_with_pods_of_two_specs_is_a_violation() -> None:
    """Mixed run seed 119: a restart in place kept a pod of the old spec beside a new one."""
    history = rolled("20")
    history.append(api(T0 + 60, [tpod(3, "B", "20", T0 + 60), {**tpod(3, "A", "20", T0 + 60), "index": 1,
                                                                 "uid": "kept"}]))  # fmt: skip
    verdict = checkers_roll.check_roll_floor(timeline(history))
    assert not verdict.ok and verdict.details == ("a attempt 3: pods of 2 specs",)


def test_no_roll_no_floor() -> None:
    # The same restarts on one spec: resuming from the newest step is the rule (invariant 1).
    history = [{**r, "pods": [{**p, "template": "A"} for p in r["pods"]]} if r["type"] == "api" else r
               for r in rolled("30")]  # fmt: skip
    verdict = checkers_roll.check_roll_floor(timeline(history))
    assert verdict.ok and verdict.checked == 0


def test_a_roll_that_started_fresh_admits_only_the_new_gangs_steps() -> None:
    history = rolled("30")
    history[4] = api(T0 + 25, [tpod(1, "B", None, T0 + 25)])
    verdict = checkers_roll.check_roll_floor(timeline(history))
    assert not verdict.ok and "restored" not in verdict.details[0] and "started fresh" in verdict.details[0]


def test_invariant_1_takes_the_replaced_gangs_later_steps_as_not_resumable() -> None:
    """The restart resuming from the roll's step while the old gang's step 30 is newer is right;
    once the new gang saved step 30 itself, resuming from 20 loses it (invariant 1)."""
    assert checkers.check_resume(timeline(rolled("20"))).ok
    verdict = checkers.check_resume(timeline(rolled("20", resaved_by_new_gang=True)))
    assert not verdict.ok and "attempt 2: resumed from 20 while step 30 was COMMITTED" in verdict.details[0]


def test_invariant_1_takes_a_resizes_floor_like_a_rolls() -> None:
    """Issue 37's long soak (seed 3701): an elastic job resized at step 26 (status.plannedRestore
    named the resized attempt); the replaced gang still committed 30; a restart of the resized
    gang resumed from 26. No template changed, so only the operator's record names the change."""
    def same_spec(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for record in history:
            for p in record.get("pods", []):
                p["template"] = "A"
        return history

    resized = same_spec(rolled("20"))
    assert not checkers.check_resume(timeline(resized)).ok  # not known as a planned change
    planned = {**job("a"), "attempt": 1, "planned": 1}
    resized.insert(5, api(T0 + 26, [tpod(1, "A", "20", T0 + 25)], jobs=[planned]))
    assert checkers.check_resume(timeline(resized)).ok
    resaved = same_spec(rolled("20", resaved_by_new_gang=True))
    resaved.insert(5, api(T0 + 26, [tpod(1, "A", "20", T0 + 25)], jobs=[planned]))
    verdict = checkers.check_resume(timeline(resaved))
    assert not verdict.ok and "attempt 2: resumed from 20 while step 30 was COMMITTED" in verdict.details[0]


def test_the_saves_of_a_timeline_merge_markers_and_commit_events_in_time_order() -> None:
    history = rolled("20", resaved_by_new_gang=True)
    history.append({"t": T0 + 99, "type": "trainer-events", "job": "a",
                    "events": [{"event": "commit", "step": 10, "attempt": 0, "time": T0 + 11.5}]})  # fmt: skip
    saves = timeline(history).saves("a")
    assert [(s, who) for _, s, who in saves] == [(10, 0), (10, 0), (20, 0), (30, 0), (30, 1)]
    assert checkers_roll.saver_at(saves, 30, T0 + 30) == (True, 0)
    assert checkers_roll.saver_at(saves, 30, T0 + 45) == (True, 1)
    assert checkers_roll.saver_at(saves, 40, T0 + 45) == (False, None)


@pytest.mark.parametrize(("seed", "last_at", "last", "crashes"), [
    (119, 186.45, Kind.TRAINER_CRASH, 15), (2027, 228.77, Kind.SCALE, 8),
])  # fmt: skip
def test_the_bounded_soak_draws_the_classic_classes_with_the_schedule_they_had(
    seed: int, last_at: float, last: Kind, crashes: int
) -> None:
    """The figures of the schedules the bounded soak's seeds drew before issue 37's classes."""
    classic = schedule(seed, 60, 2.5, set(CLASSIC), 8.0)
    assert not {f.kind for f in classic} & ISSUE_37
    assert (classic[-1].at, classic[-1].kind) == (last_at, last)
    assert sum(f.kind is Kind.TRAINER_CRASH for f in classic) == crashes


def test_the_added_global_classes_keep_the_calm() -> None:
    plan = schedule(11, 400, 3.0, set(ISSUE_37) | {Kind.OPERATOR_KILL}, 30.0)
    spread = [f for f in plan if f.kind in GLOBAL]
    assert {Kind.NODES_GONE_OPERATOR_DOWN, Kind.CREDENTIALS_DELETED} <= {f.kind for f in spread}
    assert all(b.at >= a.at + a.duration + 30.0 for a, b in itertools.pairwise(spread))
    tarpits = [f for f in plan if f.kind is Kind.CHECKPOINT_TARPIT]
    assert tarpits and all(b.at >= a.at + a.duration for a, b in itertools.pairwise(tarpits))
