"""The training loop, and the setup that builds what it needs from the contract."""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
from topotrain.checkpoints import CheckpointStore
from topotrain.contract import TrainerEnv
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.optim.lr_scheduler import LambdaLR

from topotrain_sdk.job import Job as SdkJob
from topotrain_sdk.session import Session
from topotrain_trainer.checkpoint import AppState, Checkpointer, Heartbeat, Progress
from topotrain_trainer.config import ConfigError, TrainingConfig
from topotrain_trainer.data import BatchLoader, TokenDataset, ensure_synthetic
from topotrain_trainer.metrics import Metrics
from topotrain_trainer.model import ModelConfig, Transformer
from topotrain_trainer.parallel import (
    Mesh,
    build_mesh,
    build_schedule,
    build_stage,
    clip_grad_norm,
    cross_entropy,
    init_distributed,
    loss_context,
)
from topotrain_trainer.sampler import length_at
from topotrain_trainer.shards import open_store
from topotrain_trainer.weights import export, job_model, load_initial


def process_start() -> datetime:
    """When this process began (Linux: from /proc, so torch's import time counts), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"), UTC)
    except (OSError, ValueError, IndexError, StopIteration):
        return datetime.now(UTC)


PROCESS_START = process_start()


def train(env: TrainerEnv, config: TrainingConfig) -> None:
    """Train to `steps`. A stop at a step boundary (SIGTERM: see `control`) raises SystemExit
    with the rank's exit code once the stop checkpoint is committed and the job closed."""
    job = Job.setup(env, config)
    stopped: int | None = None
    progress, tokens = job.progress, config.global_batch * config.seq_len
    first = True
    job.loader.start(progress.consumed_samples)
    while progress.step < config.steps:
        if job.holding(progress.step) or job.control.paused:
            stopped = job.hold(progress.step)
            if stopped is not None:
                break
        started = time.perf_counter()
        inputs, targets = job.loader.next(progress.consumed_samples)
        job.use_length(progress.step)
        loss, grad_norm = job.train_step(inputs, targets)
        progress.step += 1
        progress.consumed_samples += config.global_batch
        due = progress.step % config.progress_every == 0 or progress.step == config.steps
        # The wait for a checkpoint copy is reported as checkpoint stall, not step time.
        seconds = time.perf_counter() - started - job.checkpoint_wait
        job.metrics.step(progress.step, loss, grad_norm, seconds, tokens, due,
                         data_wait=job.loader.wait_seconds)  # fmt: skip
        if job.heartbeat is not None and first:
            # Time to first step is the recovery measure: report this attempt's first step at once.
            job.heartbeat.first_step(progress.step, PROCESS_START, job.load_seconds)
        elif job.heartbeat is not None and due:
            job.heartbeat.beat(progress.step)
        first = False
        stopped = job.at_boundary(progress.step)
        if stopped is not None:
            break
    if stopped is None and job.config.export_weights:
        job.export_weights()
    job.close()
    if stopped is not None:
        raise SystemExit(stopped)


def lr_lambda(config: TrainingConfig) -> LrSchedule:
    return LrSchedule(config.warmup_steps, config.steps, config.min_lr_ratio)


@dataclass(frozen=True)
class LrSchedule:
    """Linear warmup, then cosine decay to `floor` of the peak; a pure function of the step."""

    warmup: int
    total: int
    floor: float

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - self.warmup) / span)))
        return self.floor + (1 - self.floor) * cosine


def make_optimizer(
    model: torch.nn.Module, config: TrainingConfig
) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW: fused on CUDA (one kernel per parameter group), the per-parameter loop on CPU.

    Parameters live on different meshes (dp-only norms, dp x tp linears); a fused or foreach
    step takes tensors of one mesh, so on CUDA each mesh's parameters are a group of their own.
    """
    params = list(model.parameters())
    cuda = bool(params) and params[0].device.type == "cuda"
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for param in params:
        groups.setdefault(getattr(param, "device_mesh", None), []).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": group} for group in groups.values()] if cuda else params,
        lr=config.lr,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
        foreach=False,
        fused=cuda,
    )
    return optimizer, LambdaLR(optimizer, lr_lambda(config))


class Job:
    """One rank's model stage, optimizer, data and checkpointing."""

    def __init__(self, env: TrainerEnv, config: TrainingConfig, mesh: Mesh) -> None:
        self.env, self.config, self.mesh = env, config, mesh
        staging = (
            Path(config.staging_dir or tempfile.gettempdir()) / f"topotrain-{env.job_name or 'job'}"
        )
        staging.mkdir(parents=True, exist_ok=True)
        datasets = [TokenDataset(open_store(uri), config.seq_len) for uri in dataset_uris(config, staging)]
        if len({d.vocab_size for d in datasets}) > 1:
            raise ConfigError(f"training.dataset={config.dataset!r}: the datasets' vocab_size differ "
                              f"({[d.vocab_size for d in datasets]}): tokenize them with one tokenizer")  # fmt: skip
        self.model_config, self.model = self.build_model(datasets[0].vocab_size)
        self.microbatches = config.microbatches(mesh.data)
        self.schedule: PipelineScheduleSingle | None = None  # built by use_length, pipeline > 1
        self.length = 0  # the sequence length the schedule and the throughput figures are for
        self.lengths = config.length_stages()  # training.seqLenSchedule, parsed once
        self.optimizer, self.scheduler = make_optimizer(self.model, config)
        self.progress = Progress()
        self.load_seconds = 0.0  # restoring the checkpoint, reported with the first step
        self.app = AppState(self.model, self.optimizer, self.scheduler, self.progress)
        rank = dist.get_rank()
        self.metrics = Metrics(rank, int(os.environ.get("LOCAL_RANK", "0")), config.metrics_port)
        # Only the first stage (inputs) and the last (targets) read, and of a tensor-parallel group
        # only its first rank (share_batch); a rank reads its data rank's samples only.
        self.reads = mesh.is_first_stage or mesh.is_last_stage
        self.loader = BatchLoader(
            datasets, config.seed, config.global_batch, mesh.data, mesh.dp_rank,
            reads=self.reads and mesh.tp_rank == 0, pin=mesh.device.type == "cuda",
            stages=config.mix_stages(), lengths=self.lengths,
        )  # fmt: skip
        self.checkpointer: Checkpointer | None = None
        self.checkpoint_wait = 0.0  # seconds the last step waited for a checkpoint copy
        self.heartbeat: Heartbeat | None = None
        self.interval = env.checkpoint_interval
        if env.checkpoint_uri:
            store = CheckpointStore(env.checkpoint_uri)
            self.checkpointer = Checkpointer(
                store, staging, mesh.sizes(), env.checkpoint_keep, on_event=self.metrics.emit,
                attempt=env.attempt,
            )
            self.heartbeat = Heartbeat(store, env.attempt) if rank == 0 else None
        # The step boundaries (interval saves, checkpoint requests, SIGTERM, planned stops, holds)
        # are the SDK's Session, with this trainer's metrics, checkpointer and heartbeat; its saves
        # overlap the state copy with the next step (train_step waits in `staged()`).
        waits = {"holdAtStep": config.hold_at_step, "holdAttempts": config.hold_attempts,
                 "plannedStopSeconds": config.planned_stop_seconds}  # validated, either spelling
        described = SdkJob(env, rank, int(os.environ.get("LOCAL_RANK", "0")), True, waits)
        self.session = Session(described, emit=self.metrics.emit, checkpointer=self.checkpointer,
                               heartbeat=self.heartbeat, overlap=True, blocking=config.sync_checkpoint)
        self.control = self.session.control

    def build_model(self, dataset_vocab: int) -> tuple[ModelConfig, Transformer]:
        """This rank's stage. The vocabulary is the dataset's tokenizer's, or that of
        training.initWeights, whose weights are loaded unless a checkpoint will be."""
        config, mesh = self.config, self.mesh
        bf16 = config.precision == "bf16" or (config.precision == "auto" and mesh.device.type == "cuda")
        model_config, initial = job_model(config, dataset_vocab)
        model = build_stage(
            model_config, mesh, seed=config.seed, bf16=bf16,
            activation_checkpointing=config.activation_checkpointing, compile_blocks=config.compile,
        )  # fmt: skip
        if initial is not None and self.env.resume_step is None:
            load_initial(model, initial, model_config)
        return model_config, model

    @classmethod
    def setup(cls, env: TrainerEnv, config: TrainingConfig) -> Job:
        device = init_distributed(env.attempt)
        mesh = build_mesh(device, env.tensor, env.pipeline, env.data, env.rank_order)
        job = cls(env, config, mesh)
        if env.resume_step is not None:
            if job.checkpointer is None:
                raise FileNotFoundError(
                    "TOPOTRAIN_RESUME_STEP is set but TOPOTRAIN_CHECKPOINT_URI is empty"
                )
            began = time.perf_counter()
            read = job.checkpointer.restore(env.resume_step, job.app)
            job.control.served = job.checkpointer.restored_request  # not served twice
            job.load_seconds = time.perf_counter() - began
            job.metrics.emit({"event": "restored", "step": job.progress.step,
                              "consumed_samples": job.progress.consumed_samples, "mesh": mesh.sizes(),
                              "load_seconds": round(time.perf_counter() - began, 4),
                              "bytes_read": list(read.per_rank), "step_bytes": read.step_bytes})  # fmt: skip
        if job.checkpointer is not None:
            job.checkpointer.tidy()
        return job

    def at_boundary(self, step: int, *, held: bool = False) -> int | None:
        """After a step: the interval's save, the operator's checkpoint request, and SIGTERM
        (save this step, wait for COMMITTED, then stop: returns the exit code). `held`: a
        hold's poll at a boundary already passed (no interval save; a release ends the hold)."""
        return self.session.boundary(step, self.app, held=held)

    def holding(self, step: int) -> bool:
        """training.holdAtStep (a test aid): an attempt that holds, at or past the step, not
        released yet."""
        return self.session.holding(step)

    def hold(self, step: int) -> int | None:
        """Wait at this step boundary while the gang is held (a test aid) or paused after serving a
        planned stop's checkpoint request (control.py), serving checkpoint requests and SIGTERM
        meanwhile (returns the exit code of a stop). The operator sees no progress while a gang
        waits, so a hold longer than progressTimeoutSeconds is a hang."""
        return self.session.hold(step, self.app)

    def use_length(self, step: int) -> None:
        """Before optimizer step `step` (0-based): its sequence length (training.seqLenSchedule).
        A pipeline stage sends and receives activations of one shape, so a new length builds the
        schedule again; every rank does so at the same step (the length is the step's)."""
        length = length_at(self.lengths, step, self.config.seq_len)
        if length == self.length:
            return
        self.length = length
        if self.mesh.pipeline > 1:
            self.schedule = build_schedule(self.model, self.mesh, self.config.schedule, self.microbatches)
        self.metrics.throughput(self.model_config.flops_per_token(length), dist.get_world_size(),
                                self.mesh.device)  # fmt: skip

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
        """One optimizer step over this rank's share of the global batch: (loss, grad norm)."""
        inputs, targets = self.share_batch(inputs, targets)
        local = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        with loss_context(self.mesh):
            self.forward_backward(inputs, targets, local)
        grad_norm = clip_grad_norm(self.model, self.config.max_grad_norm, self.mesh)
        if self.checkpointer is not None:  # a save in flight must hold its copy before the update
            self.checkpoint_wait = self.checkpointer.staged()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.global_loss(local), grad_norm

    def share_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's batch on the device. A tensor-parallel group trains on one batch: its first
        rank read it (the others' loaders read nothing) and broadcasts it over the group, so the
        dataset is read once per data rank and stage, not once per tensor rank."""
        mesh = self.mesh
        inputs, targets = inputs.to(mesh.device, non_blocking=True), targets.to(mesh.device, non_blocking=True)
        if mesh.tensor == 1 or not self.reads:
            return inputs, targets
        if mesh.tp_rank == 0:
            both = torch.stack([inputs, targets])
        else:  # the shape is the step's: (local batch x windows a sample, length)
            rows = self.config.global_batch // mesh.data * (self.config.seq_len // self.length)
            both = torch.empty((2, rows, self.length), dtype=torch.int64, device=mesh.device)
        dist.broadcast(both, group=mesh.device_mesh["tp"].get_group(), group_src=0)
        return both[0], both[1]

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, local: torch.Tensor) -> None:
        """Gradients of this rank's microbatches; `local` accumulates the last stage's loss."""
        if self.mesh.pipeline > 1:
            if self.schedule is None:
                raise RuntimeError("Job.use_length(step) builds the pipeline schedule before a step")
            losses: list[torch.Tensor] = []
            if self.mesh.is_first_stage:
                self.schedule.step(inputs)
            elif self.mesh.is_last_stage:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
            if losses:
                local += torch.stack([plain(loss.detach()) for loss in losses]).mean().double()
        else:
            for index, (x, y) in enumerate(
                zip(inputs.chunk(self.microbatches), targets.chunk(self.microbatches), strict=True)
            ):
                self.model.set_requires_gradient_sync(index == self.microbatches - 1)  # type: ignore[operator]
                loss = cross_entropy(self.model(x), y) / self.microbatches
                torch.autograd.backward(loss)
                local += plain(loss.detach()).double()

    def global_loss(self, local: torch.Tensor) -> float:
        """Mean over the data ranks of the last stage's loss (gloo has no AVG: sum, then divide)."""
        counted = self.mesh.is_last_stage and self.mesh.tp_rank == 0
        total = local if counted else torch.zeros_like(local)
        dist.all_reduce(total)
        return float(total.item()) / self.mesh.data

    def export_weights(self) -> None:
        """The trained weights as Hugging Face safetensors at training.exportWeights."""
        began = time.perf_counter()
        mesh = self.mesh
        export(self.model, self.model_config, self.config.export_weights, stage=mesh.pp_rank,
               stages=mesh.pipeline, writer=mesh.dp_rank == 0 and mesh.tp_rank == 0)  # fmt: skip
        self.metrics.emit({"event": "weights_exported", "uri": self.config.export_weights,
                           "step": self.progress.step, "seconds": round(time.perf_counter() - began, 3)})  # fmt: skip

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.heartbeat is not None:
            self.heartbeat.beat(self.progress.step)
            self.heartbeat.flush()
        self.loader.stop()
        self.metrics.emit(
            {
                "event": "done",
                "step": self.progress.step,
                "consumed_samples": self.progress.consumed_samples,
            }
        )
        dist.barrier()
        dist.destroy_process_group()


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss_parallel it is a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def dataset_uris(config: TrainingConfig, staging: Path) -> list[str]:
    if config.dataset == "synthetic":
        return [str(ensure_synthetic(staging, config.seed))]
    return config.datasets()
