"""Requests that reach a running trainer from outside its training loop.

- **SIGTERM** (the kubelet stopping the pod; the pod's supervisor, or torchrun,
  forwards it to every local rank): at the next step boundary every rank of the
  gang saves a checkpoint at the current step and waits for its `COMMITTED`,
  then stops (`exit_code`). The pod's grace period bounds the save.
- **A checkpoint request**: a new value of the pod annotation
  `topotrain.io/checkpoint-request`, which the kubelet writes into the
  downwardAPI control file (`topotrain_sdk.contract.control_path()`). Rank 0 reads
  that small file at every step boundary; at the next boundary every rank saves
  a checkpoint of that step and training goes on. The save's `COMMITTED` and
  `progress.json` name the request it served.
- **A planned stop's checkpoint request** (a value marked by
  `topotrain_sdk.contract.planned_stop_request`, naming this attempt): served the
  same way, but then the gang trains no further step. The operator stops it
  (SIGTERM) once the save is committed and restarts it changed (a new spec, a
  new degree, other nodes) from that step; steps trained meanwhile would be lost,
  or worse, saved by the SIGTERM under the old spec. The gang waits at the served
  step, serving SIGTERM (its save is the served one: nothing newer is committed),
  and trains on only when the operator clears the request (the change was called
  off) or after `training.plannedStopSeconds` without the stop.
- **A hold's release** (a test aid, `training.holdAtStep`): any value of the pod
  annotation `topotrain.io/hold-release` lets a gang held at that step go on; the value
  `attempt-N` (`contract.hold_release_of`) only a gang of attempt N.

One all-reduce (MAX) of the flags per step makes the ranks agree on the step:
a signal reaches different pods at different moments, and only rank 0 reads
the file.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from topotrain_sdk.contract import (
    CHECKPOINT_REQUEST,
    EXIT_PEER_LOST,
    EXIT_STOPPED,
    HOLD_RELEASE,
    control_path,
    hold_released,
    planned_stop_attempt,
    read_control,
)

# EXIT_STOPPED (75, EX_TEMPFAIL, from the contract): stopped on its own SIGTERM after the
# checkpoint of the current step committed, a planned stop; not 0, which reads as "done".
# A rank stopped because a rank in another pod got SIGTERM: this pod is healthy, so the
# supervisor keeps it up for the operator's next attempt, as after a lost peer.
EXIT_PEER_STOPPED = EXIT_PEER_LOST
EXIT_SIGTERM = 128 + signal.SIGTERM  # SIGTERM, but the stop checkpoint did not commit


@dataclass(frozen=True)
class Decision:
    """What every rank does at this step boundary (identical on all ranks, except
    `request`, the annotation value, which only rank 0 knows; "" elsewhere)."""

    stop: bool = False
    checkpoint: bool = False
    request: str = ""
    released: bool = False  # a held gang may go on (asked for only while held)
    pause: bool = False  # the request served here is a planned stop of this attempt: train no more
    resume: bool = False  # a planned stop's wait is over (called off, or its bound passed)


class Control:
    """Watches SIGTERM and the control file; `poll()` at each step boundary, on every rank."""

    def __init__(self, rank: int, path: Path | None = None, served: str = "", *,
                 attempt: int = 0, pause_seconds: float = 0.0) -> None:
        self.rank = rank
        self.path = path or control_path()
        self.served = served  # the last request served (by this run, or by the restored checkpoint)
        self.terminated = False
        self.attempt = attempt  # TOPOTRAIN_ATTEMPT: a planned stop pauses only the attempt it names
        self.pause_seconds = pause_seconds  # 0: a planned stop's request is served as any other
        self.paused = False  # every rank: waiting at a served planned stop's step
        self._pausing = ""  # rank 0: that request's value
        self._pause_deadline = 0.0  # rank 0, time.monotonic()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.terminated = True  # acted on at the next step boundary, never inside a step

    def pending_request(self) -> str:
        """A checkpoint request not served yet ("" when none); read by rank 0 only."""
        return self._read()[0]

    def _read(self) -> tuple[str, bool, bool]:
        """Rank 0: (the pending checkpoint request, whether a hold is released, whether the
        planned stop this gang waits for is over: its request cleared or replaced, or timed out)."""
        if self.rank != 0:
            return "", False, False
        control = read_control(self.path)
        value = control.get(CHECKPOINT_REQUEST, "")
        over = bool(self._pausing) and (value != self._pausing or time.monotonic() >= self._pause_deadline)
        released = hold_released(control.get(HOLD_RELEASE, ""), self.attempt)
        return (value if value and value != self.served else ""), released, over

    def poll(self, held: bool = False) -> Decision:
        """What every rank does at this boundary; `held`: also whether a hold is released."""
        import torch  # imported here: the SDK needs torch only where a trainer has it
        import torch.distributed as dist

        pending, release, over = self._read()
        pause = bool(pending) and self.pause_seconds > 0 and planned_stop_attempt(pending) == self.attempt
        flags = torch.tensor(
            [int(self.terminated), int(bool(pending)), int(held and release), int(pause), int(over)],
            dtype=torch.int64,
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, checkpoint, released, pause, over = (bool(f.item()) for f in flags)
        if checkpoint:
            self.served = pending or self.served
        resume = over and not pause and not stop
        if pause:
            self.paused, self._pausing = True, pending  # ("" on ranks other than 0)
            self._pause_deadline = time.monotonic() + self.pause_seconds
        elif resume:
            self.paused, self._pausing = False, ""
        return Decision(stop, checkpoint, pending if checkpoint else "", released, pause, resume)


def exit_code(terminated: bool, committed: bool) -> int:
    """How a rank that stopped at a step boundary exits."""
    if not terminated:
        return EXIT_PEER_STOPPED
    return EXIT_STOPPED if committed else EXIT_SIGTERM
