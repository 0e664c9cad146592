"""Asynchronous sharded checkpoints to S3 with DCP, and restore with resharding (torch).

Saving a step:
  1. (training stalls, briefly) `save` collects the state dict: references to
     the live tensors (the `state`'s `state_dict()`), no tensor copies;
  2. (overlapped with the next step's forward and backward) DCP's stager copies
     this rank's shards on a thread of its own into CPU buffers (pinned on a
     GPU) that are reused from one save to the next; before the next optimizer
     step changes the parameters, training waits in `staged()` for that copy,
     which is the rest of the stall;
  3. (background) DCP writes the copy to a rank-private staging directory on
     local disk (`__<rank>_0.distcp`; rank 0 also writes `.metadata`), then this
     rank uploads its files with boto3 into `<job>/step-N/attempt-K-<token>/`, a
     directory no other attempt or trainer run writes (K: this attempt; the
     token is drawn by rank 0 once per run and shared with every rank);
  4. every rank reports success over a gloo group; rank 0 writes `COMMITTED`,
     naming that directory, only if all uploads finished, then applies retention.

The stall (steps 1 and 2, plus any wait for the previous save) is reported as a
`checkpoint_saved` event once the copy is complete. A failed upload (S3 outage)
leaves `step-N` without `COMMITTED`: the operator never restores it, retention
collects it later, and training carries on. At most one save is in flight; the
next one waits for it.

Restoring: every rank reads only the byte ranges of the chunks its own shards
need, straight from the store (`s3reader.S3RangeReader`: parallel ranged GETs,
a bounded memory window, nothing written to local disk). DCP keys tensors by
parameter name and global shape, so a different data degree (and tensor/pipeline
split) reshards on load.

The state is any DCP `Stateful` (state_dict / load_state_dict). One with a `load_rng`
attribute (the bundled trainer's AppState) is told whether the checkpoint's mesh is the
current one: RNG streams are per rank, restored only on the same mesh.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from topotrain_sdk.checkpoints import CheckpointStore, attempt_dir
from topotrain_sdk.progress import Heartbeat as Heartbeat  # re-exported: the trainer's import
from topotrain_sdk.s3reader import S3RangeReader


@dataclass
class _Pending:
    """A save whose state copy may still be running: what its stall is so far."""

    step: int
    started: float  # perf_counter() when `save` was called
    blocked: float  # seconds `save` itself kept training waiting
    staging: Future[Any] | None  # done when the CPU copy is complete
    blocking: bool
    staged_at: float = 0.0  # perf_counter() when the copy completed


def staging_options() -> StagingOptions:
    """Copy on a thread of its own; pinned memory and a side stream where there is a GPU."""
    accelerator = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=accelerator,
        use_shared_memory=False,  # the upload runs on a thread, not a process
        use_async_staging=True,
        use_non_blocking_copy=accelerator,
    )


def make_stager() -> DefaultStager:
    """DCP's stager with `staging_options()`.

    One stager lives as long as the Checkpointer: it keeps its CPU buffers
    between saves, so the second and later copies allocate nothing.
    """
    return DefaultStager(staging_options())


class Checkpointer:
    """Saves and restores one job's checkpoints; one instance per rank.

    The training loop calls `save` after an optimizer step and `staged()` before
    the next optimizer step; `close()` after the last step.
    """

    def __init__(
        self,
        store: CheckpointStore,
        staging: Path,
        mesh_sizes: dict[str, int],
        keep: int,
        on_event: Callable[[dict[str, Any]], None] = lambda _: None,
        stager: AsyncStager | None = None,
        attempt: int = 0,
    ) -> None:
        self.store = store
        self.staging = staging
        self.mesh_sizes = mesh_sizes
        self.keep = keep
        self.on_event = on_event
        self.rank = dist.get_rank()
        # A separate gloo group: checkpoint collectives run on background threads
        # and must not interleave with training collectives.
        self.group = dist.new_group(backend="gloo")
        token = [uuid.uuid4().hex[:8] if self.rank == 0 else ""]
        dist.broadcast_object_list(token, src=0, group=self.group)
        self.attempt = attempt
        self.shards = attempt_dir(attempt, str(token[0]))  # this run's directory in each step
        self._stager = stager or make_stager()
        self._pending: _Pending | None = None
        self._inflight: threading.Thread | None = None
        self.last_saved: int | None = None  # the step of the last save started
        self.committed: int | None = None  # rank 0: the last step this run committed
        self.restored_request = ""  # the checkpoint request the restored checkpoint served

    def save(self, step: int, app: Stateful, *, blocking: bool = False, request: str = "") -> None:
        """Start saving `step` (or save it completely when `blocking`); `request`: the last
        checkpoint request served at or before `step` (rank 0's value goes into COMMITTED, so
        a resume from it does not serve that request again)."""
        started = time.perf_counter()
        self.wait()
        self.last_saved = step
        local = self.staging / f"step-{step:010d}" / f"rank-{self.rank:05d}"
        shutil.rmtree(local, ignore_errors=True)
        writer = FileSystemWriter(local, single_file_per_rank=True, overwrite=True)
        state = {"app": app.state_dict()}  # references to the live tensors, captured now
        if blocking:
            self._finish(step, partial(dcp_save, state, storage_writer=writer, process_group=self.group),
                         local, request)
            self._pending = _Pending(step, started, time.perf_counter() - started, None, True)
            self.staged()
            return
        if torch.accelerator.is_available():
            # The stager copies on a side stream that does not wait for the compute
            # stream: the optimizer step's kernels must be done before it reads.
            torch.accelerator.synchronize()
        copied = self._stager.stage(state)
        staging: Future[Any] | None = copied if isinstance(copied, Future) else None
        pending = _Pending(step, started, time.perf_counter() - started, staging, False)
        if staging is not None:
            staging.add_done_callback(lambda _: setattr(pending, "staged_at", time.perf_counter()))
        self._pending = pending

        def write() -> None:
            snapshot = staging.result() if staging is not None else copied
            dcp_save(snapshot, storage_writer=writer, process_group=self.group)

        self._inflight = threading.Thread(
            target=self._finish,
            args=(step, write, local, request),
            name=f"topotrain-ckpt-{step}",
            daemon=True,
        )
        self._inflight.start()

    def staged(self) -> float:
        """Wait until the save in flight holds its own copy of the state.

        Call before anything changes the parameters or the optimizer state (the
        optimizer step). Reports the save's total stall once, as `checkpoint_saved`,
        and returns the seconds waited here.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        waited_from = time.perf_counter()
        if pending.staging is not None:
            error = pending.staging.exception()
            if error is not None:  # host memory trouble: restart from the last committed step
                raise RuntimeError(f"copying checkpoint {pending.step} to CPU failed") from error
        now = time.perf_counter()
        stall = pending.blocked + (now - waited_from)
        self.on_event({
            "event": "checkpoint_saved", "step": pending.step, "stall_seconds": round(stall, 4),
            "copy_seconds": round((pending.staged_at or now) - pending.started, 4),
            "mode": "sync" if pending.blocking else "async",
        })  # fmt: skip
        return now - waited_from

    def wait(self) -> None:
        """Block until the save in flight (if any) has committed or failed."""
        self.staged()
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None

    def save_and_commit(self, step: int, app: Stateful, request: str = "") -> bool:
        """Save `step` synchronously (unless a save of it is in flight: wait for that one) and
        tell every rank whether it committed. For a stop: nothing runs after it."""
        if self.last_saved == step:
            self.wait()
        else:
            self.save(step, app, blocking=True, request=request)
        outcome = [self.committed == step]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        return bool(outcome[0])

    def close(self) -> None:
        """Finish the save in flight and free the staging buffers."""
        self.wait()
        self._stager.close()

    def _finish(self, step: int, write: Callable[[], object], local: Path, request: str = "") -> None:
        """Write this rank's shards, upload them, agree with all ranks, let rank 0 commit."""
        began = time.perf_counter()
        uploaded, upload_seconds, error = 0, 0.0, ""
        try:
            write()
            upload_began = time.perf_counter()
            for path in sorted(p for p in local.iterdir() if p.is_file()):
                self.store.upload_file(step, path.name, path, shards=self.shards)
                uploaded += path.stat().st_size
            upload_seconds = time.perf_counter() - upload_began
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            shutil.rmtree(local, ignore_errors=True)
        reports: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(reports, (uploaded, upload_seconds, error), group=self.group)
        if self.rank == 0:
            self.commit(step, reports, time.perf_counter() - began, request)

    def commit(self, step: int, reports: list[Any], seconds: float, request: str = "") -> None:
        """Rank 0: write COMMITTED once every rank's (bytes, seconds, error) report is clean,
        then apply retention; a `checkpoint_failed` event otherwise."""
        failures = [f"rank {rank}: {error}" for rank, (_, _, error) in enumerate(reports) if error]
        total = sum(int(sent) for sent, _, _ in reports)
        if not failures:
            try:
                self.store.write_commit(step, self.mesh_sizes, total, shards=self.shards,
                                        request=request, attempt=self.attempt)
                self.committed = step
                deleted = self.store.apply_retention(self.keep)
                self.on_event({
                    "event": "checkpoint_committed", "step": step, "bytes": total,
                    "seconds": round(seconds, 4),
                    "upload_seconds": round(max(float(s) for _, s, _ in reports), 4),
                    "deleted": deleted, **({"request": request} if request else {}),
                })  # fmt: skip
                return
            except Exception as err:
                failures.append(f"commit: {type(err).__name__}: {err}")
        self.on_event({"event": "checkpoint_failed", "step": step, "errors": failures[:4]})

    def tidy(self) -> None:
        """Rank 0, as an attempt starts: apply retention once (best effort). The attempt that
        committed last may have died before its retention ran (a pod lost while the store erred),
        and a gang that keeps restarting from that step never commits to run it again."""
        if self.rank != 0:
            return
        try:
            deleted = self.store.apply_retention(self.keep)
        except Exception as err:  # the next commit's retention tries again
            self.on_event({"event": "retention_failed", "error": f"{type(err).__name__}: {err}"[:300]})
            return
        if deleted:
            self.on_event({"event": "retention_applied", "deleted": deleted})

    def restore(self, step: int, app: Stateful, *, whole_step: bool = False) -> RestoreStats:
        """Load committed `step` into `app`, resharding onto the current mesh.

        Each rank reads only its byte ranges from the store (`S3RangeReader`); `whole_step`:
        each machine downloads the whole attempt directory first (the earlier way, kept as
        the benchmark's baseline). Returns what this rank read, and the step's size."""
        commit = self.store.read_commit(step)
        if commit is None:
            raise FileNotFoundError(f"{self.store.step_uri(step)} has no COMMITTED marker")
        self.restored_request = commit.request
        began = time.perf_counter()
        rng_aware = hasattr(app, "load_rng")
        if rng_aware:
            app.load_rng = dict(commit.mesh) == self.mesh_sizes  # type: ignore[attr-defined]
        try:
            try:
                read = self._load(step, commit.shards, app, whole_step)
            except CheckpointException as err:
                # Saved after a resize by a trainer that left the RNG state out of every later
                # save (fixed): same mesh, but no RNG entry to restore. Every rank sees the same
                # collective failure, so every rank loads again without it.
                if not getattr(app, "load_rng", False) or "app.rng_rank" not in str(err):
                    raise
                self.on_event({"event": "restore_without_rng", "step": step})
                app.load_rng = False  # type: ignore[attr-defined]
                read = self._load(step, commit.shards, app, whole_step)
        finally:
            if rng_aware:
                app.load_rng = True  # type: ignore[attr-defined]
        seconds = time.perf_counter() - began
        per_rank: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(per_rank, read, group=self.group)
        return RestoreStats(read, commit.bytes, seconds, tuple(int(n) for n in per_rank))

    def _load(self, step: int, shards: str, app: Stateful, whole_step: bool) -> int:
        """DCP-load `step` into `app`; the bytes this rank fetched."""
        if whole_step:
            return self._restore_downloaded(step, app)
        reader = S3RangeReader(self.store, step, shards)
        dcp_load({"app": app}, storage_reader=reader, process_group=self.group)
        return reader.stats.bytes

    def _restore_downloaded(self, step: int, app: Stateful) -> int:
        """Local rank 0 downloads the step, then DCP loads every local rank's share from disk."""
        downloaded = 0
        local = self.staging / f"restore-{step:010d}"
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not local.exists():
            partial = local.with_name(local.name + f".{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)
            self.store.download_step(step, partial)
            downloaded = sum(p.stat().st_size for p in partial.rglob("*") if p.is_file())
            partial.replace(local)
        dist.barrier(group=self.group)
        dcp_load({"app": app}, storage_reader=FileSystemReader(local), process_group=self.group)
        dist.barrier(group=self.group)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(local, ignore_errors=True)
        return downloaded


@dataclass(frozen=True)
class RestoreStats:
    """One rank's restore: bytes it fetched from the store, the step's shard bytes, seconds."""

    bytes_read: int
    step_bytes: int
    seconds: float
    per_rank: tuple[int, ...] = ()  # bytes_read of every rank, by rank
