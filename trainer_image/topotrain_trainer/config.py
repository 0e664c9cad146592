"""The trainer's configuration: `spec.training` of a TrainingJob, as JSON in
TOPOTRAIN_TRAINING_CONFIG, validated against the mesh the operator chose.

An invalid configuration is not worth retrying: the trainer exits with
EXIT_BAD_CONFIG (78, sysexits' EX_CONFIG) so the operator can tell it apart.
Which data degrees the batch settings allow is `topotrain.degrees.BatchRule`,
the rule the operator plans and elastically resizes by, with the same defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from topotrain.contract import DEFAULT_METRICS_PORT
from topotrain.degrees import DEFAULT_GLOBAL_BATCH, DEFAULT_MICRO_BATCH, DEFAULT_SCHEDULE, BatchRule

# The contract's exit codes: 78 EX_CONFIG; 76, a collective lost a peer in another pod (this
# pod is healthy). Re-exported: the trainer imports them from here.
from topotrain_sdk.contract import EXIT_BAD_CONFIG as EXIT_BAD_CONFIG
from topotrain_sdk.contract import EXIT_PEER_LOST as EXIT_PEER_LOST
from topotrain_trainer.sampler import LengthStage, MixStage, parse_lengths, parse_mixture
from topotrain_trainer.shapes import MODEL_CONFIGS

SCHEDULES = ("1f1b", "gpipe")
PRECISIONS = ("auto", "bf16", "fp32")


class ConfigError(ValueError):
    """spec.training (or its combination with the mesh) cannot be trained."""


@dataclass(frozen=True)
class TrainingConfig:
    model: str = "tiny"  # a name in model.MODEL_CONFIGS
    seq_len: int = 64
    global_batch: int = DEFAULT_GLOBAL_BATCH  # samples per optimizer step, whatever the data degree
    micro_batch: int = DEFAULT_MICRO_BATCH  # samples per forward/backward on one rank
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of lr
    warmup_steps: int = 10
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0  # clip the global gradient norm; 0 disables
    steps: int = 100
    seed: int = 1234
    dataset: str = "synthetic"  # a directory or s3://bucket/prefix made by `prepare`, or "synthetic"
    # several datasets, comma-separated in `dataset`, drawn with these weights by step:
    # "STEP:W1,W2;STEP:W1,W2" (sampler.parse_mixture; default: equal weights throughout)
    mixture: str = ""
    # a sequence-length schedule, "STEP:LENGTH;STEP:LENGTH" from step 0, each length dividing
    # seq_len: from each step on a sample of seq_len tokens trains as seq_len / LENGTH windows of
    # LENGTH (the same tokens a step; default: seq_len throughout)
    seq_len_schedule: str = ""
    # Hugging Face Llama weights (safetensors + config.json; a directory or s3://bucket/prefix) to
    # start from, and where to write the trained weights in that format at the end (hf.py)
    init_weights: str = ""
    export_weights: str = ""
    schedule: str = DEFAULT_SCHEDULE  # pipeline schedule: 1f1b | gpipe
    precision: str = "auto"  # auto: bf16 on cuda, fp32 on cpu
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each transformer block (CUDA; needs triton)
    progress_every: int = 10  # steps between progress.json heartbeats and log lines
    metrics_port: int = DEFAULT_METRICS_PORT  # Prometheus port of local rank 0; 0 disables
    staging_dir: str = ""  # local disk for checkpoint staging; default: the temp dir
    sync_checkpoint: bool = False  # block training for the whole save (the baseline)
    # the pod's supervisor keeps a spare interpreter per local rank with torch imported for the
    # next in-place restart (supervisor.py): faster restarts for one more process's memory
    warm_spares: bool = False
    # A test aid, not for production: in attempts below hold_attempts, at the first step boundary
    # at or past hold_at_step (0: never), every rank waits, serving checkpoint requests and
    # SIGTERM, until the pod annotation topotrain.io/hold-release is set or the gang is stopped.
    # Tests use it to act on a job that is certainly still training, instead of sizing its length
    # to win a race; the attempts after the test's fault or resize train to the end (docs/trainer.md).
    hold_at_step: int = 0
    hold_attempts: int = 1
    # After serving a planned stop's checkpoint request the gang trains no further step for up to
    # this many seconds, waiting for the operator's SIGTERM (control.py); 0: it trains on.
    planned_stop_seconds: float = 120.0

    @classmethod
    def from_json(cls, text: str) -> TrainingConfig:
        try:
            raw = json.loads(text or "{}")
        except json.JSONDecodeError as err:
            raise ConfigError(f"training config is not JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError("training config must be a JSON object")
        return cls.from_mapping(raw)

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> TrainingConfig:
        known = {f.name: f for f in fields(cls)}
        # Accept camelCase too (seqLen), as a Kubernetes manifest would spell it.
        normalized = {_snake(k): v for k, v in raw.items()}
        unknown = sorted(set(normalized) - set(known))
        if unknown:
            raise ConfigError(f"unknown training config keys {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in normalized.items():
            default = getattr(cls, name)
            kind = type(default)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"training.{name}={value!r}: must be {kind.__name__}")
            values[name] = value
        config = cls(**values)
        config.check_values()
        return config

    def check_values(self) -> None:
        if self.model not in MODEL_CONFIGS:
            raise ConfigError(f"training.model={self.model!r}: one of {sorted(MODEL_CONFIGS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"training.schedule={self.schedule!r}: one of {SCHEDULES}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"training.precision={self.precision!r}: one of {PRECISIONS}")
        for name in ("seq_len", "global_batch", "micro_batch", "steps", "progress_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training.{name}={getattr(self, name)}: must be >= 1")
        for name, camel in (("hold_at_step", "holdAtStep"), ("hold_attempts", "holdAttempts")):
            if getattr(self, name) < 0:
                raise ConfigError(f"training.{camel}={getattr(self, name)}: must be >= 0")
        if self.planned_stop_seconds < 0:
            raise ConfigError(f"training.plannedStopSeconds={self.planned_stop_seconds}: must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"training.lr={self.lr}: must be > 0")
        self.mix_stages()
        self.length_stages()

    def datasets(self) -> list[str]:
        return [d.strip() for d in self.dataset.split(",") if d.strip()]

    def mix_stages(self) -> tuple[MixStage, ...]:
        """training.mixture's stages over the datasets of training.dataset; () for one dataset."""
        if len(self.datasets()) == 1 and not self.mixture:
            return ()
        text = self.mixture or "0:" + ",".join(["1"] * len(self.datasets()))
        try:
            return parse_mixture(text, len(self.datasets()))
        except ValueError as err:
            raise ConfigError(f"training.mixture={self.mixture!r}: {err}") from None

    def length_stages(self) -> tuple[LengthStage, ...]:
        """training.seqLenSchedule's stages; () when it is not set."""
        if not self.seq_len_schedule:
            return ()
        try:
            return parse_lengths(self.seq_len_schedule, self.seq_len)
        except ValueError as err:
            raise ConfigError(f"training.seqLenSchedule={self.seq_len_schedule!r}: {err}") from None

    def check_mesh(self, tensor: int, pipeline: int, data: int) -> None:
        """Reject what cannot run on this (tp, pp, dp) mesh, naming the rule."""
        model = MODEL_CONFIGS[self.model]
        batch_problem = self.batch_rule(pipeline).problem(data)
        if batch_problem is not None:
            raise ConfigError(batch_problem)
        if model.n_heads % tensor or model.n_kv_heads % tensor or model.ffn_dim % tensor:
            raise ConfigError(
                f"tensor={tensor} must divide the heads ({model.n_heads}), kv heads "
                f"({model.n_kv_heads}) and ffn width ({model.ffn_dim}) of model {self.model}"
            )
        if model.tie_embeddings and pipeline > 1:
            raise ConfigError(
                f"training.model={self.model!r} ties its output projection to its token embedding "
                f"(one parameter on the first and last stage): pipeline must be 1, not {pipeline}"
            )
        if pipeline > model.n_layers:
            raise ConfigError(
                f"pipeline={pipeline} exceeds the {model.n_layers} layers of {self.model}"
            )

    def batch_rule(self, pipeline: int) -> BatchRule:
        """The data degrees these batch settings allow: the operator's rule (topotrain.degrees)."""
        return BatchRule(self.global_batch, self.micro_batch, pipeline, self.schedule)

    def microbatches(self, data: int) -> int:
        """Gradient-accumulation steps per rank: keeps the global batch fixed as dp changes."""
        return self.batch_rule(1).microbatches(data)


def _snake(key: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in key)
