"""3D parallelism with torch's own building blocks.

The `DeviceMesh` follows the contract's rank order (innermost first): for
`tp-pp-dp` the global rank is `(dp*PP + pp)*TP + tp`, i.e. a row-major mesh of
shape (dp, pp, tp). A rank's pipeline stage is the full model with the layers
it does not own deleted (`Transformer.keep_stage`), then tensor-parallelised
with DTensor, wrapped with activation checkpointing, and sharded over dp with
FSDP2, in that order (as torchtitan does).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from topotrain.contract import ATTEMPT, RENDEZVOUS_ATTEMPT_KEY, rendezvous_prefix
from torch import nn
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from topotrain_trainer.model import ModelConfig, Transformer

# Models up to this size are built whole on the CPU from the seed, so every mesh
# starts from bit-identical weights; larger ones are built per stage on "meta".
FULL_INIT_MAX_PARAMS = 2_000_000_000


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the (tp, pp, dp) mesh, and the groups to talk over."""

    device_mesh: DeviceMesh
    device: torch.device
    tensor: int
    pipeline: int
    data: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline - 1

    def sizes(self) -> dict[str, int]:
        return {"tensor": self.tensor, "pipeline": self.pipeline, "data": self.data}


RENDEZVOUS_TIMEOUT = timedelta(minutes=30)  # as torch's env:// rendezvous waits for its peers


class StaleAttempt(RuntimeError):
    """This rank's attempt is older than the one the rendezvous serves: it must not join."""


def attempt_store(attempt: int, *, rank: int, world_size: int, addr: str, port: int,
                  timeout: timedelta = RENDEZVOUS_TIMEOUT) -> Store:
    """torch's TCPStore on rank 0 at addr:port (as env:// makes it), scoped to `attempt`
    (contract.RENDEZVOUS_ATTEMPT_KEY): rank 0 writes its attempt; another rank reads it and
    raises StaleAttempt when the store serves a newer attempt (this rank lags behind a restart),
    or, while it serves an older one (its rank 0 is still stopping), connects again until
    `timeout`. The process group's keys live under the attempt's prefix."""
    if rank == 0:
        served = TCPStore(addr, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        served.set(RENDEZVOUS_ATTEMPT_KEY, str(attempt))
        return PrefixStore(rendezvous_prefix(attempt), served)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
        found: int | None = None
        try:
            store = TCPStore(addr, port, world_size, is_master=False, timeout=left, wait_for_workers=False)
            found = int(store.get(RENDEZVOUS_ATTEMPT_KEY))
        except (dist.DistNetworkError, dist.DistStoreError):  # the old rank 0 stopped meanwhile
            if time.monotonic() > deadline:
                raise
        if found == attempt:
            return PrefixStore(rendezvous_prefix(attempt), store)
        if found is not None and found > attempt:
            raise StaleAttempt(
                f"rank {rank} of attempt {attempt} ({ATTEMPT}): the rendezvous at {addr}:{port} "
                f"serves attempt {found}; this rank belongs to an older attempt and does not join")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} of attempt {attempt}: the rendezvous at {addr}:{port} "
                               f"still serves the older attempt {found}")
        time.sleep(1.0)


# How long a collective may wait for its peers before it fails (a dead or hung peer): the
# trainer then exits 76 (EXIT_PEER_LOST, __main__.peer_lost) instead of waiting for NCCL's
# watchdog default of 10 minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def init_distributed(attempt: int | None = None, timeout: timedelta = COLLECTIVE_TIMEOUT) -> torch.device:
    """Join the job's process group: cuda+nccl when GPUs exist, cpu+gloo otherwise. With
    `attempt` (TOPOTRAIN_ATTEMPT), through `attempt_store` from MASTER_ADDR, MASTER_PORT, RANK
    and WORLD_SIZE; without it, or under torchrun (whose agent serves the store on MASTER_PORT,
    scoped to its own run), torch's env:// rendezvous."""
    extra: dict[str, Any] = {"timeout": timeout}
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"  # gloo too: async checkpoint collectives run on CPU
        # On a failed or timed-out collective NCCL's watchdog aborts the communicators only
        # (2, CleanUpOnly), so the rank's next wait raises (DistBackendError, which peer_lost
        # reads: exit 76) instead of the watchdog aborting the process (torch's default, 134).
        # Not blocking wait: that would stall the CPU on every collective.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        extra["device_id"] = device  # binds the communicator to this GPU: eager NCCL init
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if dist.is_initialized():
        return device
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        dist.init_process_group(backend=backend, **extra)
        return device
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = attempt_store(attempt, rank=rank, world_size=world_size,
                          addr=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]))
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, **extra)
    return device


def build_mesh(device: torch.device, tensor: int, pipeline: int, data: int, order: str) -> Mesh:
    """A mesh whose rank layout is exactly the contract's `rank_coords`."""
    if order == "tp-pp-dp":
        shape, names = (data, pipeline, tensor), ("dp", "pp", "tp")
    elif order == "tp-dp-pp":
        shape, names = (pipeline, data, tensor), ("pp", "dp", "tp")
    else:
        raise ValueError(f"unknown rank order {order!r}")
    device_mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    return Mesh(
        device_mesh=device_mesh,
        device=device,
        tensor=tensor,
        pipeline=pipeline,
        data=data,
        tp_rank=device_mesh["tp"].get_local_rank(),
        pp_rank=device_mesh["pp"].get_local_rank(),
        dp_rank=device_mesh["dp"].get_local_rank(),
    )


def build_stage(
    config: ModelConfig,
    mesh: Mesh,
    *,
    seed: int,
    bf16: bool,
    activation_checkpointing: bool,
    meta_init: bool | None = None,
    compile_blocks: bool = False,
) -> Transformer:
    """This rank's pipeline stage, parallelised and initialised from `seed`. `meta_init`: build
    on the meta device and initialise each stage's shards in place (default: above
    FULL_INIT_MAX_PARAMS parameters)."""
    on_meta = config.num_params() > FULL_INIT_MAX_PARAMS if meta_init is None else meta_init
    if on_meta:
        with torch.device("meta"):
            model = Transformer(config)
    else:
        torch.manual_seed(seed)
        model = Transformer(config)
        model.init_weights()
    model.keep_stage(mesh.pp_rank, mesh.pipeline)
    if not on_meta:
        model.to(mesh.device)
    parallelize(model, mesh, bf16=bf16, activation_checkpointing=activation_checkpointing,
                compile_blocks=compile_blocks)  # fmt: skip
    if on_meta:
        model.to_empty(device=mesh.device)
        seed_stage(mesh, seed)
        model.init_weights()
    return model


def seed_stage(mesh: Mesh, seed: int) -> None:
    """Seed this stage's initialisation: `seed + pp_rank`, the same on every rank of the stage.

    On CUDA, DTensor's random ops draw from a tracker that, created lazily by the first of them,
    broadcasts global rank 0's RNG state to every rank: every stage would draw stage 0's numbers,
    and stages of equal layer counts would start from identical weights. Creating the tracker
    here, seeded over the stage's own (data x tensor) ranks, keeps the stages apart. (On CPU
    DTensor has no such tracker: each rank draws from its own generator.)
    """
    from torch.distributed.tensor import _random as dtensor_random

    stage_seed = seed + mesh.pp_rank
    torch.manual_seed(stage_seed)
    if mesh.device.type == "cuda":
        dtensor_random.manual_seed(stage_seed, mesh.device_mesh["dp", "tp"])


def parallelize(
    model: Transformer, mesh: Mesh, *, bf16: bool, activation_checkpointing: bool,
    compile_blocks: bool = False,
) -> None:
    # 1. Tensor parallel: Megatron-style column/row pairs, so each block needs one
    #    all-reduce in attention and one in the MLP.
    if mesh.tensor > 1:
        parallelize_module(model, mesh.device_mesh["tp"], tensor_parallel_plan(model))
    # 2. Activation checkpointing per block (inside the FSDP unit, as torchtitan does).
    for block in model.layers.values():
        block.activation_checkpointing = activation_checkpointing  # type: ignore[assignment]
        if compile_blocks:  # each block compiled on its own (one graph reused by every layer)
            block.compile()
    # 3. FSDP2 over dp: each block is one all-gather/reduce-scatter unit. With a
    #    pipeline, keep parameters gathered across the microbatches of a step.
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else torch.float32, reduce_dtype=torch.float32
    )
    dp_mesh = mesh.device_mesh["dp"]
    reshard = mesh.pipeline == 1
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)


def tensor_parallel_plan(model: Transformer) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        )
    if model.output is not None:
        # Logits stay sharded by vocabulary (a DTensor): the loss is computed under loss_parallel
        # (`loss_context`), so no rank holds, or casts to fp32, the whole vocabulary's logits.
        plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    for name in model.layers:
        for column in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "feed_forward.w1",
            "feed_forward.w3",
        ):
            plan[f"layers.{name}.{column}"] = ColwiseParallel()
        for row in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{name}.{row}"] = RowwiseParallel()
    return plan


# Tokens per chunk of the loss of low-precision logits (`cross_entropy`).
LOSS_CHUNK = 4096


def loss_context(mesh: Mesh) -> contextlib.AbstractContextManager[None]:
    """What the forward and backward of the loss run under: loss_parallel with tensor
    parallelism (vocabulary-sharded logits), nothing otherwise."""
    return loss_parallel() if mesh.tensor > 1 else contextlib.nullcontext()


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), targets, reduction="sum")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss of one microbatch (averaged again over microbatches and dp), in fp32.

    Vocabulary-sharded logits (a DTensor, tensor parallelism) are reduced across the shards by
    loss_parallel. Low-precision logits of more than LOSS_CHUNK tokens are cast to fp32 a chunk at
    a time, each chunk recomputed in backward, so no fp32 copy of the whole logits is kept.
    """
    flat, flat_targets = logits.flatten(0, 1), targets.flatten(0, 1)
    if isinstance(flat, DTensor) or flat.dtype == torch.float32 or flat.shape[0] <= LOSS_CHUNK:
        return nn.functional.cross_entropy(flat.float(), flat_targets)
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    chunks = torch.split(flat, LOSS_CHUNK), torch.split(flat_targets, LOSS_CHUNK)
    for chunk, chunk_targets in zip(*chunks, strict=True):
        part: torch.Tensor = checkpoint(_chunk_loss, chunk, chunk_targets, use_reentrant=False)
        total = total + part
    return total / flat.shape[0]


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, mesh: Mesh) -> float:
    """Global gradient norm over every stage and shard; scales grads down to `max_norm`
    (0 = never). Each parameter's copies span the world/pp ranks of its stage; a
    replicated shard is counted once by dividing by its number of copies."""
    copies_per_stage = dist.get_world_size() // mesh.pipeline
    local_sq = torch.zeros((), dtype=torch.float64, device=mesh.device)
    grads: list[torch.Tensor] = []
    for param in model.parameters():
        if param.grad is None:
            continue
        grad = param.grad
        grads.append(grad)
        if isinstance(grad, DTensor):
            shards = math.prod(
                grad.device_mesh.size(dim)
                for dim, p in enumerate(grad.placements)
                if not p.is_replicate()  # Shard, or FSDP's _StridedShard under TP
            )
            grad = grad.to_local()
        else:
            shards = 1
        local_sq += grad.double().pow(2).sum() * shards / copies_per_stage
    dist.all_reduce(local_sq)
    norm = float(local_sq.sqrt().item())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad in grads:
            grad.mul_(scale)
    return norm


def build_schedule(
    model: Transformer, mesh: Mesh, schedule: str, microbatches: int
) -> PipelineScheduleSingle:
    stage = PipelineStage(
        model, mesh.pp_rank, mesh.pipeline, mesh.device, group=mesh.device_mesh["pp"].get_group()
    )
    kind: Any = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    built: PipelineScheduleSingle = kind(stage, n_microbatches=microbatches, loss_fn=cross_entropy)
    return built
