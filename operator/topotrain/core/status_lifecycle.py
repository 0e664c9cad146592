"""The job's lifecycle in status: failures and restarts, planned restarts (rollout, resize,
drain), suspension and Kueue admission, and the terminal phases.

Each method is one transition: it sets the phase, the conditions and the recovery record it
calls for and records the Events of the flips (StatusEdits). The pass's steps call them
through `StatusBuilder` (reconcile_status.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from typing import Literal

from topotrain.api.spec import FailurePolicy
from topotrain.api.status import (
    CheckpointRequestStatus,
    FailureRecord,
    PlannedRestoreStatus,
    Reason,
)
from topotrain.api.status import ConditionType as C
from topotrain.core import elastic
from topotrain.core.inplace import IN_PLACE
from topotrain.core.node_failures import avoided_nodes, record_node_failures
from topotrain.core.policy import APPLICATION, Failure
from topotrain.core.restarts import RestartDecision, used_budgets
from topotrain.core.status_edits import NORMAL, WARNING, StatusEdits, iso

# How a retargeted attempt's status.recovery.resumeReason begins: not a restart of its own.
RETARGETED = "a newer commit than step"


class LifecycleStatus(StatusEdits):
    """The transitions of a job's lifecycle (the rest of the pass's are in StatusBuilder)."""

    def record_failure(self, failure: Failure, policy: FailurePolicy) -> None:
        when = iso(self.now)
        self.status.last_failure = FailureRecord(
            reason=failure.reason, message=failure.message, time=when,
            pod=failure.pod, node=failure.node, exit_code=failure.exit_code,
        )
        self.set(C.READY, False, failure.reason, failure.message)
        if failure.reason == Reason.PROGRESS_STALLED:
            self.set(C.PROGRESSING, False, failure.reason, failure.message)
        self._event(WARNING, failure.reason, failure.message)
        before = avoided_nodes(self.status.node_failures)
        self.status.node_failures = record_node_failures(self.status.node_failures, failure, policy, when)
        for node in sorted(avoided_nodes(self.status.node_failures) - before):
            self._event(WARNING, Reason.NODE_AVOIDED,
                        f"node {node} failed this job {policy.node_failure_threshold} times "
                        "(spec.failurePolicy.nodeFailureThreshold): re-plans avoid it")

    def forgive_nodes(self, nodes: Set[str]) -> None:
        """Avoided nodes the next placement uses anyway (nothing else fits): their count restarts."""
        if not nodes:
            return
        for row in self.status.node_failures:
            if row.node in nodes:
                row.avoided, row.failures = False, 0
        self._event(WARNING, Reason.NODES_FORGIVEN,
                    f"no capacity fits the gang without nodes that failed it before: using "
                    f"{', '.join(sorted(nodes))} again (spec.failurePolicy.nodeFailureThreshold)")

    def restarting(self, verdict: RestartDecision, next_attempt: int, kind: str = APPLICATION) -> None:
        st = self.status
        used = used_budgets(st.restarts, st.restarts_by_class)
        if not verdict.counted:
            used.uncounted += 1
        elif kind == APPLICATION:
            used.application += 1
        else:
            used.infrastructure += 1
        st.restarts_by_class = used
        st.restarts = verdict.restarts
        st.attempt = next_attempt
        st.phase = "Recovering"
        started = st.last_failure.time if st.last_failure else iso(self.now)
        st.recovery = self._recovery(started, kind)
        self.set(C.RECOVERING, True, Reason.BACKOFF if verdict.delay_seconds else Reason.RESTARTED,
                 verdict.message)

    def restarting_in_place(self, verdict: RestartDecision, next_attempt: int, kind: str,
                            replaced: Mapping[int, str], kept: int, resume: int | None,
                            why: str) -> None:
        """A restart that keeps the healthy pods (moved to `next_attempt`) and replaces only the
        failed indices (`replaced`: index -> its new node), resuming from `resume` (`why`:
        resume.explain's words)."""
        self.restarting(verdict, next_attempt, kind)
        rec = self.status.recovery
        assert rec is not None
        rec.mode, rec.replaced_indices, rec.resume_step = IN_PLACE, sorted(replaced), resume
        rec.resume_reason = why
        self.status.attempt_start_time = iso(self.now)
        step = "from scratch" if resume is None else f"from step {resume}"
        step += f" ({why})"
        where = ", ".join(f"index {i} on {n}" for i, n in sorted(replaced.items()))
        message = (f"attempt {next_attempt} {step} in place: kept {kept} pod(s)"
                   + (f", replacing {where}" if where else ""))
        self.set(C.RECOVERING, True, Reason.RESTARTED_IN_PLACE, f"{message}; {verdict.message}")
        self._event(NORMAL, Reason.RESTARTED_IN_PLACE, message)

    def retargeting(self, attempt: int, next_attempt: int, step: int, missing: Iterable[int]) -> None:
        """An in-place attempt whose replacement pods are still missing moves to `next_attempt`,
        told the newer `step` (not a restart of its own: the budgets are untouched)."""
        rec = self.status.recovery
        assert rec is not None
        told = rec.resume_step
        rec.resume_step, rec.replaced_indices = step, sorted(missing)
        rec.resume_reason = f"{RETARGETED} {told}, the one attempt {attempt} was told"
        self.status.attempt, self.status.attempt_start_time = next_attempt, iso(self.now)
        message = (f"attempt {next_attempt} from step {step} in place: step {step} was committed "
                   f"after attempt {attempt} was told step {told}, before its replacement pods "
                   "were created")
        self.set(C.RECOVERING, True, Reason.RESTARTED_IN_PLACE, message)
        self._event(NORMAL, Reason.RESTARTED_IN_PLACE, message)

    def rolling(self, generation: int, next_attempt: int, resume: int | None) -> None:
        """The spec's pod template changed: a restart that uses no failure budget."""
        st = self.status
        st.attempt = next_attempt
        st.phase = "Recovering"
        st.recovery = self._recovery(iso(self.now), "rollout", "rollout")
        step = "from scratch" if resume is None else f"from step {resume}"
        message = f"the pod template changed (generation {generation}): restarting the gang {step}"
        self.set(C.RECOVERING, True, Reason.SPEC_CHANGED, message)
        self._event(NORMAL, Reason.SPEC_CHANGED, message)

    def resizing(self, request: elastic.ResizeRequest, new_data: int, next_attempt: int) -> None:
        st = self.status
        st.attempt = next_attempt
        st.phase = "Recovering"
        st.recovery = self._recovery(
            iso(self.now), "resize", elastic.resize_kind(request.current, new_data) or "resize",
        )
        message = f"{request.message}: data {request.current} -> {new_data}"
        self.set(C.RECOVERING, True, Reason.RESIZED, message)
        self._event(NORMAL, Reason.RESIZED, message)

    def moving(self, nodes: list[str], new_data: int, next_attempt: int, resume: int | None) -> None:
        """Nodes of the running gang were cordoned: a planned restart off them, no failure budget."""
        st = self.status
        previous = st.parallelism.data if st.parallelism else new_data
        st.attempt = next_attempt
        st.phase = "Recovering"
        st.recovery = self._recovery(
            iso(self.now), "drain", elastic.resize_kind(previous, new_data) or "drain",
        )
        step = "from the last commit" if resume is None else f"from step {resume}"
        degree = f", data {previous} -> {new_data}" if new_data != previous else ""
        message = (f"node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)} cordoned: moving the "
                   f"gang off before an eviction, {step}{degree}")  # fmt: skip
        self.set(C.RECOVERING, True, Reason.NODE_CORDONED, message)
        self._event(NORMAL, Reason.NODE_CORDONED, message)

    def checkpoint_asked(self, request: CheckpointRequestStatus, message: str) -> None:
        """A planned change asked the running gang for a checkpoint (planned.py)."""
        self.status.checkpoint_request = request
        self._event(NORMAL, Reason.CHECKPOINT_REQUESTED, message)

    def checkpoint_served(self, step: int, message: str) -> None:
        self._end_checkpoint_request("Committed", step)
        self._event(NORMAL, Reason.CHECKPOINT_SERVED, message)

    def checkpoint_timed_out(self, step: int | None, message: str) -> None:
        """Not committed within its bound: the change goes ahead from `step` (the last commit)."""
        self._end_checkpoint_request("TimedOut", step)
        self._event(WARNING, Reason.CHECKPOINT_TIMED_OUT, message)

    def checkpoint_cancelled(self) -> None:
        """The change is no longer wanted; a checkpoint the trainer still saves is an ordinary commit."""
        req = self.status.checkpoint_request
        if req is not None:
            req.state = "Cancelled"

    def _end_checkpoint_request(self, state: Literal["Committed", "TimedOut"], step: int | None) -> None:
        req = self.status.checkpoint_request
        assert req is not None
        req.state, req.step = state, step

    def restore_floor(self, reason: str, attempt: int, step: int | None) -> None:
        """A planned change starts attempt `attempt` from `step`: from now on, commits of earlier
        attempts after `step` are never resumed from (status.plannedRestore, resume.py)."""
        self.status.planned_restore = PlannedRestoreStatus(reason=reason, attempt=attempt, step=step)

    def suspending(self, attempt: int, why: str = "spec.suspend") -> None:
        """spec.suspend (or a Kueue eviction): the running gang was asked for a checkpoint and
        still trains."""
        message = f"{why}: waiting for attempt {attempt}'s checkpoint, then the gang stops"
        self.set(C.SUSPENDED, False, Reason.SUSPENDING, message)

    def suspended(self, step: int | None, stopped: int, why: str = "spec.suspend",
                  reason: str = Reason.SUSPENDED,
                  then: str = "false resumes it from the newest commit") -> None:
        """spec.suspend (or a Kueue eviction): no pod of the job runs; the job and its
        checkpoints stay."""
        st = self.status
        st.phase = "Suspended"
        if st.recovery is not None:
            st.recovery.started = None  # a recovery that was in flight is not finished: it ends here
        resume = "no committed checkpoint yet" if step is None else f"checkpoint of step {step} committed"
        message = f"{why}: the gang is stopped ({resume}); {then}"
        self.set(C.READY, False, reason, message)
        self.set(C.RECOVERING, False, reason, message)
        if self.set(C.SUSPENDED, True, reason, message):
            self._event(NORMAL, reason, f"{message}; {stopped} pods deleted" if stopped else message)

    def resumed(self, message: str = "spec.suspend is false: the gang starts again from the "
                "newest committed step") -> None:
        """spec.suspend went back to false (or Kueue readmitted the job): the next launch is a
        planned restart (cause resume)."""
        st = self.status
        if st.start_time:
            st.phase = "Recovering"
            st.recovery = self._recovery(iso(self.now), "resume", "resume")
        else:
            st.phase = "Pending"
        self.set(C.SUSPENDED, False, Reason.RESUMED, message)
        self._event(NORMAL, Reason.RESUMED, message)

    def admission(self, admitted: bool, reason: str, message: str) -> None:
        """Kueue's decision on the job's Workload, as the Admitted condition (an Event when it
        changes)."""
        if self.set(C.ADMITTED, admitted, reason, message):
            self._event(WARNING if reason in (Reason.EVICTED, Reason.HANDED_BACK) else NORMAL, reason,
                        message)

    def failed(self, reason: str, message: str) -> None:
        st = self.status
        st.phase = "Failed"
        st.completion_time = iso(self.now)
        if st.recovery is not None:
            st.recovery.started = None
        self.set(C.RECOVERING, False, reason, message)
        self.set(C.FAILED, True, reason, message)
        self._event(WARNING, reason, f"job Failed: {message}")

    def succeeded(self) -> None:
        st = self.status
        st.phase = "Succeeded"
        st.completion_time = iso(self.now)
        self.set(C.READY, False, Reason.COMPLETED, "all pods Succeeded")
        self.set(C.SUCCEEDED, True, Reason.COMPLETED, "all pods Succeeded")
        self._event(NORMAL, Reason.COMPLETED, "job Succeeded; checkpoints are kept")
