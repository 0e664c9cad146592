"""Checkpoint benchmark: how long training stalls per checkpoint (async vs sync),
and how fast checkpoint shards reach S3 compared with plain PUTs to the same
server, measured in the same run.

    python bench/checkpoint.py [--model small] [--repeats 3]

It starts the testbed's S3 server (versitygw) on loopback, builds one rank of
the trainer (gloo, world size 1) with a model and an AdamW state, and saves it
through the trainer's own Checkpointer. Targets: async stall <= 5% of the
synchronous save time; upload throughput >= 70% of raw PUT throughput.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from topotrain.checkpoints import CheckpointStore  # noqa: E402
from topotrain_trainer.checkpoint import AppState, Checkpointer, Progress  # noqa: E402
from topotrain_trainer.config import TrainingConfig  # noqa: E402
from topotrain_trainer.model import model_config  # noqa: E402
from topotrain_trainer.parallel import build_mesh, build_stage  # noqa: E402
from topotrain_trainer.train import make_optimizer  # noqa: E402

from testbed.s3 import S3Server  # noqa: E402


def one_rank_app(model_name: str) -> AppState:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = build_mesh(torch.device("cpu"), 1, 1, 1, "tp-pp-dp")
    config = TrainingConfig(model=model_name)
    model = build_stage(
        model_config(model_name), mesh, seed=0, bf16=False, activation_checkpointing=False
    )
    optimizer, scheduler = make_optimizer(model, config)
    tokens = torch.randint(0, 256, (2, 65))
    loss = torch.nn.functional.cross_entropy(
        model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
    )
    torch.autograd.backward(loss)
    optimizer.step()  # AdamW state exists, as in a real checkpoint
    return AppState(model, optimizer, scheduler, Progress())


def raw_put_seconds(store: CheckpointStore, sizes: list[int]) -> float:
    """Plain put_object of in-memory bytes, object sizes as in the checkpoint."""
    payloads = [os.urandom(size) for size in sizes]
    began = time.perf_counter()
    for index, payload in enumerate(payloads):
        store.client.put_object(Bucket=store.bucket, Key=f"raw/object-{index}", Body=payload)
    return time.perf_counter() - began


def measure(
    checkpointer: Checkpointer,
    app: AppState,
    step: int,
    blocking: bool,
    events: list[dict[str, Any]],
) -> tuple[float, float]:
    """(stall seconds, seconds until committed)."""
    began = time.perf_counter()
    stall = checkpointer.save(step, app, blocking=blocking)
    checkpointer.wait()
    total = time.perf_counter() - began
    event = events[-1]
    if event.get("event") != "checkpoint_committed" or event.get("step") != step:
        raise RuntimeError(f"checkpoint {step} did not commit: {event}")
    return stall, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, S3Server(Path(tmp) / "s3") as server:
        server.create_bucket("bench")
        store = CheckpointStore("s3://bench/ns/job", client=server.client())
        events: list[dict[str, Any]] = []
        app = one_rank_app(args.model)
        checkpointer = Checkpointer(store, Path(tmp) / "staging", {"tensor": 1, "pipeline": 1, "data": 1},
                                    keep=2, on_event=events.append)  # fmt: skip
        measure(checkpointer, app, 1, False, events)  # warm-up: imports, first connections
        results: dict[str, list[tuple[float, float]]] = {"async": [], "sync": []}
        upload: list[tuple[int, float]] = []
        for repeat in range(args.repeats):
            for mode in ("sync", "async"):
                step = 10 + repeat * 2 + (mode == "async")
                results[mode].append(measure(checkpointer, app, step, mode == "sync", events))
                upload.append((int(events[-1]["bytes"]), float(events[-1]["upload_seconds"])))
        sizes = list(store.step_objects(step).values())
        sizes = [s for s in sizes if s > 100]  # the shard files, not COMMITTED
        checkpoint_bytes = sum(sizes)
        raw = statistics.median(raw_put_seconds(store, sizes) for _ in range(args.repeats))
        report(args.model, checkpoint_bytes, results, upload, raw)
        dist.destroy_process_group()


def report(model: str, size: int, results: dict[str, list[tuple[float, float]]],
           upload: list[tuple[int, float]], raw_seconds: float) -> None:  # fmt: skip
    sync_stall = statistics.median(s for s, _ in results["sync"])
    async_stall = statistics.median(s for s, _ in results["async"])
    async_total = statistics.median(t for _, t in results["async"])
    upload_mbps = statistics.median(b / s for b, s in upload) / 1e6
    raw_mbps = size / raw_seconds / 1e6
    print(
        f"\ncheckpoint benchmark: model {model}, {size / 1e6:.1f} MB per checkpoint, one rank, versitygw on loopback\n"
    )
    print("| measure | value | baseline (same run) | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| training stall per checkpoint, async | {async_stall * 1e3:.1f} ms | sync save {sync_stall * 1e3:.1f} ms "
          f"| {async_stall / sync_stall:.1%} | <= 5% |")  # fmt: skip
    print(f"| async save until COMMITTED (background) | {async_total * 1e3:.1f} ms | | | |")
    print(f"| shard upload throughput | {upload_mbps:.1f} MB/s | raw PUT {raw_mbps:.1f} MB/s "
          f"| {upload_mbps / raw_mbps:.0%} | >= 70% |")  # fmt: skip


if __name__ == "__main__":
    main()
