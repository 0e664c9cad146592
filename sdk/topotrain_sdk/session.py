"""The trainer side of the contract at run time: one `Session` per process.

`step_done(step, state)` after every optimizer step does what the operator counts on:

1. progress: a `step` log line (global rank 0) and the heartbeat (`progress.json`, rank 0, on
   a thread, at most every `heartbeat_seconds`; the first step of an attempt at once);
2. the step boundary, agreed by every rank in one all-reduce (`control.Control`): SIGTERM
   (save this step, wait for its COMMITTED, exit 75: `EXIT_STOPPED`; a rank stopped because
   another pod got SIGTERM exits 76), the operator's checkpoint request (save this step,
   training goes on), the interval's save (`TOPOTRAIN_CHECKPOINT_INTERVAL`);
3. a wait: after serving a planned stop's checkpoint request (a resize, a drain, a spec roll:
   `contract.planned_stop_request`) no further step is trained until the operator's SIGTERM
   (at most `spec.training.plannedStopSeconds`, default 120); or a hold
   (`spec.training.holdAtStep`/`holdAttempts`, a test aid: docs/trainer.md).

Saves are asynchronous (`dcp.Checkpointer`): `save` returns once this rank's state is
copied to CPU; writing, uploading, the commit and retention run in the background.
torch is imported only when a checkpoint or the boundary's all-reduce needs it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from topotrain_sdk.checkpoints import CheckpointStore, ServedRequest
from topotrain_sdk.contract import CONTRACT_VERSION
from topotrain_sdk.control import Control, Decision, exit_code
from topotrain_sdk.job import Job
from topotrain_sdk.progress import Heartbeat

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from topotrain_sdk.dcp import Checkpointer

HEARTBEAT_SECONDS = 5.0
HOLD_POLL_SECONDS = 0.5
PLANNED_STOP_SECONDS = 120.0  # as the bundled trainer's training.plannedStopSeconds


def process_start() -> datetime:
    """When this process began (Linux: from /proc, so the imports count), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))  # fmt: skip
        return datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"), UTC)
    except (OSError, ValueError, IndexError, StopIteration):
        return datetime.now(UTC)


PROCESS_START = process_start()


class Session:
    """One process's checkpoints, heartbeat and step boundaries in its job."""

    def __init__(
        self, job: Job, *, staging: Path | None = None, heartbeat_seconds: float = HEARTBEAT_SECONDS,
        emit: Callable[[dict[str, Any]], None] | None = None, checkpointer: Checkpointer | None = None,
        heartbeat: Heartbeat | None = None, overlap: bool = False, blocking: bool = False,
    ) -> None:
        """`emit`, `checkpointer`, `heartbeat`: a trainer's own (the bundled trainer's metrics and
        checkpointer); `overlap`: `save` returns before the state copy is done, and the trainer
        calls `Checkpointer.staged()` before its optimizer step; `blocking`: every save commits
        before training goes on."""
        self.job = job
        self.store = CheckpointStore(job.checkpoint_prefix) if job.checkpoint_prefix else None
        self.staging = staging or Path(tempfile.gettempdir()) / f"topotrain-{job.name or 'job'}"
        self.heartbeat_seconds = heartbeat_seconds
        self._emit = emit
        self.overlap, self.blocking = overlap, blocking
        # SIGTERM is acted on at the next step boundary; after serving a planned stop's request
        # the gang waits (up to spec.training.plannedStopSeconds) for the operator's SIGTERM.
        pause = float(job.training.get("plannedStopSeconds", PLANNED_STOP_SECONDS))
        self.control = Control(job.rank, attempt=job.attempt, pause_seconds=pause)
        self._checkpointer: Checkpointer | None = checkpointer
        self._heartbeat: Heartbeat | None = heartbeat
        self._last_beat: float | None = None
        self.load_seconds = 0.0
        self.hold_at = int(job.training.get("holdAtStep", 0) or 0)
        self.hold_attempts = int(job.training.get("holdAttempts", 1) or 0)
        self.released = False
        self._check_contract()

    def _check_contract(self) -> None:
        """Log (global rank 0) an operator that speaks another contract version than this SDK."""
        theirs = self.job.contract_version
        if not self.job.in_training_job or theirs == CONTRACT_VERSION:
            return
        older = "this SDK" if theirs > CONTRACT_VERSION else "the operator"
        self.emit({"event": "contract_mismatch", "operator": theirs, "sdk": CONTRACT_VERSION,
                   "message": f"the operator speaks contract version {theirs}, topotrain-sdk "
                              f"{CONTRACT_VERSION}: {older} is older; upgrade it to match"})  # fmt: skip

    def emit(self, event: dict[str, Any]) -> None:
        """A JSON log line, from global rank 0 only (or the trainer's own `emit`)."""
        if self._emit is not None:
            self._emit(event)
        elif self.job.rank == 0:
            print(json.dumps(event), flush=True)

    # --- checkpoints ---------------------------------------------------------

    def checkpointer(self) -> Checkpointer | None:
        """The rank's checkpointer (created on first use, by every rank together); None
        without a checkpoint store."""
        if self.store is None:
            return None
        if self._checkpointer is None:
            import torch.distributed as dist

            from topotrain_sdk.dcp import Checkpointer

            if not dist.is_initialized():
                if self.job.world_size == 1:  # a local single process: a group of one
                    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
                else:
                    dist.init_process_group("gloo")
            self.staging.mkdir(parents=True, exist_ok=True)
            self._checkpointer = Checkpointer(
                self.store, self.staging, self.job.mesh_sizes, self.job.checkpoint_keep,
                on_event=self.emit, attempt=self.job.attempt,
            )  # fmt: skip
        return self._checkpointer

    def load_latest(self, state: Stateful) -> int:
        """Load the checkpoint this attempt resumes from into `state` (every rank reads only
        what its shards need); the step loaded, 0 when starting fresh. In a TrainingJob that
        is TOPOTRAIN_RESUME_STEP (the operator's newest committed step); outside one, the
        store's newest committed step."""
        step = self.job.resume_step
        if step is None and not self.job.in_training_job and self.store is not None:
            latest = self.store.latest_committed()
            step = None if latest is None else latest.step
        checkpointer = self.checkpointer()
        if step is None or checkpointer is None:
            if step is not None:
                raise FileNotFoundError("TOPOTRAIN_RESUME_STEP is set but TOPOTRAIN_CHECKPOINT_URI is empty")
            return 0
        began = time.perf_counter()
        read = checkpointer.restore(step, state)
        self.control.served = checkpointer.restored_request  # a request is never served twice
        self.load_seconds = time.perf_counter() - began
        self.emit({"event": "restored", "step": step, "load_seconds": round(self.load_seconds, 4),
                   "bytes_read": list(read.per_rank), "step_bytes": read.step_bytes})  # fmt: skip
        checkpointer.tidy()
        return step

    def save(self, step: int, state: Stateful, *, blocking: bool = False, request: str = "") -> None:
        """Save `step` (every rank): returns once this rank's state is copied (`blocking`: once
        committed); the write, upload, COMMITTED and retention follow in the background."""
        checkpointer = self.checkpointer()
        if checkpointer is None:
            return
        checkpointer.save(step, state, blocking=blocking or self.blocking,
                          request=request or self.control.served)  # fmt: skip
        if not self.overlap:
            checkpointer.staged()  # the optimizer may change the parameters from here on

    def wait(self) -> None:
        """Block until the save in flight has committed (or failed)."""
        if self._checkpointer is not None:
            self._checkpointer.wait()

    # --- progress ------------------------------------------------------------

    def report_progress(self, step: int, **metrics: float) -> None:
        """A `step` log line and the heartbeat (throttled, on a thread: never blocks a step)."""
        self.emit({"event": "step", "step": step, **metrics})
        if self.store is None or self.job.rank != 0:
            return
        now = time.monotonic()
        if self._heartbeat is None:
            self._heartbeat = Heartbeat(self.store, self.job.attempt)
            self._heartbeat.first_step(step, PROCESS_START, self.load_seconds)
        elif self._last_beat is None or now - self._last_beat >= self.heartbeat_seconds:
            self._heartbeat.beat(step)
        else:
            return
        self._last_beat = now

    # --- step boundaries -------------------------------------------------------

    def poll(self, held: bool = False) -> Decision:
        """What every rank does at this boundary (one all-reduce when distributed)."""
        return self.control.poll(held)

    def step_done(self, step: int, state: Stateful, **metrics: float) -> None:
        """After optimizer step `step` (1-based: steps done): progress, then the boundary's
        saves; raises SystemExit with the contract's exit code when the pod is stopping."""
        self.report_progress(step, **metrics)
        code = self.boundary(step, state)
        if code is None and (self.holding(step) or self.control.paused):
            code = self.hold(step, state)
        if code is not None:
            self.finish(step)
            raise SystemExit(code)

    def boundary(self, step: int, state: Stateful, *, held: bool = False) -> int | None:
        """The interval's save, a checkpoint request, SIGTERM (save, commit, then the exit
        code to stop with). `held`: a hold's poll (no interval save; a release ends the hold)."""
        decision = self.poll(held)
        checkpointer = self.checkpointer()
        if decision.stop:
            committed = False
            if checkpointer is not None:
                committed = checkpointer.save_and_commit(step, state, self.control.served)
            self.served(step, decision)
            code = exit_code(self.control.terminated, committed)
            self.emit({"event": "stopped", "step": step, "committed": committed,
                       "reason": "SIGTERM", "exit_code": code})  # fmt: skip
            return code
        self.released = self.released or decision.released
        interval = self.job.checkpoint_interval
        if checkpointer is not None and ((not held and interval and step % interval == 0) or decision.checkpoint):
            self.save(step, state)
        self.served(step, decision)
        return None

    def served(self, step: int, decision: Decision) -> None:
        """After the save at `step` that served `decision`'s checkpoint request: the event, and
        the heartbeat names the request at once (rank 0)."""
        if not decision.checkpoint or self.store is None:
            return
        self.emit({"event": "checkpoint_requested", "step": step, "request": decision.request})
        if self._heartbeat is not None and decision.request:
            self._heartbeat.request = ServedRequest(decision.request, step)
            self._heartbeat.beat(step)

    def waiting(self, step: int) -> bool:
        """Whether the gang waits at this boundary: held (a test aid) or paused after serving a
        planned stop's checkpoint request."""
        return self.control.paused or self.holding(step)

    def holding(self, step: int) -> bool:
        """spec.training.holdAtStep (a test aid): this attempt holds at or past that step."""
        return (bool(self.hold_at) and step >= self.hold_at and self.job.attempt < self.hold_attempts
                and not self.released)  # fmt: skip

    def hold(self, step: int, state: Stateful) -> int | None:
        """Wait at this boundary while held (until topotrain.io/hold-release) or paused after a
        planned stop's request (until the SIGTERM, the request called off, or its bound),
        serving checkpoint requests and SIGTERM meanwhile; the exit code of a stop, else None."""
        planned = self.control.paused
        self.emit({"event": "paused" if planned else "held", "step": step})
        while self.waiting(step):
            time.sleep(HOLD_POLL_SECONDS)
            code = self.boundary(step, state, held=True)
            if code is not None:
                return code
        self.emit({"event": "resumed" if planned else "released", "step": step})
        return None

    def finish(self, step: int | None = None) -> None:
        """After the last step: the save in flight commits, the last heartbeat is written."""
        if self._checkpointer is not None:
            self._checkpointer.close()
        if self._heartbeat is not None:
            if step is not None:
                self._heartbeat.beat(step)
            self._heartbeat.flush()
