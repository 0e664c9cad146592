"""How one reconcile pass edits the job's status: phases, conditions, Events.

`StatusBuilder` works on a copy of the status read at the start of the pass
(status_edits.py; the lifecycle transitions are in status_lifecycle.py); it is
the only author of a job's status. `transitions.settle` turns it into the pass's
one status write, which the edge makes only if it differs. Conditions move
`lastTransitionTime` only on a flip, and an Event is emitted for a flip, never
for a repeat, so Events mark transitions while status holds the truth.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from topotrain.api.spec import Parallelism
from topotrain.api.status import (
    CheckpointStatus,
    CurrentParallelism,
    JobTemplateStatus,
    PlacementSummary,
    ProgressStatus,
    Reason,
    RecoveryPhases,
    RecoveryStatus,
    ResumedFromStatus,
)
from topotrain.api.status import ConditionType as C
from topotrain.checkpoints import AttemptStart, PrefixOwner, WorkerFailure
from topotrain.core import cooperation, elastic
from topotrain.core.planning import PlanOutcome
from topotrain.core.progress_rate import advance
from topotrain.core.status_edits import NORMAL, WARNING, iso, parse
from topotrain.core.status_lifecycle import LifecycleStatus
from topotrain.degrees import REASON as DEGREE_NOT_ALLOWED

# A store that answered before and now fails reads is reported unreachable (pausing hang
# detection) only once its reads have failed for this long: a store that fails a share of its
# requests (30% 503s for minutes) must not flip the condition, and hang detection, every pass.
STORE_ERROR_GRACE_SECONDS = 30.0
_FAILING_SINCE = "failing reads since "


# The API server's refusals of a gang's pods (PodsCreated=False reasons the edge reports).
REFUSAL_REASONS = (Reason.QUOTA_EXCEEDED, Reason.POD_SPEC_INVALID, Reason.POD_CREATE_REFUSED)

@dataclass(frozen=True)
class CheckpointView:
    """What the checkpoint store said this pass (None fields: nothing there)."""

    reachable: bool = True
    error: str = ""
    step: int | None = None
    uri: str | None = None
    time: datetime | None = None
    progress_step: int | None = None
    progress_time: datetime | None = None
    progress_attempt: int | None = None  # the attempt whose trainer wrote the heartbeat
    progress_start: AttemptStart | None = None  # how that attempt started (the bundled trainer)
    progress_contract: int | None = None  # the contract version the heartbeat's SDK speaks
    # The checkpoint request the current trainer served and committed ("" for none, or a trainer
    # that does not serve requests), and the step that holds it: the newest commit when that names
    # it, else the step the heartbeat says served it. A gang replaced meanwhile may have saved a
    # newer step on its SIGTERM (a stale commit naming an older request).
    request: str = ""
    request_step: int | None = None
    # The newest commit the store holds above `step` that a restart must not resume from: saved by
    # a gang a planned change replaced, after the step the change restored (resume.py).
    skipped_step: int | None = None
    skipped_attempt: int | None = None
    # failure.json: a supervisor reported its own rank's failure and waits for the next attempt
    worker_failure: WorkerFailure | None = None


class StatusBuilder(LifecycleStatus):
    """The status one pass writes: its observations, placement and the gang's life, on top of
    the lifecycle transitions (status_lifecycle.py) and the mechanics (status_edits.py)."""

    # --- observations --------------------------------------------------------

    def observe_checkpoint(self, view: CheckpointView | None, total: int | None = None) -> None:
        """What the store said; `total`: the run's length in steps, for progress (progress_rate)."""
        if view is None or view.reachable:
            self.observe_cooperation(view)
        if view is None:
            return
        if not view.reachable:
            since = self._store_failing_since()
            if since is not None and (self.now - since).total_seconds() < STORE_ERROR_GRACE_SECONDS:
                self.set(C.STORE_REACHABLE, True, Reason.STORE_ERRORS,
                         f"the checkpoint store is {_FAILING_SINCE}{iso(since)} (last: {view.error}); "
                         f"reported unreachable after {STORE_ERROR_GRACE_SECONDS:.0f}s of failures")
                return
            message = f"cannot read the checkpoint store: {view.error}; hang detection is paused"
            if self.set(C.STORE_REACHABLE, False, Reason.STORE_UNAVAILABLE, message):
                self._event(WARNING, Reason.STORE_UNAVAILABLE, message)
            return
        was = self.status.condition(C.STORE_REACHABLE)
        self.set(C.STORE_REACHABLE, True, Reason.STORE_OK, "the checkpoint store answers")
        if was is not None and was.status == "False":
            self._event(NORMAL, Reason.STORE_OK, "the checkpoint store answers again; hang detection resumes")
        if view.step is not None and view.uri is not None:
            when = iso(view.time) if view.time else None
            self.status.checkpoint = CheckpointStatus(step=view.step, uri=view.uri, time=when)
        if view.progress_step is not None:
            when = iso(view.progress_time) if view.progress_time else None
            old = self.status.progress
            changed = (old is None or old.step != view.progress_step
                       or old.attempt != view.progress_attempt or not old.observed_time)
            # The hang clock runs on the operator's clock, from the pass that first saw this step.
            if changed or old is None:
                self.status.progress = advance(old, ProgressStatus(
                    step=view.progress_step, time=when, attempt=view.progress_attempt,
                    observed_time=iso(self.now)), total, self.now)
            else:
                self.status.progress = old.model_copy(update={"time": when})

    def job_template(self, record: JobTemplateStatus) -> None:
        """status.jobTemplate: the template generation the spec resolved over (an Event when new)."""
        old = self.status.job_template
        if old is None or (old.name, old.generation) != (record.name, record.generation):
            self._event(NORMAL, Reason.TEMPLATE_RESOLVED, f"spec resolved over TrainingJobTemplate "
                        f"{record.name} generation {record.generation}")
        self.status.job_template = record

    def observe_cooperation(self, view: CheckpointView | None) -> None:
        """status.trainer and the TrainerCooperation condition (core/cooperation.py)."""
        status = self.status
        request = status.checkpoint_request
        now = cooperation.Seen() if view is None else cooperation.Seen(
            heartbeat=view.progress_step is not None, contract=view.progress_contract,
            commit=view.step is not None, request_state=request.state if request else None)
        status.trainer = cooperation.seen(status.trainer, now)
        ran = status.progress is not None or status.phase in ("Running", "Recovering", "Succeeded")
        said = cooperation.verdict(status.trainer, store=view is not None, ran=ran)
        self.set(C.TRAINER_COOPERATION, said.status, said.reason, said.message)

    def took_over(self, record: PrefixOwner) -> None:
        """status.resumedFrom, and one Event, once the job took over another run's checkpoints."""
        if record.resumed_step is None or self.status.resumed_from is not None:
            return
        same = record.resumed_uid == record.uid  # the run's own steps, written on another cluster
        self.status.resumed_from = ResumedFromStatus(
            uid=record.resumed_uid or "", step=record.resumed_step, time=iso(record.created),
            same_run=True if same else None)
        if same:
            self._event(NORMAL, Reason.RESUMED_RUN, f"resuming run {record.uid} from step "
                        f"{record.resumed_step}: it was started on another cluster (MultiKueue "
                        "dispatched this job again)")
            return
        whose = f"TrainingJob uid {record.resumed_uid}" if record.resumed_uid else "a run of unknown owner"
        self._event(WARNING, Reason.RESUMED_FOREIGN,
                    f"resuming checkpoints written by {whose}, from step {record.resumed_step} "
                    "(spec.checkpoint.resumePolicy: Always)")

    def _store_failing_since(self) -> datetime | None:
        """When the reads of a store that answered before began to fail (now: this pass's is the
        first); None when it never answered or is already reported unreachable."""
        cond = self.status.condition(C.STORE_REACHABLE)
        if cond is None or cond.status != "True":
            return None
        if cond.reason != Reason.STORE_ERRORS or _FAILING_SINCE not in cond.message:
            return self.now
        stamp = cond.message.split(_FAILING_SINCE, 1)[1].split(" ", 1)[0]
        try:
            return parse(stamp)
        except ValueError:
            return self.now

    def running_since(self) -> datetime | None:
        ready = self.status.condition(C.READY)
        if ready is None or ready.status != "True" or not ready.last_transition_time:
            return None
        return parse(ready.last_transition_time)

    def store_reachable_since(self) -> datetime | None:
        """When the checkpoint store last began answering (heartbeats are visible from then)."""
        cond = self.status.condition(C.STORE_REACHABLE)
        if cond is None or cond.status != "True" or not cond.last_transition_time:
            return None
        return parse(cond.last_transition_time)

    def attempt_started(self) -> datetime | None:
        started = self.status.attempt_start_time
        return parse(started) if started else None

    # --- the pass's bookkeeping ----------------------------------------------

    def select(self, selector: str) -> None:
        """status.selector: the label selector of the job's pods (the scale subresource's)."""
        self.status.selector = selector

    def at_attempt(self, attempt: int) -> None:
        """The restart epoch the job is at (its pods may not exist yet)."""
        self.status.attempt = attempt

    def generation_observed(self) -> None:
        """status.observedGeneration: the job acts on its spec of this generation."""
        self.status.observed_generation = self.generation

    def template_current(self) -> None:
        """status.templateGeneration: the running pods have this generation's pod template."""
        self.status.template_generation = self.generation

    # --- configuration and placement ----------------------------------------

    def config_invalid(self, reason: str, message: str) -> None:
        # An Event for each new reason, not only the first: a job refused for one reason and then
        # for another (its namesake's checkpoints, then its namesake's pods) must say so.
        before = self.status.condition(C.CONFIG_VALID)
        self.set(C.CONFIG_VALID, False, reason, message)
        if before is None or before.status != "False" or before.reason != reason:
            self._event(WARNING, reason, message)

    def config_ok(self) -> None:
        self.set(C.CONFIG_VALID, True, Reason.CONFIG_OK, "references resolve")

    def unschedulable(self, reason: str, message: str) -> None:
        self._waiting_phase()
        if self.set(C.SCHEDULABLE, False, reason or Reason.INSUFFICIENT_CAPACITY, message):
            self._event(WARNING, reason or Reason.INSUFFICIENT_CAPACITY, message)
        if reason in (Reason.UNKNOWN_GPU_TYPE, DEGREE_NOT_ALLOWED):
            self.config_invalid(reason, message)  # no capacity change can fix it: the spec must

    def placement(self, outcome: PlanOutcome) -> str:
        """Record where the gang runs now (status.placement, the Schedulable condition); the
        summary line."""
        summary = (
            f"{len(outcome.assignments)} pods on {outcome.nodes} nodes, {outcome.racks} racks, "
            f"{outcome.blocks} blocks; pool {outcome.pool}; data={outcome.data}"
        )
        self.status.placement = PlacementSummary(
            nodes=outcome.nodes, racks=outcome.racks, blocks=outcome.blocks, cost=outcome.cost,
            mode=outcome.mode, message=summary,
        )
        self.set(C.SCHEDULABLE, True, Reason.PLACED, summary)
        return summary

    def placed(
        self, outcome: PlanOutcome, par: Parallelism, previous_data: int, resume: int | None,
        why: str = "",
    ) -> None:
        st = self.status
        first = st.start_time is None
        st.parallelism = CurrentParallelism(tensor=par.tensor, pipeline=par.pipeline, data=outcome.data)
        st.pool = outcome.pool
        summary = self.placement(outcome)
        st.attempt_start_time = iso(self.now)
        if first:
            st.start_time = iso(self.now)
            st.phase = "Starting"
            self._event(NORMAL, Reason.PLACED, summary)
            return
        st.phase = "Recovering"
        rec = st.recovery or RecoveryStatus()
        kind = elastic.resize_kind(previous_data, outcome.data)
        rec.mode = kind or outcome.mode
        rec.resume_step, rec.resume_reason = resume, why or None
        st.recovery = rec
        step = "from scratch" if resume is None else f"from step {resume}"
        default = "no committed checkpoint" if resume is None else "the newest commit"
        self._event(NORMAL, Reason.RESTARTED,
                    f"attempt {st.attempt} {step}: {why or default}; {rec.mode}: {summary}")
        if kind == "shrink":
            self._event(WARNING, Reason.SHRUNK, f"data degree {previous_data} -> {outcome.data}")
        elif kind == "grow":
            self._event(NORMAL, Reason.GREW, f"data degree {previous_data} -> {outcome.data}")

    # --- the gang's life -----------------------------------------------------

    def pods_pending(self, running: int, expected: int, detail: str = "") -> None:
        why = f"; {detail}" if detail else ""
        self.set(C.READY, False, Reason.PODS_PENDING, f"{running}/{expected} pods Running{why}")

    def pods_refused(self, reason: str, message: str) -> None:
        """The API server refused pods of the gang: the edge saw it acting on the last pass's
        launch (Observed.refusal), and this pass says it."""
        st = self.status
        if st.attempt == 0 and st.restarts == 0:
            st.phase, st.start_time = "Pending", None  # the first attempt never started
        else:
            self._waiting_phase()
        if self.set(C.PODS_CREATED, False, reason, message):
            self._event(WARNING, reason, message)

    def pods_accepted(self, attempt: int, count: int) -> bool:
        """The API server took every pod of a launch after refusing earlier ones: the refusal
        is over (True: the condition changed). Said from what the edge saw creating them
        (Observed.accepted), not from the pods, since the next pass may never see those pods
        (deleted at once by a fault) and a stale refusal would otherwise fail the job on
        `schedulingTimeoutSeconds` measured from long before."""
        cond = self.status.condition(C.PODS_CREATED)
        if cond is None or cond.status != "False" or cond.reason not in REFUSAL_REASONS:
            return False
        return self.set(C.PODS_CREATED, True, Reason.PODS_CREATED_OK,
                        f"attempt {attempt}: {count} pods created")

    def running(self) -> float | None:
        """Every pod Running; returns the recovery time when a recovery just finished."""
        st = self.status
        st.phase = "Running"
        n = st.placement.nodes if st.placement else 0
        if self.set(C.READY, True, Reason.PODS_RUNNING, f"all pods Running on {n} nodes"):
            self._event(NORMAL, Reason.PODS_RUNNING, f"attempt {st.attempt}: all pods Running")
        if st.progress is not None:
            self.set(C.PROGRESSING, True, Reason.PROGRESS_OK, f"step {st.progress.step}")
        rec = st.recovery
        if rec is None or rec.started is None:
            return None
        # Measured on the millisecond clock the status stores, so that podsRunning (computed
        # later from the stored times) reads the same as lastSeconds.
        now = iso(self.now)
        seconds = max(0.0, (parse(now) - parse(rec.started)).total_seconds())
        rec.last_seconds = round(seconds, 3)
        rec.started = None
        rec.awaiting_attempt, rec.pods_running_time = st.attempt, now
        if rec.fault_time is None:
            rec.fault_time = iso(parse(now) - timedelta(seconds=seconds))
        self.set(C.RECOVERING, False, Reason.PODS_RUNNING, f"recovered in {seconds:.2f}s")
        self._event(NORMAL, "Recovered", f"attempt {st.attempt} Running {seconds:.2f}s after the failure")
        return seconds

    def first_step(self, view: CheckpointView | None) -> tuple[float, str] | None:
        """The awaited attempt's first step is in: (time to first step, cause), once per recovery.

        The trainer's own first-step time is used when it is plausible (after the pods were
        Running, not in the operator's future); otherwise the operator's observation.
        """
        rec, st = self.status.recovery, self.status
        if (rec is None or rec.awaiting_attempt is None or rec.awaiting_attempt != st.attempt
                or view is None or not view.reachable or view.progress_attempt != st.attempt
                or rec.fault_time is None or rec.pods_running_time is None):
            return None
        fault, running = parse(rec.fault_time), parse(rec.pods_running_time)
        start = view.progress_start
        done = self.now
        if start is not None and running <= start.first_step_time <= self.now:
            done = start.first_step_time
        total = max(0.0, (done - fault).total_seconds())
        phases = RecoveryPhases(pods_running=round((running - fault).total_seconds(), 3))
        if start is not None and done is start.first_step_time:
            process = max(0.0, (start.process - running).total_seconds())
            phases.process_start = round(process, 3)
            phases.checkpoint_load = round(start.load_seconds, 3)
            rest = total - (phases.pods_running or 0.0) - process - start.load_seconds
            phases.startup_and_first_step = round(max(0.0, rest), 3)
        rec.time_to_first_step_seconds, rec.phases = round(total, 3), phases
        rec.awaiting_attempt = None
        self._event(NORMAL, "FirstStep",
                    f"attempt {st.attempt} trained step {view.progress_step} {total:.1f}s after the "
                    f"{rec.cause or 'failure'}")
        return total, rec.cause or "application"

    def summarize(self) -> None:
        """status.reason/message: why the job is in its phase, from the condition that explains it."""
        st = self.status
        order = {
            "Failed": (C.FAILED,), "Succeeded": (C.SUCCEEDED,), "Suspended": (C.SUSPENDED,),
            "Running": (C.STORE_REACHABLE, C.PROGRESSING, C.RECOVERING, C.READY),
        }.get(st.phase, (C.CONFIG_VALID, C.ADMITTED, C.PODS_CREATED, C.SCHEDULABLE, C.STORE_REACHABLE,
                         C.RECOVERING, C.READY))
        wanted = {C.FAILED: "True", C.SUCCEEDED: "True", C.RECOVERING: "True"}
        if st.phase == "Suspended":
            wanted[C.SUSPENDED] = "True"
        suspending = st.condition(C.SUSPENDED)
        if st.phase == "Running" and suspending is not None and suspending.reason == Reason.SUSPENDING:
            st.reason, st.message = suspending.reason, suspending.message  # saving before it stops
            return
        for type_ in order:
            cond = st.condition(type_)
            if cond is not None and cond.status == wanted.get(type_, "False"):
                st.reason, st.message = cond.reason, cond.message
                return
        ready = st.condition(C.READY)
        st.reason = ready.reason if ready else None
        st.message = ready.message if ready else None

