"""Training metrics: a Prometheus endpoint (local rank 0 of each pod) and JSON log lines.

Every log line is one JSON object on stdout with an "event" key (`step`,
`checkpoint_saved`, `checkpoint_committed`, `checkpoint_failed`, `restored`,
`done`); only global rank 0 writes them, so a pod log reads as one job.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from prometheus_client import Counter, Gauge, start_http_server

STEP_SECONDS = Gauge("topotrain_step_seconds", "Wall time of the last optimizer step")
TOKENS_PER_SECOND = Gauge(
    "topotrain_tokens_per_second", "Global tokens per second over the last step"
)
LOSS = Gauge("topotrain_loss", "Training loss of the last step (global batch mean)")
STEP = Gauge("topotrain_step", "Optimizer steps completed")
CHECKPOINT_STALL = Gauge(
    "topotrain_last_checkpoint_stall_seconds", "Seconds training paused for the last checkpoint"
)
CHECKPOINT_STALL_TOTAL = Counter(
    "topotrain_checkpoint_stall_seconds", "Seconds training paused for checkpoints (all of them)"
)
CHECKPOINTS = Counter("topotrain_checkpoints", "Checkpoints by outcome", ["outcome"])


class Metrics:
    def __init__(self, rank: int, local_rank: int, port: int) -> None:
        self.rank = rank
        self.serving = False
        if port and local_rank == 0:
            try:
                start_http_server(port)
                self.serving = True
            except OSError as err:
                # Metrics never stop training: a port another process of the pod still holds
                # (a worker of an attempt restarted in place that has not let go yet, a sidecar
                # on the same port) costs this attempt its endpoint, and says so.
                self.warn({"event": "metrics_unavailable", "port": port, "error": str(err)})

    @staticmethod
    def warn(record: dict[str, Any]) -> None:
        """A JSON line on stderr, whichever rank: a pod's log shows why its endpoint is missing."""
        sys.stderr.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
        sys.stderr.flush()

    def emit(self, record: dict[str, Any]) -> None:
        """One JSON log line (rank 0 only); checkpoint stalls and outcomes also count."""
        event = str(record.get("event", ""))
        if event == "checkpoint_saved":
            CHECKPOINT_STALL.set(float(record["stall_seconds"]))
            CHECKPOINT_STALL_TOTAL.inc(float(record["stall_seconds"]))
        elif event == "checkpoint_committed":
            CHECKPOINTS.labels("committed").inc()
        elif event == "checkpoint_failed":
            CHECKPOINTS.labels("failed").inc()
        if self.rank == 0:
            line = {"time": round(time.time(), 3), **record}
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()

    def step(
        self, step: int, loss: float, grad_norm: float, seconds: float, tokens: int, log: bool
    ) -> None:
        STEP.set(step)
        STEP_SECONDS.set(seconds)
        TOKENS_PER_SECOND.set(tokens / seconds if seconds > 0 else 0.0)
        LOSS.set(loss)
        if log:
            self.emit({"event": "step", "step": step, "loss": loss, "grad_norm": grad_norm, "step_seconds": round(seconds, 4),
                       "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else 0.0})  # fmt: skip
