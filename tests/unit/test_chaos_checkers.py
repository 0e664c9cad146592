"""The chaos soak's checkers and generator, on hand-written histories: each
invariant passes a clean history and names the planted violation."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from testbed.chaos import checkers
from testbed.chaos.catalogue import CALM, GLOBAL, Kind, choose, schedule
from testbed.chaos.timeline import Timeline
from testbed.standin import expected_losses

NS = "chaos-x"
T0 = 1_000_000.0


def iso(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(job: str, attempt: int, index: int, phase: str = "Running", *, node: str = "n1",
        gpus: int = 1, resume: str | None = None, created: float = T0, deleting: bool = False,
        uid: str | None = None) -> dict[str, Any]:  # fmt: skip
    return {"ns": NS, "name": f"{job}-{attempt}-{index}", "uid": uid or f"{job}-{attempt}-{index}",
            "job": job, "attempt": attempt, "index": index, "phase": phase, "node": node,
            "deleting": deleting, "created": iso(created), "gpus": gpus, "resume": resume}  # fmt: skip


def api(t: float, pods: list[dict[str, Any]], jobs: list[dict[str, Any]] | None = None,
        nodes: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    return {"t": t, "type": "api", "pods": pods, "jobs": jobs or [], "nodes": nodes or {"n1": 8}}


def job(name: str, phase: str = "Running", reason: str | None = None, message: str = "",
        conditions: list[tuple[str, str, str]] | None = None) -> dict[str, Any]:  # fmt: skip
    return {"name": name, "phase": phase, "reason": reason, "message": message, "data": 1,
            "conditions": conditions or [], "deleting": False}  # fmt: skip


def s3(t: float, committed: dict[str, list[tuple[int, float]]]) -> dict[str, Any]:
    return {"t": t, "type": "s3", "committed": committed}


def created(name: str, t: float = T0, steps: int = 30, seed: int = 5) -> dict[str, Any]:
    return {"t": t, "type": "job-created", "job": name, "shape": "tiny", "seed": seed,
            "steps": steps, "interval": 10, "keep": 2}  # fmt: skip


def steps_events(seed: int, first: int, last: int, attempt: int, t: float) -> list[dict[str, Any]]:
    want = expected_losses(seed, last)
    return [{"event": "step", "step": s, "loss": want[s], "attempt": attempt, "time": t + s}
            for s in range(first, last + 1)]  # fmt: skip


def timeline(records: list[dict[str, Any]]) -> Timeline:
    return Timeline.of(records, NS)


def restart_history(resume: str | None) -> list[dict[str, Any]]:
    """Attempt 0 commits step 10 and 20, dies; attempt 1 starts 30 s after step 20 committed."""
    return [
        created("a"),
        api(T0 + 1, [pod("a", 0, 0, resume=None, created=T0 + 1)]),
        s3(T0 + 15, {"a": [(10, T0 + 12)]}),
        s3(T0 + 25, {"a": [(10, T0 + 12), (20, T0 + 22)]}),
        api(T0 + 60, [pod("a", 0, 0, "Failed", created=T0 + 1),
                      pod("a", 1, 0, resume=resume, created=T0 + 55)]),
    ]  # fmt: skip


def test_resume_from_the_newest_committed_step_passes() -> None:
    assert checkers.check_resume(timeline(restart_history("20"))).ok


@pytest.mark.parametrize(("resume", "words"), [
    ("10", "while step 20 was COMMITTED"),
    (None, "while step 20 was COMMITTED"),
    ("25", "never seen COMMITTED"),
])  # fmt: skip
def test_resume_from_an_older_or_uncommitted_step_is_a_violation(resume: str | None, words: str) -> None:
    verdict = checkers.check_resume(timeline(restart_history(resume)))
    assert not verdict.ok and words in verdict.details[0]


@pytest.mark.parametrize(("resume", "ok"), [("20", True), ("10", False)])
def test_a_pod_restarted_in_place_is_judged_from_when_it_moved_to_the_attempt(
    resume: str, ok: bool
) -> None:
    # Created at T0 + 1 (before any commit), moved to attempt 1 at T0 + 60 (step 20 committed).
    moved = {**pod("a", 1, 0, resume=resume, created=T0 + 1), "uid": "a-0-0"}
    history = [*restart_history("20")[:4], api(T0 + 60, [moved])]
    assert checkers.check_resume(timeline(history)).ok is ok


def test_two_attempts_running_together_or_a_duplicate_index_is_a_violation() -> None:
    clean = [api(T0, [pod("a", 0, 0, "Failed"), pod("a", 1, 0)])]
    assert checkers.check_exclusive(timeline(clean)).ok  # the crashed pod kept for its logs
    both = [api(T0, [pod("a", 0, 0), pod("a", 1, 0)]), api(T0 + 1, [pod("a", 0, 0), pod("a", 1, 0)])]
    assert "Running together" in checkers.check_exclusive(timeline(both)).details[0]
    # A restart in place caught half done in one snapshot (kept pods relabelled one by one).
    moving = [api(T0, [pod("a", 0, 0), pod("a", 1, 1)]), api(T0 + 1, [pod("a", 1, 0), pod("a", 1, 1)])]
    assert checkers.check_exclusive(timeline(moving)).ok
    twice = [api(T0, [pod("a", 1, 0), pod("a", 1, 0, uid="other")])]
    assert "2 live pods" in checkers.check_exclusive(timeline(twice)).details[0]


def test_an_old_attempt_stepping_after_the_next_began_is_a_violation() -> None:
    events = steps_events(5, 1, 10, 0, T0) + steps_events(5, 5, 8, 1, T0 + 2)
    records = [created("a"), {"t": T0, "type": "trainer-events", "job": "a", "events": events}]
    verdict = checkers.check_exclusive(timeline(records))
    assert not verdict.ok and "still stepping" in verdict.details[0]


def test_gpus_requested_beyond_allocatable_is_a_violation() -> None:
    fits = [api(T0, [pod("a", 0, 0, gpus=4), pod("b", 0, 0, gpus=4), pod("c", 0, 0, "Failed", gpus=8)])]
    assert checkers.check_gpus(timeline(fits)).ok
    over = [api(T0, [pod("a", 0, 0, gpus=4), pod("b", 0, 0, "Pending", gpus=5)])]
    assert "9 GPUs requested of 8" in checkers.check_gpus(timeline(over)).details[0]


def outcome(events: list[dict[str, Any]], final: dict[str, Any]) -> checkers.Verdict:
    records = [created("a", steps=30), api(T0 + 99, [], [final]),
               {"t": T0 + 100, "type": "trainer-events", "job": "a", "events": events}]  # fmt: skip
    return checkers.check_outcomes(timeline(records), expected_losses)


def test_succeeded_needs_every_step_with_the_uninterrupted_loss() -> None:
    done = [{"event": "done", "time": T0 + 50, "attempt": 1}]
    resumed = steps_events(5, 1, 14, 0, T0) + steps_events(5, 11, 30, 1, T0 + 20) + done
    assert outcome(resumed, job("a", "Succeeded")).ok
    wrong = [dict(e, loss=0.5) if e.get("step") == 12 and e["attempt"] == 1 else e for e in resumed]
    assert "step 12 (attempt 1) loss 0.5" in outcome(wrong, job("a", "Succeeded")).details[0]
    short = steps_events(5, 1, 20, 0, T0) + done
    assert "without its trainer reaching step 30" in outcome(short, job("a", "Succeeded")).details[0]


def test_failed_must_name_a_budget() -> None:
    spent = job("a", "Failed", "MaxRestartsExceeded", "20 restarts: spec.failurePolicy.maxRestarts")
    assert outcome([], spent).ok
    other = job("a", "Failed", "PodFailed", "exit 1")
    assert "Failed with PodFailed" in outcome([], other).details[0]
    assert "unfinished" in outcome([], job("a", "Recovering")).details[0]


def test_a_long_stretch_without_a_running_attempt_needs_a_condition() -> None:
    gap = [created("a"), api(T0 + 1, [pod("a", 0, 0)], [job("a")]),
           api(T0 + 100, [pod("a", 1, 0, "Pending")], [job("a", "Recovering")]),
           api(T0 + 200, [pod("a", 1, 0, "Pending")], [job("a", "Recovering")])]  # fmt: skip
    verdict = checkers.check_availability(timeline(gap), bound=120)
    assert not verdict.ok and "no Running attempt for 199s" in verdict.details[0]
    explained = [*gap[:2], api(T0 + 100, [], [job("a", "Pending", conditions=[
        ("Schedulable", "False", "InsufficientCapacity")])]), gap[3]]  # fmt: skip
    assert checkers.check_availability(timeline(explained), bound=120).ok


def test_lost_work_beyond_an_interval_past_the_last_commit_is_a_violation() -> None:
    def records(resume: int) -> list[dict[str, Any]]:
        restart = {"event": "start", "attempt": 1, "resume": resume, "time": T0 + 40}
        events = [*steps_events(5, 1, 27, 0, T0), restart,
                  *steps_events(5, resume + 1, 30, 1, T0 + 41 - resume)]  # fmt: skip
        return [created("a"), s3(T0 + 30, {"a": [(10, T0 + 11), (20, T0 + 21)]}),
                {"t": T0 + 99, "type": "trainer-events", "job": "a", "events": events}]  # fmt: skip

    assert checkers.check_lost_work(timeline(records(20))).ok
    verdict = checkers.check_lost_work(timeline(records(0)))
    assert not verdict.ok and "lost 27 steps, allowed 17" in verdict.details[0]


def test_retention_keeps_at_most_keep_plus_one_and_never_drops_the_newest() -> None:
    good = [created("a"), s3(T0, {"a": [(10, 1), (20, 2), (30, 3)]}), s3(T0 + 1, {"a": [(20, 2), (30, 3)]})]
    assert checkers.check_retention(timeline(good)).ok
    many = [created("a"), s3(T0, {"a": [(10, 1), (20, 2), (30, 3), (40, 4)]})]
    assert "4 committed (keep 2)" in checkers.check_retention(timeline(many)).details[0]
    # Just after a commit whose retention has not run yet (an earlier one was cut short): a note.
    fresh = [created("a"), s3(T0, {"a": [(10, 1), (20, 2), (30, 3), (40, T0 - 5)]})]
    verdict = checkers.check_retention(timeline(fresh))
    assert verdict.ok and "retention in flight" in verdict.notes[0]
    # Long soak seed 1302: the commit's retention failed while the store erred, and the next
    # attempt's retention ran 8 s after the store answered again (38 s after the commit): a note.
    errors = {"t": T0 - 40, "type": "fault", "index": 3, "kind": "s3-errors", "jobs": ["a"], "duration": 32}
    healed = {"t": T0 - 8, "type": "heal", "index": 3, "kind": "s3-errors"}
    late = [created("a"), errors, healed, s3(T0, {"a": [(10, 1), (20, 2), (30, 3), (40, T0 - 38)]})]
    verdict = checkers.check_retention(timeline(late))
    assert verdict.ok and "retention in flight" in verdict.notes[0]
    late[2] = {**healed, "t": T0 - 31}  # the store answered 31 s before: retention had its chance
    assert not checkers.check_retention(timeline(late)).ok
    # A job deleted with one commit beyond keep + 1 (its trainer hung before retention, then the
    # job was deleted; the long soak, seed 3701): its checkpoints stay so, and are not judged.
    after = [created("a"), s3(T0, {"a": [(10, 1), (20, 2), (30, 3), (40, T0 - 90)]})]
    assert not checkers.check_retention(timeline(after)).ok
    deleted = {"t": T0 - 60, "type": "job-deleted", "job": "a"}
    assert checkers.check_retention(timeline([after[0], deleted, after[1]])).ok
    # The same after a tarpit on the namespace's store calls, or while the Secret was gone.
    for kind in ("checkpoint-tarpit", "credentials-deleted"):
        late = [created("a"), {**errors, "kind": kind}, {**healed, "kind": kind},
                s3(T0, {"a": [(10, 1), (20, 2), (30, 3), (40, T0 - 38)]})]
        assert checkers.check_retention(timeline(late)).ok, kind
    dropped = [created("a"), s3(T0, {"a": [(20, 2), (30, 3)]}), s3(T0 + 1, {"a": [(20, 2)]})]
    assert "newest committed step 30 is gone" in checkers.check_retention(timeline(dropped)).details[0]


def test_memory_growth_and_peak() -> None:
    flat = [(T0 + i * 10, 120.0 + (i % 3)) for i in range(60)]
    assert checkers.check_memory(flat).ok
    assert abs(checkers.slope_mib_per_hour(flat)) < 10
    growing = [(T0 + i * 10, 120.0 + 5 * i) for i in range(60)]
    assert "grew" in checkers.check_memory(growing).details[0]
    assert checkers.slope_mib_per_hour(growing) == pytest.approx(1800, rel=0.01)


def test_the_same_seed_replays_the_same_schedule() -> None:
    first, again, other = schedule(7, 200, 3.0), schedule(7, 200, 3.0), schedule(8, 200, 3.0)
    assert first == again and first != other
    assert len(first) == 200 and {f.kind for f in schedule(7, 1000, 3.0)} == set(Kind)
    assert all(b.at >= a.at for a, b in itertools.pairwise(first))
    spread = [f for f in first if f.kind in GLOBAL]
    assert all(b.at >= a.at + a.duration + CALM for a, b in itertools.pairwise(spread))
    assert schedule(7, 50, 3.0, {Kind.POD_DELETED}) == [f for f in schedule(7, 50, 3.0, {Kind.POD_DELETED})]
    assert choose(["b", "a", "c"], 0.99) == "c" and choose([], 0.5) is None


def test_an_attempt_number_used_twice_is_a_violation() -> None:
    said_running = dict(job("a"), attempt=0)
    reused = [api(T0, [pod("a", 0, 0, uid="first")], [said_running]),
              api(T0 + 9, [pod("a", 0, 0, uid="second", created=T0 + 9)])]  # fmt: skip
    verdict = checkers.check_exclusive(timeline(reused))
    assert not verdict.ok and "attempt 0 index 0: 2 pods, the attempt was reused" in verdict.details[0]
    assert checkers.check_resume(timeline(reused)).ok  # each run of it is checked on its own
    # Reused before the operator ever said the attempt was Running: a note, not a violation.
    reused[0] = api(T0, [pod("a", 0, 0, uid="first")], [job("a", "Starting")])
    verdict = checkers.check_exclusive(timeline(reused))
    assert verdict.ok and "the attempt was reused" in verdict.notes[0]


def test_restarts_need_a_fault_that_touched_the_job_or_a_resize() -> None:
    def start(attempt: int, at: float, pods: int = 2) -> dict[str, Any]:
        return {"event": "start", "attempt": attempt, "resume": None, "pods": pods, "time": at}

    crash = {"t": T0 + 10, "type": "fault", "index": 0, "kind": "trainer-crash", "jobs": ["a"], "duration": 0}
    starts = [start(0, T0), start(1, T0 + 12), start(2, T0 + 300, pods=1)]  # 2: a shrink
    records = [created("a"), crash, {"t": T0 + 400, "type": "trainer-events", "job": "a", "events": starts}]
    assert checkers.check_restarts_explained(timeline(records)).ok
    # A loop of five more restarts soon after the crash (one caught only on the API server):
    loop = [*starts[:2], *(start(2 + i, T0 + 20 + i) for i in range(4))]
    records[-1] = {"t": T0 + 400, "type": "trainer-events", "job": "a", "events": loop}
    records.append(api(T0 + 25, [pod("a", 6, 0, created=T0 + 25), pod("a", 6, 1, created=T0 + 25)]))
    verdict = checkers.check_restarts_explained(timeline(records))
    assert not verdict.ok and len(verdict.details) == 3  # one crash explains three restarts, not six
    assert "attempt 4 at" in verdict.details[0] and "no fault explains it" in verdict.details[0]


def test_a_restart_in_place_is_dated_when_the_kept_pods_join_the_attempt() -> None:
    # Pods created for attempt 0 at T0, moved to attempt 1 at T0 + 30 after a crash at T0 + 28:
    # their creation time is not when attempt 1 began.
    crash = {"t": T0 + 28, "type": "fault", "index": 0, "kind": "trainer-crash", "jobs": ["a"], "duration": 0}
    before = api(T0 + 1, [pod("a", 0, 0), pod("a", 0, 1)])
    moved = api(T0 + 30, [{**pod("a", 1, 0), "uid": "a-0-0"}, pod("a", 1, 1, created=T0 + 29)])
    assert checkers.check_restarts_explained(timeline([created("a"), before, crash, moved])).ok


def test_a_node_fault_explains_the_restart_of_a_pod_placed_on_the_node_after_it_began() -> None:
    """Long soak seed 1302: node n2 was made NotReady before the operator saw it, a job's first pod
    was placed there meanwhile, and its restart was counted as having no cause."""
    fault = {"t": T0 + 5, "type": "fault", "index": 0, "kind": "node-not-ready", "jobs": [],
             "node": "n2", "duration": 17}  # fmt: skip
    heal = {"t": T0 + 22, "type": "heal", "index": 0, "kind": "node-not-ready"}
    # Gated, not yet bound: only the operator's planned node says where it goes.
    first = api(T0 + 8, [{**pod("a", 0, 0, node="", created=T0 + 8), "planned": "n2"}])
    again = api(T0 + 14, [pod("a", 0, 0, "Failed", node="n2", created=T0 + 8),
                          pod("a", 1, 0, node="n1", created=T0 + 14)])  # fmt: skip
    assert checkers.check_restarts_explained(timeline([created("a"), fault, first, again, heal])).ok
    # The same restart with the pod on another node stays unexplained.
    elsewhere = [api(r["t"], [{**p, "node": "n3", "planned": "n3"} for p in r["pods"]]) for r in (first, again)]
    assert not checkers.check_restarts_explained(timeline([created("a"), fault, *elsewhere, heal])).ok


def test_pod_supervisor_lines_without_a_time_are_not_trainer_events() -> None:
    events = [{"event": "workers_started", "attempt": 0, "source": "supervisor"},
              *steps_events(5, 1, 3, 0, T0)]  # fmt: skip
    t = timeline([created("a"), {"t": T0, "type": "trainer-events", "job": "a", "events": events}])
    assert [e["step"] for e in t.steps("a")] == [1, 2, 3]


def test_one_crash_alone_restarting_a_job_twice_is_a_double_restart() -> None:
    """Invariant 12: a crash that alone explains two restarts (the second with no fault of its
    own) is reported; a second fault near the second restart makes it ambiguous, not counted."""
    def start(attempt: int, at: float) -> dict[str, Any]:
        return {"event": "start", "attempt": attempt, "resume": None, "pods": 1, "time": at}

    crash = {"t": T0 + 10, "type": "fault", "index": 0, "kind": "trainer-crash", "jobs": ["a"], "duration": 0}
    events = {"t": T0 + 400, "type": "trainer-events", "job": "a",
              "events": [start(0, T0), start(1, T0 + 12), start(2, T0 + 40)]}  # fmt: skip
    verdict = checkers.check_one_restart_per_failure(timeline([created("a"), crash, events]))
    assert not verdict.ok and "restarted it 2 times (attempts [1, 2]" in verdict.details[0]
    assert checkers.check_restarts_explained(timeline([created("a"), crash, events])).ok  # 9 allows it
    deleted = {"t": T0 + 38, "type": "fault", "index": 1, "kind": "pod-deleted", "jobs": ["a"], "duration": 0}
    assert checkers.check_one_restart_per_failure(timeline([created("a"), crash, deleted, events])).ok
    once = {**events, "events": events["events"][:2]}
    verdict = checkers.check_one_restart_per_failure(timeline([created("a"), crash, once]))
    assert verdict.ok and verdict.checked == 1


def test_a_retargeted_in_place_attempt_is_not_a_second_restart() -> None:
    """Invariant 12: a deleted pod restarts the job in place (attempt 1); a step committed by the
    dying gang before the replacement was created moves that restart on to attempt 2 (the
    operator's retarget, status.recovery.resumeReason says so): one restart, not two. The same
    attempts without that status are a double restart."""
    def start(attempt: int, at: float) -> dict[str, Any]:
        return {"event": "start", "attempt": attempt, "resume": None, "pods": 1, "time": at}

    deleted = {"t": T0 + 10, "type": "fault", "index": 0, "kind": "pod-deleted", "jobs": ["a"], "duration": 0}
    events = {"t": T0 + 400, "type": "trainer-events", "job": "a",
              "events": [start(0, T0), start(1, T0 + 12), start(2, T0 + 40)]}  # fmt: skip
    seen = {**job("a"), "attempt": 2, "retargeted": True}
    moved = api(T0 + 41, [pod("a", 2, 0, created=T0 + 40)], [seen])
    verdict = checkers.check_one_restart_per_failure(timeline([created("a"), deleted, events, moved]))
    assert verdict.ok and verdict.checked == 1
    assert checkers.check_restarts_explained(timeline([created("a"), deleted, events, moved])).ok
    plain = api(T0 + 41, [pod("a", 2, 0, created=T0 + 40)], [{**seen, "retargeted": False}])
    verdict = checkers.check_one_restart_per_failure(timeline([created("a"), deleted, events, plain]))
    assert not verdict.ok and "restarted it 2 times (attempts [1, 2]" in verdict.details[0]
