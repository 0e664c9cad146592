"""Training metrics: a Prometheus endpoint (local rank 0 of each pod) and JSON log lines.

Every log line is one JSON object on stdout with an "event" key (`step`,
`checkpoint_saved`, `checkpoint_committed`, `checkpoint_failed`, `restored`,
`done`); only global rank 0 writes them, so a pod log reads as one job.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, start_http_server

if TYPE_CHECKING:
    from torch import device as torch_device

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
TFLOPS = Gauge("topotrain_tflops_per_device", "Model TFLOP/s per device over the last step")
MFU = Gauge("topotrain_mfu", "Model FLOPs utilisation of the last step (of the device's dense bf16 peak)")
PEAK_MEMORY = Gauge("topotrain_peak_memory_bytes", "Peak GPU memory allocated by this rank")
DATA_WAIT = Gauge("topotrain_data_wait_seconds", "Seconds the last step waited for its batch")

# Dense bf16 peak FLOP/s by device name (vendor datasheets, without sparsity), for MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device_name: str) -> float | None:
    return next((flops for name, flops in PEAK_FLOPS.items() if name in device_name), None)


def throughput(flops_per_token: float, tokens: int, seconds: float, devices: int,
               peak: float | None) -> tuple[float, float | None]:  # fmt: skip
    """(model TFLOP/s per device, MFU or None without a known peak)."""
    if seconds <= 0 or devices < 1:
        return 0.0, None
    achieved = flops_per_token * tokens / seconds / devices
    return achieved / 1e12, (achieved / peak if peak else None)


class Metrics:
    def __init__(self, rank: int, local_rank: int, port: int) -> None:
        self.rank = rank
        self.serving = False
        self.flops_per_token, self.devices = 0.0, 1
        self.peak: float | None = None
        self.cuda: torch_device | None = None
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

    def throughput(self, flops_per_token: float, devices: int, device: torch_device) -> None:
        """What MFU and TFLOP/s are computed from: the model, the world size, the device."""
        import torch

        self.flops_per_token, self.devices = flops_per_token, devices
        if device.type == "cuda":
            self.cuda = device
            self.peak = peak_flops(torch.cuda.get_device_name(device))

    def step(self, step: int, loss: float, grad_norm: float, seconds: float, tokens: int, log: bool,
             *, data_wait: float = 0.0) -> None:  # fmt: skip
        STEP.set(step)
        STEP_SECONDS.set(seconds)
        TOKENS_PER_SECOND.set(tokens / seconds if seconds > 0 else 0.0)
        LOSS.set(loss)
        DATA_WAIT.set(data_wait)
        tflops, mfu = throughput(self.flops_per_token, tokens, seconds, self.devices, self.peak)
        TFLOPS.set(tflops)
        if mfu is not None:
            MFU.set(mfu)
        record: dict[str, Any] = {"event": "step", "step": step, "loss": loss, "grad_norm": grad_norm,
                                  "step_seconds": round(seconds, 4), "data_wait_seconds": round(data_wait, 4),
                                  "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else 0.0,
                                  "tflops_per_device": round(tflops, 4)}  # fmt: skip
        if mfu is not None:
            record["mfu"] = round(mfu, 4)
        if self.cuda is not None:
            import torch

            peak_memory = torch.cuda.max_memory_allocated(self.cuda)
            PEAK_MEMORY.set(peak_memory)
            record["peak_memory_bytes"] = peak_memory
        if log:
            self.emit(record)
