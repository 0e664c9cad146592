"""Invariant 10, the roll floor: no restart resumes from a step trained under an older spec
than the roll that preceded it (and no attempt runs pods of two specs).

A roll is an attempt whose pods run another spec (their `topotrain.io/template` hash) than
the attempt before it; it resumes from some step R (or fresh). The gang it replaced may
still commit steps after R before it stops, trained under the old spec. Every later attempt,
up to the next roll, must resume from a step at or below R, or from a step whose COMMITTED
marker, as it stood when the attempt's pods were created, was saved by the roll's attempt or
a later one. Who saved a marker is read from the marker itself (the observer reads each new
one) and from the trainers' commit events; the operator's status is not consulted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from testbed.chaos.timeline import Attempt, Timeline, Verdict, verdict


def _resume(attempt: Attempt) -> int | None:
    """The step the attempt resumed from (the highest its pods were told; invariant 1 judges
    pods told different steps)."""
    steps = [int(str(r)) for r in attempt.resumes if r not in (None, "")]
    return max(steps) if steps else None


def saver_at(saves: list[tuple[float, int, int | None]], step: int, moment: float) -> tuple[bool, int | None]:
    """(seen, attempt): who had saved `step`'s marker last by `moment`."""
    last = [who for at, s, who in saves if s == step and at <= moment]
    return (bool(last), last[-1] if last else None)


def _by_job(t: Timeline) -> dict[str, list[Attempt]]:
    by_job: dict[str, list[Attempt]] = defaultdict(list)
    for (job, _), attempt in sorted(t.attempts().items(), key=lambda item: (item[0][0], item[0][1])):
        by_job[job].append(attempt)
    return by_job


def _walk(attempts: list[Attempt]) -> list[tuple[Attempt, Attempt | None, Attempt | None]]:
    """Each attempt with the last roll before it and the last roll at or before it (None:
    no roll yet): they differ only for a roll itself."""
    out: list[tuple[Attempt, Attempt | None, Attempt | None]] = []
    template: str | None = None
    roll: Attempt | None = None
    for attempt in attempts:
        before = roll
        new = attempt.templates - {template}
        if template is not None and new:
            roll = attempt
        if new:
            template = sorted(new)[-1]
        out.append((attempt, before, roll))
    return out


def behind_floor(t: Timeline) -> Callable[[str, int, int, float], bool]:
    """`behind(job, attempt, step, moment)`: whether a commit of `step` is, for that attempt, a
    step the gang replaced by the last planned change saved after the change's step (so not
    resumable; by `moment` the marker was that gang's). A planned change is a roll (seen from
    the pods' templates) or an attempt the operator's status.plannedRestore named (a resize, a
    drain); its step is what its pods were told. Invariant 1 does not count such a newer commit."""
    floors: dict[tuple[str, int], tuple[int, int | None]] = {}
    for job, attempts in _by_job(t).items():
        planned = t.planned(job)
        last: Attempt | None = None
        for attempt, _, roll in _walk(attempts):
            if attempt.number in planned or (roll is not None and roll.number == attempt.number):
                last = attempt
            if last is not None:
                floors[(job, attempt.number)] = (last.number, _resume(last))
    saves = {job: t.saves(job) for job, _ in floors}

    def behind(job: str, attempt: int, step: int, moment: float) -> bool:
        if (job, attempt) not in floors:
            return False
        number, floor = floors[(job, attempt)]
        if floor is not None and step <= floor:
            return False
        seen, saver = saver_at(saves[job], step, moment)
        return seen and saver is not None and saver < number

    return behind


def check_roll_floor(t: Timeline, slack: float = 1.0) -> Verdict:
    problems: list[str] = []
    notes: list[str] = []
    checked = 0
    for job, attempts in sorted(_by_job(t).items()):
        saves = t.saves(job)
        for attempt, roll, _ in _walk(attempts):
            if len(attempt.templates) > 1:  # one gang, two specs (an in-place restart across an edit)
                problems.append(f"{job} attempt {attempt.number}: pods of {len(attempt.templates)} specs")
            if roll is None:
                continue
            checked += 1
            line = _judge(job, attempt, roll, saves, slack)
            if line is not None:
                (notes if line.startswith("note: ") else problems).append(line.removeprefix("note: "))
    return verdict("10 no restart resumes from the replaced spec's steps after a roll", checked,
                   problems, notes)  # fmt: skip


def _judge(job: str, attempt: Attempt, roll: Attempt, saves: list[tuple[float, int, int | None]],
           slack: float) -> str | None:  # fmt: skip
    resumed, floor = _resume(attempt), _resume(roll)
    if resumed is None or (floor is not None and resumed <= floor):
        return None
    seen, saver = saver_at(saves, resumed, attempt.created + slack)
    head = f"{job} attempt {attempt.number} resumed from step {resumed}"
    if not seen or saver is None:
        return f"note: {head}, whose saver was never seen (the roll to attempt {roll.number} restored {floor})"
    if saver < roll.number:
        restored = "started fresh" if floor is None else f"restored step {floor}"
        return (f"{head}, saved by attempt {saver} under the old spec after the roll to attempt "
                f"{roll.number} {restored}")
    return None
