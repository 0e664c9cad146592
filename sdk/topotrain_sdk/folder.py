"""The folder adapter: for trainers that write DCP checkpoints to a local folder themselves.

`upload_folder(session, step, folder)` after such a save: on every pod, local rank 0 uploads
the files of `folder` (its pod's ranks' shards; rank 0's pod also `.metadata`) into the step's
attempt directory; once every pod has, global rank 0 writes COMMITTED and applies retention.
`download_folder(session, step, dest)` before the trainer's own load: local rank 0 of each
pod downloads the committed step into `dest`; every rank waits for it. torch.distributed is
used for the agreement (the session's gloo group).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from topotrain_sdk.session import Session

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
