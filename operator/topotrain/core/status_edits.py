"""The mechanics every status transition of a pass uses: a working copy of the status, conditions
that move `lastTransitionTime` only on a flip, and the Events those flips call for.

`StatusEdits` is the base of the pass's `StatusBuilder` (reconcile_status.py), with the job's
lifecycle transitions (status_lifecycle.py) between them. `iso`/`parse` are the status's time
format (RFC 3339, UTC, milliseconds).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from topotrain.api.status import RecoveryStatus, TrainingJobStatus, set_condition

NORMAL, WARNING = "Normal", "Warning"
# How far ahead of this replica's clock a time in status may be before it is taken as written by
# a clock that ran ahead (pull_back_future_times).
AHEAD = timedelta(seconds=5)


def iso(moment: datetime) -> str:
    """RFC 3339 in UTC with milliseconds (recovery times are sub-second)."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


class StatusEdits:
    """A mutable copy of the status plus the Events its transitions call for."""

    def __init__(self, status: TrainingJobStatus, generation: int, now: datetime) -> None:
        self.status = status.model_copy(deep=True)
        self.generation = generation
        self.now = now
        self.events: list[tuple[str, str, str]] = []
        self._pull_back_future_times()

    def _pull_back_future_times(self) -> None:
        """Times ahead of this pass's clock, written by a replica whose wall clock ran ahead (the
        Lease is timed on monotonic clocks, so such a replica may act), are brought back to now.
        A wait measured from one (the restart backoff, the pods-not-starting timeout, a checkpoint
        request's bound, an API refusal's timeout) then lasts its own length from here instead
        of that length plus the other clock's lead (the long soak, seed 3701: two jobs waited
        about 560 s in BackoffWaiting after a replica-clock-skew fault)."""
        st, limit, now = self.status, self.now + AHEAD, iso(self.now)

        def ahead(text: str | None) -> bool:
            return text is not None and parse(text) > limit

        failure, rec, request = st.last_failure, st.recovery, st.checkpoint_request
        if failure is not None and ahead(failure.time):
            if rec is not None and rec.started == failure.time:
                rec.started = now  # the backoff reads a recovery as failure-triggered by this match
            failure.time = now
        if rec is not None and ahead(rec.started):
            rec.started = now
        if ahead(st.attempt_start_time):
            st.attempt_start_time = now
        if request is not None and ahead(request.time):
            request.time = now
        for cond in st.conditions:
            if ahead(cond.last_transition_time):
                cond.last_transition_time = now

    parse = staticmethod(parse)

    def set(self, type_: str, value: bool | str, reason: str, message: str = "") -> bool:
        """Set a condition; True when its status flipped (or it is new)."""
        before = self.status.condition(type_)
        self.status.conditions = set_condition(
            self.status.conditions, type_, value, reason, message,
            generation=self.generation, now=iso(self.now),
        )
        after = self.status.condition(type_)
        return before is None or (after is not None and before.status != after.status)

    def _event(self, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))

    def _waiting_phase(self) -> None:
        if self.status.phase not in ("Recovering",):
            self.status.phase = "Recovering" if self.status.start_time else "Pending"

    def _recovery(self, started: str, cause: str, mode: str | None = None) -> RecoveryStatus:
        """A new recovery in flight, keeping the last one's figures for display."""
        old = self.status.recovery
        return RecoveryStatus(
            last_seconds=old.last_seconds if old else None,
            time_to_first_step_seconds=old.time_to_first_step_seconds if old else None,
            phases=old.phases if old else None,
            started=started, fault_time=started, cause=cause, mode=mode,
        )
