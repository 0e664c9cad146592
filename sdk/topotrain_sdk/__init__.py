"""topotrain-sdk: the trainer side of topotrain's operator -> trainer contract, for any trainer.

    import topotrain_sdk as tt

    job = tt.job()                          # mesh sizes, rank order, ranks, attempt, resume step...
    mesh = tt.device_mesh({"data": "dp"})   # a DeviceMesh in the operator's rank order
    state = tt.TrainState(model, optimizer)
    start = tt.load_latest(state)           # the committed step this attempt resumes from, or 0
    for step in range(start + 1, steps + 1):
        ...                                 # forward, backward, optimizer step
        tt.step_done(step, state, loss=loss)  # heartbeat, interval saves, requests, SIGTERM, holds
    tt.finish(steps)

Stdlib and boto3 only at import; torch is imported by the calls that need it. Run the script
with `topotrain-launch -- python train.py` as the pod's command (docs/byo-trainer.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from topotrain_sdk.contract import EXIT_BAD_CONFIG, EXIT_DONE, EXIT_PEER_LOST, EXIT_STOPPED
from topotrain_sdk.control import Decision
from topotrain_sdk.job import Job
from topotrain_sdk.job import job as _describe
from topotrain_sdk.mesh import device_mesh, world_mesh
from topotrain_sdk.session import Session

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from topotrain_sdk.folder import FolderSteps
    from topotrain_sdk.state import TrainState

__all__ = [
    "EXIT_BAD_CONFIG", "EXIT_DONE", "EXIT_PEER_LOST", "EXIT_STOPPED", "Decision", "FolderSteps", "Job",
    "Session", "TrainState", "checkpoint_requested", "device_mesh", "download_folder", "finish",
    "folder_steps", "job", "load_latest", "report_progress", "save", "session", "step_done",
    "stop_requested", "upload_folder", "wait", "world_mesh",
]  # fmt: skip
__version__ = "0.1.0"

_session: Session | None = None
_folder_steps: FolderSteps | None = None


def job() -> Job:
    """This process's job, as the operator describes it (a local one outside a TrainingJob)."""
    return session().job


def session() -> Session:
    """The process's Session, made on first use (it installs the SIGTERM handler)."""
    global _session
    if _session is None:
        _session = Session(_describe())
    return _session


def load_latest(state: Stateful) -> int:
    """Load the checkpoint this attempt resumes from into `state`; the step, or 0 (fresh)."""
    return session().load_latest(state)


def save(step: int, state: Stateful, *, blocking: bool = False) -> None:
    """Checkpoint `step` to the job's store, asynchronously (every rank calls it)."""
    session().save(step, state, blocking=blocking)


def wait() -> None:
    """Block until the save in flight has committed or failed."""
    session().wait()


def report_progress(step: int, **metrics: float) -> None:
    """A `step` log line and the throttled heartbeat; never blocks the step."""
    session().report_progress(step, **metrics)


def checkpoint_requested() -> bool:
    """At a step boundary, on every rank together: did the operator ask for a checkpoint?"""
    return session().poll().checkpoint


def stop_requested() -> bool:
    """This process got SIGTERM (the pod is stopping): save, commit and exit EXIT_STOPPED."""
    return session().control.terminated


def step_done(step: int, state: Stateful, **metrics: float) -> None:
    """Everything due after optimizer step `step`; raises SystemExit when the pod stops."""
    session().step_done(step, state, **metrics)


def finish(step: int | None = None) -> None:
    """After the last step: the save in flight commits, the last heartbeat is written."""
    session().finish(step)


def upload_folder(step: int, folder: Path | str) -> bool:
    """The folder adapter: upload a local DCP folder as checkpoint `step` and commit it."""
    from topotrain_sdk.folder import upload_folder as upload

    return upload(session(), step, folder)


def download_folder(step: int, dest: Path | str) -> Path:
    """The folder adapter: download committed `step` into `dest` before the trainer loads it."""
    from topotrain_sdk.folder import download_folder as download

    return download(session(), step, dest)


def folder_steps() -> FolderSteps:
    """The step boundaries of a trainer that saves its own checkpoint folders (Hugging Face
    `Trainer`, torchtitan): `resume()`, `after_step(step)`, `saved(step, folder)`."""
    global _folder_steps
    if _folder_steps is None:
        from topotrain_sdk.folder import FolderSteps

        _folder_steps = FolderSteps(session())
    return _folder_steps


def __getattr__(name: str) -> Any:
    if name == "FolderSteps":
        from topotrain_sdk.folder import FolderSteps

        return FolderSteps
    if name == "TrainState":  # torch, imported only when asked for
        from topotrain_sdk.state import TrainState

        return TrainState
    raise AttributeError(f"module 'topotrain_sdk' has no attribute {name!r}")
