"""Restore benchmark: per-rank ranged reads from S3 against downloading the whole step,
bytes read and time per rank, at several model sizes and data degrees, in one run.

    python bench/restore.py [--models tiny,small] [--data 2,4] [--repeats 3]

For each model and data degree it starts that many trainer ranks (gloo on CPU,
FSDP over dp, world size = dp, one process each, as one pod per rank would
be), trains one step so the AdamW state exists, saves a checkpoint with the
trainer's own Checkpointer into the testbed's S3 server (versitygw on
loopback) and then restores it `repeats` times each way, alternating the order:

- ranged: `Checkpointer.restore` (every rank fetches the byte ranges its shards
  need, with parallel ranged GETs, `S3RangeReader`);
- download: `Checkpointer.restore(whole_step=True)`, the earlier way: each
  machine downloads the whole attempt directory, then DCP loads from disk. Here
  every rank is its own machine (one rank per pod); with R ranks per machine the
  download is shared by R ranks, so per machine the ratio of bytes is R times the
  per-rank ratio below.

Bytes are what each rank received from S3 (mean over ranks); time is the restore
wall time of the slowest rank (the gang starts when the last rank has loaded),
median over repeats. Every restore must reproduce the saved parameters exactly.
Target: a rank reads less than the step (bytes ratio < 1); the ideal, a rank's
share alone, is 1/dp (the small chunks every rank needs, and those merged into
its GETs, come on top: a visible share for the tiny model, little for small).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from topotrain.checkpoints import CheckpointStore  # noqa: E402
from topotrain_trainer.checkpoint import AppState, Checkpointer, Progress  # noqa: E402
from topotrain_trainer.config import TrainingConfig  # noqa: E402
from topotrain_trainer.model import model_config  # noqa: E402
from topotrain_trainer.parallel import build_mesh, build_stage, cross_entropy  # noqa: E402
from topotrain_trainer.train import make_optimizer  # noqa: E402

from testbed.s3 import S3Server  # noqa: E402

MODES = ("ranged", "download")


@dataclass(frozen=True)
class Case:
    model: str
    data: int
    repeats: int
    uri: str
    s3_env: dict[str, str]
    port: int
    scratch: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
            for p in model.parameters()]  # fmt: skip


def rank_main(rank: int, case: Case, results: Any) -> None:
    """One rank: train a step, save, then restore `repeats` times each way."""
    os.environ.update(case.s3_env)
    os.environ.update({"LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"})  # one rank per machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{case.port}",
                            rank=rank, world_size=case.data)  # fmt: skip
    torch.set_num_threads(1)
    mesh = build_mesh(torch.device("cpu"), 1, 1, case.data, "tp-pp-dp")
    config = model_config(case.model)
    model = build_stage(config, mesh, seed=0, bf16=False, activation_checkpointing=False)
    optimizer, scheduler = make_optimizer(model, TrainingConfig(model=case.model))
    progress = Progress()
    app = AppState(model, optimizer, scheduler, progress)
    tokens = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank))
    torch.autograd.backward(cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]))
    optimizer.step()
    progress.step = 1
    store = CheckpointStore(case.uri)
    sizes = {"tensor": 1, "pipeline": 1, "data": case.data}
    checkpointer = Checkpointer(store, Path(case.scratch) / f"rank-{rank}", sizes, keep=2)
    checkpointer.save(1, app, blocking=True)
    saved = _params(model)
    rows: list[tuple[str, int, float, int]] = []
    for repeat in range(case.repeats + 1):  # the first round warms connections and caches up
        order = MODES if repeat % 2 == 0 else MODES[::-1]
        for mode in order:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            dist.barrier()
            stats = checkpointer.restore(1, app, whole_step=mode == "download")
            if any(not torch.equal(a, b) for a, b in zip(_params(model), saved, strict=True)):
                raise AssertionError(f"{mode} restore of rank {rank} differs from the save")
            if repeat:
                rows.append((mode, stats.bytes_read, stats.seconds, stats.step_bytes))
    gathered: list[Any] = [None] * case.data
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        results.put(gathered)
    checkpointer.close()
    dist.destroy_process_group()


@dataclass(frozen=True)
class Row:
    model: str
    data: int
    step_bytes: int
    bytes_per_rank: dict[str, float]  # mean over ranks
    seconds: dict[str, float]  # slowest rank, median over repeats


def run_case(model: str, data: int, repeats: int, server: S3Server, scratch: Path) -> Row:
    bucket = server.create_bucket(f"restore-{model.lower()}-{data}")
    case = Case(model, data, repeats, f"s3://{bucket}/ns/job", server.env(), _free_port(),
                str(scratch / f"{model}-{data}"))  # fmt: skip
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(rank_main, args=(case, results), nprocs=data, join=True, start_method="spawn")
    per_rank: list[list[tuple[str, int, float, int]]] = results.get()
    step_bytes = per_rank[0][0][3]
    bytes_per_rank, seconds = {}, {}
    for mode in MODES:
        bytes_per_rank[mode] = statistics.mean(b for rows in per_rank for m, b, _, _ in rows if m == mode)
        rounds = [[s for m, _, s, _ in rows if m == mode] for rows in per_rank]
        seconds[mode] = statistics.median(max(by_rank) for by_rank in zip(*rounds, strict=True))
    return Row(model, data, step_bytes, bytes_per_rank, seconds)


def report(rows: list[Row], repeats: int) -> bool:
    print(f"\nrestore benchmark: one rank per machine, gloo on CPU, FSDP over dp, versitygw on "
          f"loopback; bytes: mean per rank; time: slowest rank, median of {repeats}\n")  # fmt: skip
    print("| model | dp | step MB | ranged MB/rank | download MB/rank | bytes ratio | ranged s | download s "
          "| time ratio | ideal 1/dp | target (bytes ratio < 1) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    met = True
    for row in rows:
        ranged, whole = row.bytes_per_rank["ranged"], row.bytes_per_rank["download"]
        ok = ranged < whole
        met = met and ok
        print(f"| {row.model} | {row.data} | {row.step_bytes / 1e6:.2f} | {ranged / 1e6:.2f} | "
              f"{whole / 1e6:.2f} | {ranged / whole:.2f} | {row.seconds['ranged']:.3f} | "
              f"{row.seconds['download']:.3f} | {row.seconds['ranged'] / row.seconds['download']:.2f} | "
              f"{1 / row.data:.2f} | "
              f"{'met' if ok else 'MISSED'} |")  # fmt: skip
    print("\ntargets met" if met else "\nTARGETS NOT MET")
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--data", default="2,4", help="data degrees (world sizes)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, S3Server(Path(tmp) / "s3") as server:
        for model in args.models.split(","):
            for data in (int(d) for d in args.data.split(",")):
                rows.append(run_case(model, data, args.repeats, server, Path(tmp)))
    return 0 if report(rows, args.repeats) else 1


if __name__ == "__main__":
    sys.exit(main())
