"""Invariant 12, one failure, one restart: a fault that fails a job once (a crashed or hung
rank, a deleted pod, one crash on a bad node) restarts it once, never twice.

Only restarts that exactly one fault may explain are counted (testbed.chaos.causes: faults
overlap by design, and a restart near several is not laid at any one's door); a fault of a
once-only kind that is the only explanation of two restarts of a job is a double restart,
the trace of two replicas (or two passes) acting on one failure. A roll-crash is a roll and
a crash: two restarts.
"""

from __future__ import annotations

from collections import defaultdict

from testbed.chaos.causes import candidates, causes, restarts
from testbed.chaos.timeline import Timeline, Verdict, verdict

ONCE = {"trainer-crash": 1, "pod-deleted": 1, "trainer-hang": 1, "bad-node": 1, "roll-crash": 2}


def check_one_restart_per_failure(t: Timeline, window: float = 120.0) -> Verdict:
    found = causes(t)
    alone: dict[tuple[int, str], list[int]] = defaultdict(list)  # (cause, job) -> attempts
    checked = 0
    for job in sorted(t.created):
        for began, number, at in restarts(t, job):
            which = candidates(found, job, began, at, window)
            if len(which) == 1 and found[which[0]].kind in ONCE:
                checked += 1
                alone[(which[0], job)].append(number)
    problems = [
        f"{job}: one {found[i].kind} at t={found[i].start:.0f}, no other fault near, restarted it "
        f"{len(numbers)} times (attempts {numbers}: "
        f"{'; '.join(f'{n}: {t.attempt_status(job, n)}' for n in numbers)})"
        for (i, job), numbers in sorted(alone.items()) if len(numbers) > ONCE[found[i].kind]
    ]  # fmt: skip
    return verdict("12 one failure, one restart", checked, problems)
