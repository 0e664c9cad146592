"""Runs `python -m topotrain_trainer` as a pod would (the trainer spawns its local
ranks through torchrun) and reads its JSON log lines.

These are real local processes with real torch.distributed (gloo on CPU); no
kubelet is involved. `kill()` SIGKILLs the launcher and every rank, as a node
failure would.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from topotrain.contract import TrainerEnv

REPO_ROOT = Path(__file__).resolve().parents[2]
HANG_LIMIT = 900.0  # seconds; only to fail a hung run, never a timing assertion


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def trainer_env(
    *,
    tensor: int = 1,
    pipeline: int = 1,
    data: int = 1,
    training: dict[str, Any],
    s3_env: dict[str, str] | None = None,
    checkpoint_uri: str = "",
    interval: int = 0,
    keep: int = 10,
    resume_step: int | None = None,
    attempt: int = 0,
) -> dict[str, str]:
    world = tensor * pipeline * data
    contract = TrainerEnv(
        master_addr="127.0.0.1", master_port=free_port(), nnodes=1, node_rank=0,
        nproc_per_node=world, tensor=tensor, pipeline=pipeline, data=data,
        attempt=attempt, checkpoint_uri=checkpoint_uri, resume_step=resume_step,
        job_name="test", job_namespace="trainer", checkpoint_interval=interval,
        checkpoint_keep=keep, training_config=json.dumps(training),
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(contract.to_env())
    env.update(s3_env or {})
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun gives each rank its own session, so a
    process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class TrainerRun:
    """One pod's trainer: the launcher and its ranks, with rank 0's events."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "topotrain_trainer"],
            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.events: list[dict[str, Any]] = []
        self.output: list[str] = []
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.events.append(event)
                self._queue.put(event)
        self._queue.put(None)

    def tail(self, lines: int = 40) -> str:
        return "".join(self.output[-lines:])

    def wait_for(self, event: str, step: int | None = None) -> dict[str, Any]:
        """Block until rank 0 logs `event` (at `step`); fails if the run ends first."""
        deadline = time.monotonic() + HANG_LIMIT
        while time.monotonic() < deadline:
            try:
                got = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if got is None:
                raise AssertionError(f"trainer exited before {event} {step}:\n{self.tail()}")
            if got.get("event") == event and (step is None or got.get("step") == step):
                return got
        raise AssertionError(f"no {event} {step} within {HANG_LIMIT}s:\n{self.tail()}")

    def signal_all(self, sig: signal.Signals) -> None:
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL the launcher and every rank at once (a node dying)."""
        ranks = descendants(self.proc.pid)
        self.signal_all(signal.SIGSTOP)  # freeze first so nothing runs on between kills
        for pid in [self.proc.pid, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._reader.join(timeout=10)

    def finish(self) -> int:
        code = self.proc.wait(timeout=HANG_LIMIT)
        self._reader.join(timeout=10)
        return code

    def losses(self) -> dict[int, float]:
        return {int(e["step"]): float(e["loss"]) for e in self.events if e.get("event") == "step"}

    def grad_norms(self) -> dict[int, float]:
        return {
            int(e["step"]): float(e["grad_norm"]) for e in self.events if e.get("event") == "step"
        }
