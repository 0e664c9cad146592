"""The folder adapter: for trainers that write DCP checkpoints to a local folder themselves.

`upload_folder(session, step, folder)` after such a save: on every pod, local rank 0 uploads
the files of `folder` (its pod's ranks' shards; rank 0's pod also `.metadata`) into the step's
attempt directory; once every pod has, global rank 0 writes COMMITTED and applies retention.
`download_folder(session, step, dest)` before the trainer's own load: local rank 0 of each
pod downloads the committed step into `dest`; every rank waits for it. torch.distributed is
used for the agreement (the session's gloo group). `FolderSteps`: the step boundaries around
such a trainer's own saves (interval, checkpoint requests, SIGTERM, holds, planned stops).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from topotrain_sdk.control import Decision, exit_code
from topotrain_sdk.session import HOLD_POLL_SECONDS, Session

if TYPE_CHECKING:
    from topotrain_sdk.dcp import Checkpointer


def _checkpointer(session: Session) -> Checkpointer:
    checkpointer = session.checkpointer()
    if checkpointer is None:
        raise ValueError("no checkpoint store: TOPOTRAIN_CHECKPOINT_URI is empty")
    return checkpointer


def upload_folder(session: Session, step: int, folder: Path | str) -> bool:
    """Upload `folder` as checkpoint `step` and commit it (every rank calls); whether it committed."""
    import torch.distributed as dist

    checkpointer, store = _checkpointer(session), session.store
    assert store is not None
    sent, error = 0, ""
    if session.job.local_rank == 0:
        try:
            root = Path(folder)
            for path in sorted(p for p in root.rglob("*") if p.is_file()):
                store.upload_file(step, path.relative_to(root).as_posix(), path,
                                  shards=checkpointer.shards)  # fmt: skip
                sent += path.stat().st_size
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
    reports: list[Any] = [None] * dist.get_world_size(checkpointer.group)
    dist.all_gather_object(reports, (sent, 0.0, error), group=checkpointer.group)
    if session.job.rank == 0:
        checkpointer.commit(step, reports, 0.0, session.control.served)
    outcome = [checkpointer.committed == step]
    dist.broadcast_object_list(outcome, src=0, group=checkpointer.group)
    return bool(outcome[0])


def download_folder(session: Session, step: int, dest: Path | str) -> Path:
    """Download committed `step` into `dest` (local rank 0 of each pod; every rank waits)."""
    import torch.distributed as dist

    checkpointer, store = _checkpointer(session), session.store
    assert store is not None
    target = Path(dest)
    if session.job.local_rank == 0:
        target.mkdir(parents=True, exist_ok=True)
        store.download_step(step, target)
    dist.barrier(group=checkpointer.group)
    return target


class FolderSteps:
    """Step boundaries for a trainer that saves its own checkpoint folders (a Hugging Face
    `Trainer`, torchtitan): the folder adapter's counterpart of `Session.step_done`.

        resume = steps.resume()             # the committed folder to load, or None (fresh)
        ...                                 # each optimizer step, on every rank:
        if steps.after_step(step, loss=l):  # progress; True: save `step` to a folder now,
            folder = own_save(step)         # then hand it over (uploaded, committed; on
            steps.saved(step, folder)       # SIGTERM: SystemExit with the exit code)

    `after_step` and `saved` wait where `step_done` waits (a hold, a test aid; a planned stop's
    pause), serving checkpoint requests (a new request while waiting at a saved step commits
    the same folder again, naming it) and SIGTERM. Every rank calls them at the same steps.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.stop = False  # the save asked for is a stop's: `saved` exits after it commits
        self.committed: int | None = None  # the last step this process's saves committed
        self._decision: Decision | None = None
        self._waited = False

    def folder(self, name: str) -> Path:
        """A folder on this pod's own disk for the trainer's checkpoint folders (under the
        session's staging; one per attempt, emptied as it is made)."""
        path = self.session.staging / f"attempt-{self.session.job.attempt}" / name
        if self.session.job.local_rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def resume(self, dest: Path | str | None = None) -> Path | None:
        """Download the committed step this attempt resumes from (TOPOTRAIN_RESUME_STEP; outside
        a TrainingJob the store's newest) into `dest` (default: a folder of this pod's; "{step}"
        in it is replaced by the step); None when starting fresh. Every rank calls it."""
        session, store = self.session, self.session.store
        step = session.job.resume_step
        if step is None and not session.job.in_training_job and store is not None:
            latest = store.latest_committed()
            step = None if latest is None else latest.step
        if step is None:
            return None
        if store is None:
            raise FileNotFoundError("TOPOTRAIN_RESUME_STEP is set but TOPOTRAIN_CHECKPOINT_URI is empty")
        began = time.perf_counter()
        into = Path(str(dest).format(step=step)) if dest is not None else self.folder(f"resume-{step}")
        target = download_folder(session, step, into)
        commit = store.read_commit(step)
        session.control.served = commit.request if commit is not None else ""  # never served twice
        session.load_seconds = time.perf_counter() - began
        session.emit({"event": "restored", "step": step, "load_seconds": round(session.load_seconds, 4)})
        return target

    def after_step(self, step: int, **metrics: float) -> bool:
        """Progress (the `step` line, the heartbeat), then the boundary: True when the trainer
        must save `step` now and call `saved(step, folder)`; waits here while held or paused."""
        self.session.report_progress(step, **metrics)
        if self._due(step, held=False):
            return True
        return self._wait(step, None)

    def saved(self, step: int, folder: Path | str) -> None:
        """The trainer saved `step` into `folder` (every rank; each pod's own folder): upload,
        commit; raises SystemExit with the exit code after a stop's save; else waits here while
        held or paused (keep `folder` until this returns)."""
        committed = self._commit(step, folder)
        if self.stop:
            self._exit(step, committed)
        self._wait(step, folder)

    def _due(self, step: int, *, held: bool) -> bool:
        session = self.session
        decision = session.poll(held)
        session.released = session.released or decision.released
        interval = session.job.checkpoint_interval
        self.stop = decision.stop
        self._decision = decision
        return decision.stop or decision.checkpoint or (not held and bool(interval) and step % interval == 0)

    def _commit(self, step: int, folder: Path | str) -> bool:
        committed = upload_folder(self.session, step, folder)
        self.committed = step if committed else self.committed
        if self._decision is not None:
            self.session.served(step, self._decision)
            self._decision = None
        return committed

    def _wait(self, step: int, folder: Path | str | None) -> bool:
        """Wait while held or paused. Before this step's save (`folder` None): True when a
        request or SIGTERM needs the save now. After it: serve them with the saved folder."""
        session = self.session
        if not session.waiting(step):
            return False
        planned = session.control.paused
        if not self._waited:
            session.emit({"event": "paused" if planned else "held", "step": step})
        self._waited = True
        while session.waiting(step):
            time.sleep(HOLD_POLL_SECONDS)
            if not self._due(step, held=True):
                continue
            if folder is None:
                return True  # the trainer saves; `saved` waits on
            served = self._decision is not None and self._decision.checkpoint
            committed = self._commit(step, folder) if served or not self.stop else self.committed == step
            if self.stop:  # this step's folder is committed already (again, if a request came too)
                self._exit(step, committed)
        self._waited = False
        session.emit({"event": "resumed" if planned else "released", "step": step})
        return False

    def _exit(self, step: int, committed: bool) -> None:
        session = self.session
        code = exit_code(session.control.terminated, committed)
        session.emit({"event": "stopped", "step": step, "committed": committed,
                      "reason": "SIGTERM", "exit_code": code})  # fmt: skip
        session.finish(step)
        raise SystemExit(code)
