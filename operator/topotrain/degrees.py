"""Which data-parallel degrees a job can run at: one rule for the operator, the CRD and the trainer.

A data degree `d` is allowed when every one of these holds:

1. whole pods: `spec.worker.gpusPerPod` divides `tensor*pipeline*d`;
2. `spec.parallelism.dataMultiple` (default 1) divides `d`;
3. `d` is in `spec.parallelism.allowedData`, when that list is set;
4. the bundled trainer's batch rule, when `spec.training` states a batch (sets
   `globalBatch` or `microBatch`; the other takes the trainer's default):
   `globalBatch % (microBatch*d) == 0`, and with `pipeline > 1` and the 1f1b
   schedule at least `pipeline` microbatches per step
   (`globalBatch / (microBatch*d) >= pipeline`).

The operator cannot see which program an image runs, so rule 4 follows what the
spec says rather than the image: a `spec.training` that names a batch size is
one the bundled trainer will split across data replicas. A trainer of one's own
states its constraint with rules 2 and 3.

Planning, elastic shrink and grow, the `topotrain plan` CLI, the CRD's CEL rules
(`CRD_*_RULES` below) and the bundled trainer (`topotrain_trainer.config`) all
read this module, so they cannot disagree. It works on plain numbers (tensor,
pipeline, gpusPerPod, the data limits and batch settings); the operator reads
them off a spec with `topotrain.api.validation` (`degree_rule`, `limits_for`,
`spec_problems`). Pure: no pydantic, no Kubernetes client, no torch, nothing
else of this package (the trainer image imports it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

# The bundled trainer's defaults (topotrain_trainer.config.TrainingConfig uses these).
DEFAULT_GLOBAL_BATCH = 16
DEFAULT_MICRO_BATCH = 2
DEFAULT_SCHEDULE = "1f1b"
SCHEDULE_NEEDS_PIPELINE_MICROBATCHES = "1f1b"
MAX_DATA = 65536  # spec.parallelism.data's upper bound
REASON = "DataDegreeNotAllowed"  # condition reason when a spec's degree can never run
# The bundled trainer's models (spec.training.model; topotrain_trainer.shapes.MODEL_CONFIGS has
# exactly these): the CRD refuses any other name at apply time.
BUNDLED_MODELS = ("tiny", "small", "1B", "3B", "8B", "70B", "7B", "13B")


@dataclass(frozen=True)
class BatchRule:
    """The bundled trainer's batch split: a fixed global batch in microbatches per data rank."""

    global_batch: int = DEFAULT_GLOBAL_BATCH
    micro_batch: int = DEFAULT_MICRO_BATCH
    pipeline: int = 1
    schedule: str = DEFAULT_SCHEDULE

    def microbatches(self, data: int) -> int:
        """Gradient-accumulation steps per rank at this data degree."""
        return self.global_batch // (self.micro_batch * data)

    def problem(self, data: int) -> str | None:
        """Why the trainer would refuse this data degree, naming the fields; None if it runs."""
        if self.global_batch % (self.micro_batch * data):
            return (
                f"training.globalBatch={self.global_batch} must be a multiple of "
                f"microBatch*data={self.micro_batch}*{data}"
            )
        needs = self.pipeline > 1 and self.schedule == SCHEDULE_NEEDS_PIPELINE_MICROBATCHES
        if needs and self.microbatches(data) < self.pipeline:
            return (
                f"1F1B needs at least pipeline={self.pipeline} microbatches per step; "
                f"globalBatch/(microBatch*data)={self.microbatches(data)}"
            )
        return None

    @classmethod
    def from_training(cls, training: Mapping[str, Any], pipeline: int) -> BatchRule | None:
        """The rule `spec.training` implies, or None when it states no batch (see module doc).

        Raises ValueError, naming the key, when a batch value is not a positive integer.
        """
        values = {_camel(str(key)): value for key, value in training.items()}
        if "globalBatch" not in values and "microBatch" not in values:
            return None
        schedule = values.get("schedule", DEFAULT_SCHEDULE)
        return cls(
            global_batch=_positive(values, "globalBatch", DEFAULT_GLOBAL_BATCH),
            micro_batch=_positive(values, "microBatch", DEFAULT_MICRO_BATCH),
            pipeline=pipeline,
            schedule=schedule if isinstance(schedule, str) else DEFAULT_SCHEDULE,
        )


@dataclass(frozen=True)
class DataLimits:
    """What a job's trainer needs of the data degree, beyond whole pods."""

    multiple: int = 1  # spec.parallelism.dataMultiple
    allowed: tuple[int, ...] = ()  # spec.parallelism.allowedData; empty: any
    batch: BatchRule | None = None

    def problem(self, data: int) -> str | None:
        if data % self.multiple:
            return f"spec.parallelism.dataMultiple={self.multiple} must divide the data degree"
        if self.allowed and data not in self.allowed:
            listed = ", ".join(map(str, sorted(self.allowed)))
            return f"spec.parallelism.allowedData is [{listed}]"
        return None if self.batch is None else self.batch.problem(data)


@dataclass(frozen=True)
class DegreeRule:
    """THE rule: which data degrees a job can run at."""

    tensor: int = 1
    pipeline: int = 1
    gpus_per_pod: int = 1
    limits: DataLimits = DataLimits()

    def problem(self, data: int) -> str | None:
        """Why `data` is not allowed, naming the field or rule; None when it is."""
        if data < 1:
            return f"the data degree must be >= 1, got {data}"
        ranks = self.tensor * self.pipeline * data
        if ranks % self.gpus_per_pod:
            return (
                f"spec.worker.gpusPerPod={self.gpus_per_pod} must divide "
                f"tensor*pipeline*data={self.tensor}*{self.pipeline}*{data}"
            )
        return self.limits.problem(data)

    def allows(self, data: int) -> bool:
        return self.problem(data) is None

    def degrees(self, low: int, high: int) -> list[int]:
        """Allowed degrees in [low, high], largest first."""
        return [d for d in range(high, max(low, 1) - 1, -1) if self.allows(d)]

    def nearest(self, data: int) -> list[int]:
        """The closest allowed degree below `data` and the closest above (either may be absent)."""
        below = next((d for d in range(data - 1, 0, -1) if self.allows(d)), None)
        above = next((d for d in range(data + 1, MAX_DATA + 1) if self.allows(d)), None)
        return [d for d in (below, above) if d is not None]

    def explain(self, low: int, high: int) -> str:
        """Why no degree in [low, high] is allowed (for a condition message)."""
        why = self.problem(high) or ""
        near = self.nearest(high)
        hint = f"; allowed degrees near it: {', '.join(map(str, near))}" if near else ""
        return f"no allowed data degree in [{low}, {high}] (at data={high}: {why}){hint}"


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _positive(values: Mapping[str, Any], key: str, default: int) -> int:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"spec.training.{key}={value!r} must be an integer >= 1")
    return value


# --- the same rule in CEL, for the CRD (api/validation.py adds these; api/crd.py generates) ----
# CEL sees only declared fields, so the CRD declares training.globalBatch, microBatch and
# schedule (api.spec.TRAINING_SCHEMA) while still preserving unknown keys.

def _spec_rules(name: str) -> list[dict[str, str]]:
    """The batch rule for `spec.parallelism.<name>` in CEL (self: the spec).

    Static messages: the API server estimates `string(int)` in a messageExpression as
    unbounded and refuses the CRD, so the values are in the operator's messages only.
    """
    t, par = "self.training", "self.parallelism"
    data = f"{par}.{name}"
    guard = "" if name == "data" else f"!has({data}) || "
    states = f"(has({t}.globalBatch) || has({t}.microBatch))"
    gb = f"(has({t}.globalBatch) ? {t}.globalBatch : {DEFAULT_GLOBAL_BATCH})"
    mb = f"(has({t}.microBatch) ? {t}.microBatch : {DEFAULT_MICRO_BATCH})"
    schedule = f"(has({t}.schedule) ? {t}.schedule : '{DEFAULT_SCHEDULE}')"
    head = f"spec.parallelism.{name} is not an allowed data degree: "
    return [
        {
            "rule": f"{guard}!{states} || {gb} % ({mb} * {data}) == 0",
            "message": f"{head}training.globalBatch must be a multiple of training.microBatch*{name} "
            f"(both as this job sets them; one it leaves unset is the default, globalBatch "
            f"{DEFAULT_GLOBAL_BATCH}, microBatch {DEFAULT_MICRO_BATCH})",
            "fieldPath": f".parallelism.{name}",
        },
        {
            "rule": f"{guard}!{states} || {par}.pipeline == 1 || {schedule} != "
            f"'{SCHEDULE_NEEDS_PIPELINE_MICROBATCHES}' || {gb} / ({mb} * {data}) >= {par}.pipeline",
            "message": f"{head}the 1f1b schedule needs at least pipeline microbatches per step "
            f"(training.globalBatch/(training.microBatch*{name}) >= pipeline)",
            "fieldPath": f".parallelism.{name}",
        },
    ]


CRD_SPEC_RULES: list[dict[str, str]] = [
    *_spec_rules("data"),
    *_spec_rules("minData"),
    {
        "rule": "!has(self.parallelism.minData) || (self.parallelism.tensor * self.parallelism.pipeline"
        " * self.parallelism.minData) % self.worker.gpusPerPod == 0",
        "message": "spec.parallelism.minData is not an allowed data degree: worker.gpusPerPod must "
        "divide tensor*pipeline*minData",
        "fieldPath": ".parallelism.minData",
    },
]


def _parallelism_rules(name: str, guard: str) -> list[dict[str, str]]:
    return [
        {
            "rule": f"{guard}!has(self.dataMultiple) || self.{name} % self.dataMultiple == 0",
            "message": f"spec.parallelism.{name} is not an allowed data degree: it must be a "
            "multiple of dataMultiple",
            "fieldPath": f".{name}",
        },
        {
            "rule": f"{guard}!has(self.allowedData) || self.allowedData.size() == 0"
            f" || self.{name} in self.allowedData",
            "message": f"spec.parallelism.{name} is not an allowed data degree: it must be one of "
            "allowedData",
            "fieldPath": f".{name}",
        },
    ]


CRD_PARALLELISM_RULES: list[dict[str, str]] = [
    *_parallelism_rules("data", ""),
    *_parallelism_rules("minData", "!has(self.minData) || "),
]
