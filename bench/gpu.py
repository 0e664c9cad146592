"""One GPU's figures for the bundled trainer (bench/gpu.sh runs this; a benchmark, not a test).

    python bench/gpu.py [--model 1B] [--seq-len 4096] [--batch 8] [--micro 2] [--steps 10]
    python bench/gpu.py --tiny          # CPU, tiny model, seconds: checks the script itself

One rank (world size 1) of the trainer's own pieces: the stage built by `parallel.build_stage`
(FSDP2 over a one-rank mesh, bf16 parameters with fp32 reductions on CUDA), `make_optimizer`
(fused AdamW on CUDA), the trainer's loss, and its BatchLoader over token shards written to a
local directory (random ids, so no tokenizer is needed), page-locked and copied non-blocking.

Phases, each printed as a table row and written as JSON lines to $OUT/gpu.jsonl when OUT is set:
1. eager: tokens/s per GPU, model TFLOP/s, MFU (of the dense bf16 peak), peak memory,
   data-wait share of step time;
2. the same with each block compiled (`--no-compile` skips it);
3. checkpoint stall: DCP's async_save (the device-to-host copy into CPU memory, then writing
   in the background) against a synchronous DCP save of the same state, to local disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from topotrain_trainer.config import TrainingConfig  # noqa: E402
from topotrain_trainer.data import BatchLoader, TokenDataset, write_dataset  # noqa: E402
from topotrain_trainer.metrics import peak_flops, throughput  # noqa: E402
from topotrain_trainer.model import model_config  # noqa: E402
from topotrain_trainer.parallel import build_mesh, build_stage, cross_entropy  # noqa: E402
from topotrain_trainer.train import make_optimizer  # noqa: E402


def dataset(root: Path, vocab: int, tokens: int) -> TokenDataset:
    ids = np.random.default_rng(0).integers(0, vocab, size=tokens, dtype=np.uint32)
    write_dataset(root, [ids], 1 << 24, vocab)
    return TokenDataset(root, ARGS.seq_len)


def run(compiled: bool, device: torch.device, data: TokenDataset) -> dict[str, Any]:
    """Train ARGS.steps measured steps (after 3 warm-up steps): the phase's figures."""
    mesh = build_mesh(device, 1, 1, 1, "tp-pp-dp")
    cuda = device.type == "cuda"
    config = model_config(ARGS.model, data.vocab_size)
    model = build_stage(config, mesh, seed=0, bf16=cuda, activation_checkpointing=ARGS.ac,
                        compile_blocks=compiled)  # fmt: skip
    optimizer, _ = make_optimizer(model, TrainingConfig(model=ARGS.model))
    loader = BatchLoader(data, seed=1, global_batch=ARGS.batch, data=1, dp_rank=0, pin=cuda)
    loader.start(0)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    steps, waits = [], []
    for step in range(ARGS.steps + 3):
        began = time.perf_counter()
        inputs, targets = loader.next(step * ARGS.batch)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        micro = ARGS.batch // ARGS.micro
        for index, (x, y) in enumerate(zip(inputs.chunk(micro), targets.chunk(micro), strict=True)):
            model.set_requires_gradient_sync(index == micro - 1)  # type: ignore[operator]
            (cross_entropy(model(x), y) / micro).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= 3:
            steps.append(time.perf_counter() - began)
            waits.append(loader.wait_seconds)
    loader.stop()
    step_s = statistics.median(steps)
    tokens = ARGS.batch * ARGS.seq_len
    peak = peak_flops(torch.cuda.get_device_name(device)) if cuda else None
    tflops, mfu = throughput(config.flops_per_token(ARGS.seq_len), tokens, step_s, 1, peak)
    result: dict[str, Any] = {
        "phase": "compiled" if compiled else "eager", "model": ARGS.model, "seq_len": ARGS.seq_len,
        "batch": ARGS.batch, "micro_batch": ARGS.micro, "step_seconds": round(step_s, 4),
        "tokens_per_second_per_gpu": round(tokens / step_s, 1), "tflops": round(tflops, 2),
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
        "data_wait_share": round(sum(waits) / sum(steps), 5),
    }  # fmt: skip
    if not compiled:
        result["checkpoint"] = checkpoint_stall(model, optimizer)
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return result


def checkpoint_stall(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Seconds training would pause: async_save until it returns (the device-to-host copy) against
    the whole synchronous save, both to local disk."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with tempfile.TemporaryDirectory(dir=ARGS.scratch) as root:
        dcp.save(state, checkpoint_id=f"{root}/warm")  # first save plans and allocates
        began = time.perf_counter()
        dcp.save(state, checkpoint_id=f"{root}/sync")
        sync = time.perf_counter() - began
        began = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=f"{root}/async")
        stall = time.perf_counter() - began
        future.result()
        done = time.perf_counter() - began
    return {"sync_save_seconds": round(sync, 3), "async_stall_seconds": round(stall, 3),
            "async_total_seconds": round(done, 3), "stall_share_of_sync": round(stall / sync, 4)}  # fmt: skip


def main() -> None:
    cuda = torch.cuda.is_available() and not ARGS.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
    out = Path(os.environ["OUT"]) / "gpu.jsonl" if os.environ.get("OUT") else None
    with tempfile.TemporaryDirectory(dir=ARGS.scratch) as root:
        vocab = model_config(ARGS.model).vocab_size
        data = dataset(Path(root) / "tokens", vocab, (ARGS.steps + 8) * ARGS.batch * (ARGS.seq_len + 1))
        device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
        print(f"# {device_name}, torch {torch.__version__}, model {ARGS.model}, seq {ARGS.seq_len}, "
              f"batch {ARGS.batch} (micro {ARGS.micro}), {ARGS.steps} measured steps", flush=True)  # fmt: skip
        for compiled in (False, True) if ARGS.compile else (False,):
            result = {"device": device_name, **run(compiled, device, data)}
            print(json.dumps(result), flush=True)
            if out is not None:
                with out.open("a") as sink:
                    sink.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1B")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8, help="samples per step")
    parser.add_argument("--micro", type=int, default=2, help="samples per forward/backward")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ac", action="store_true", help="activation checkpointing")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--scratch", default=None, help="local disk for the data and checkpoints")
    parser.add_argument("--tiny", action="store_true", help="CPU, model tiny, seq 64, 3 steps, no compile")
    args = parser.parse_args()
    if args.tiny:
        args.model, args.seq_len, args.batch, args.micro, args.steps, args.compile = "tiny", 64, 4, 2, 3, False
    return args


if __name__ == "__main__":
    ARGS = parse()
    main()
