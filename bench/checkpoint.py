"""Checkpoint benchmark: how long training stalls per checkpoint (async vs sync),
and how fast checkpoint shards reach S3 compared with plain PUTs to the same
server, measured in the same run.

    python bench/checkpoint.py [--model small] [--repeats 3] [--batch 4] [--seq-len 128]

It starts the testbed's S3 server (versitygw) on loopback, builds one rank of
the trainer (gloo, world size 1) with a model and an AdamW state, and trains it
with the trainer's own Checkpointer, exactly as the training loop does: `save`
after an optimizer step, `staged()` before the next one. The stall of a save is
what the trainer reports in its `checkpoint_saved` event: the time `save` blocks
plus the time the next step waits for the state copy. For a synchronous save
that is the whole save (copy, write, upload, commit).

The async copy runs while the next step computes, so on a CPU it competes with
that step for cores; the table also shows how much longer that step took than
a step without a checkpoint, so the overlap is not free of charge on paper.

Targets: async stall <= 5% of the synchronous save time; upload throughput
>= 70% of the server's raw throughput for the same object sizes (see
`raw_upload_seconds`).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
from topotrain_trainer.parallel import build_mesh, build_stage, cross_entropy  # noqa: E402
from topotrain_trainer.train import make_optimizer  # noqa: E402

from testbed.s3 import S3Server  # noqa: E402


class OneRank:
    """One rank of the trainer (world size 1) that trains on random tokens."""

    def __init__(self, model_name: str, batch: int, seq_len: int) -> None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29731")
        dist.init_process_group("gloo", rank=0, world_size=1)
        mesh = build_mesh(torch.device("cpu"), 1, 1, 1, "tp-pp-dp")
        config = TrainingConfig(model=model_name)
        self.model = build_stage(
            model_config(model_name), mesh, seed=0, bf16=False, activation_checkpointing=False
        )
        self.optimizer, self.scheduler = make_optimizer(self.model, config)
        self.progress = Progress()
        self.app = AppState(self.model, self.optimizer, self.scheduler, self.progress)
        self.vocab = model_config(model_name).vocab_size
        self.batch, self.seq_len = batch, seq_len

    def step(self, checkpointer: Checkpointer) -> float:
        """One optimizer step; returns its seconds, not counting a checkpoint wait."""
        began = time.perf_counter()
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1))
        loss = cross_entropy(self.model(tokens[:, :-1]), tokens[:, 1:])
        torch.autograd.backward(loss)
        waited = checkpointer.staged()  # as Job.train_step does
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        return time.perf_counter() - began - waited


@dataclass
class Samples:
    stall: dict[str, list[float]] = field(default_factory=lambda: {"async": [], "sync": []})
    committed: dict[str, list[float]] = field(default_factory=lambda: {"async": [], "sync": []})
    plain_steps: list[float] = field(default_factory=list)
    overlapped_steps: list[float] = field(default_factory=list)
    upload: list[tuple[int, float]] = field(default_factory=list)


def checkpoint_round(rank: OneRank, checkpointer: Checkpointer, events: list[dict[str, Any]],
                     mode: str, samples: Samples | None) -> int:  # fmt: skip
    """Two plain steps, a save, the step that overlaps it, then wait for COMMITTED."""
    plain = [rank.step(checkpointer) for _ in range(2)]
    step = rank.progress.step
    began = time.perf_counter()
    checkpointer.save(step, rank.app, blocking=mode == "sync")
    overlapped = rank.step(checkpointer)
    checkpointer.wait()
    by_event = {e["event"]: e for e in events if e.get("step") == step}
    if "checkpoint_committed" not in by_event:
        raise RuntimeError(f"checkpoint {step} did not commit: {by_event}")
    if samples is not None:
        samples.stall[mode].append(float(by_event["checkpoint_saved"]["stall_seconds"]))
        samples.committed[mode].append(float(by_event["checkpoint_committed"]["at"]) - began)
        samples.plain_steps.extend(plain)
        if mode == "async":
            samples.overlapped_steps.append(overlapped)
        done = by_event["checkpoint_committed"]
        samples.upload.append((int(done["bytes"]), float(done["upload_seconds"])))
    return step


def raw_upload_seconds(store: CheckpointStore, sizes: list[int], scratch: Path) -> float:
    """The server's own speed for the checkpoint's object sizes, without DCP or the
    training process: random bytes sent the fastest of three plain ways (one PUT per
    object from memory, boto3's parallel multipart from memory, and from a file)."""
    payloads = [os.urandom(size) for size in sizes]
    client, bucket = store.client, store.bucket
    files = []
    for index, payload in enumerate(payloads):
        files.append(scratch / f"raw-{index}")
        files[-1].write_bytes(payload)
    ways: list[Callable[[int], None]] = [
        lambda i: client.put_object(Bucket=bucket, Key=f"raw/put-{i}", Body=payloads[i]),
        lambda i: client.upload_fileobj(io.BytesIO(payloads[i]), bucket, f"raw/memory-{i}"),
        lambda i: client.upload_file(str(files[i]), bucket, f"raw/file-{i}"),
    ]
    seconds = []
    for way in ways:
        began = time.perf_counter()
        for index in range(len(payloads)):
            way(index)
        seconds.append(time.perf_counter() - began)
    for path in files:
        path.unlink()
    return min(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, S3Server(Path(tmp) / "s3") as server:
        server.create_bucket("bench")
        store = CheckpointStore("s3://bench/ns/job", client=server.client())
        events: list[dict[str, Any]] = []
        rank = OneRank(args.model, args.batch, args.seq_len)
        checkpointer = Checkpointer(store, Path(tmp) / "staging", {"tensor": 1, "pipeline": 1, "data": 1},
                                    keep=2, on_event=lambda e: events.append({**e, "at": time.perf_counter()}))  # fmt: skip
        for mode in ("async", "sync"):  # warm-up: imports, first connections, staging buffers
            checkpoint_round(rank, checkpointer, events, mode, None)
        samples = Samples()
        for _ in range(args.repeats):
            for mode in ("sync", "async"):
                step = checkpoint_round(rank, checkpointer, events, mode, samples)
        sizes = [s for s in store.step_objects(step).values() if s > 100]  # shards, not COMMITTED
        raw = statistics.median(raw_upload_seconds(store, sizes, Path(tmp)) for _ in range(args.repeats))
        checkpointer.close()
        met = report(args, sum(sizes), samples, raw)
        dist.destroy_process_group()
    return 0 if met else 1


def report(args: argparse.Namespace, size: int, samples: Samples, raw_seconds: float) -> bool:
    """Print the table; whether both targets were met."""
    sync_stall = statistics.median(samples.stall["sync"])
    async_stall = statistics.median(samples.stall["async"])
    async_commit = statistics.median(samples.committed["async"])
    plain = statistics.median(samples.plain_steps)
    overlapped = statistics.median(samples.overlapped_steps)
    lost = async_stall + max(0.0, overlapped - plain)
    upload_mbps = statistics.median(b / s for b, s in samples.upload) / 1e6
    raw_mbps = size / raw_seconds / 1e6
    print(f"\ncheckpoint benchmark: model {args.model}, {size / 1e6:.1f} MB per checkpoint, one rank, "
          f"batch {args.batch}x{args.seq_len}, versitygw on loopback, median of {args.repeats}\n")  # fmt: skip
    print("| measure | value | baseline (same run) | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| training stall per checkpoint, async | {async_stall * 1e3:.1f} ms | sync save {sync_stall * 1e3:.1f} ms "
          f"| {async_stall / sync_stall:.1%} | <= 5% |")  # fmt: skip
    print(f"| step overlapping the async copy | {overlapped * 1e3:.1f} ms | plain step {plain * 1e3:.1f} ms "
          f"| {overlapped / plain:.2f}x | |")  # fmt: skip
    print(f"| training time lost per async checkpoint (stall + slower overlapping step) | {lost * 1e3:.1f} ms "
          f"| sync save {sync_stall * 1e3:.1f} ms | {lost / sync_stall:.1%} | |")  # fmt: skip
    print(f"| async save until COMMITTED (background) | {async_commit * 1e3:.1f} ms | | | |")
    print(f"| shard upload throughput | {upload_mbps:.1f} MB/s | raw upload {raw_mbps:.1f} MB/s "
          f"| {upload_mbps / raw_mbps:.0%} | >= 70% |")  # fmt: skip
    met = async_stall <= 0.05 * sync_stall and upload_mbps >= 0.7 * raw_mbps
    print("\ntargets met" if met else "\nTARGETS NOT MET")
    return met


if __name__ == "__main__":
    sys.exit(main())
