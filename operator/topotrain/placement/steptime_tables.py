"""The step-time model's inputs: model shapes, GPU peaks, link speeds per level, the workload.

One table each, with the sources stated beside it (docs/placement.md, "Step-time model"):

- `MODELS`: the bundled trainer's models (`spec.training.model`, `degrees.BUNDLED_MODELS`):
  the shapes of `topotrain_trainer.shapes.MODEL_CONFIGS`, restated here because the operator
  may not import the trainer (`tests/unit/test_steptime.py` checks that they agree);
- `PEAK_TFLOPS`: published peak dense BF16 TFLOPS per GPU, keyed by the
  `nvidia.com/gpu.product` values the fleet files use, with family fallbacks for other
  spellings (NVIDIA's feature discovery writes e.g. `NVIDIA-H100-80GB-HBM3`);
- `LinkTable`: bandwidth (GB/s, one direction, per GPU) and latency (µs) by the innermost
  level two GPUs share: NVLink; a GPU's NIC (same rack); its share of the rack's uplink when
  every GPU of the rack sends out (same block); its share of the block's uplink likewise.

`Assumptions.from_json` overrides any of them (`topotrain plan --step-model FILE`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from topotrain.degrees import BUNDLED_MODELS, DEFAULT_GLOBAL_BATCH, DEFAULT_MICRO_BATCH

DEFAULT_MODEL = "tiny"  # the bundled trainer's defaults (topotrain_trainer.config.TrainingConfig)
DEFAULT_SEQ_LEN = 64
DEFAULT_UTILISATION = 0.40  # assumed model FLOPs utilisation of the compute (not of the links)


class StepTimeError(ValueError):
    """The step time cannot be predicted: names the input and why."""


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: the trainer's `ModelConfig` fields the model needs."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False

    @property
    def params(self) -> int:
        """Parameters, counted as `ModelConfig.num_params` counts them."""
        kv_dim = self.kv_heads * (self.dim // self.heads)
        layer = 2 * self.dim * self.dim + 2 * self.dim * kv_dim + 3 * self.dim * self.ffn + 2 * self.dim
        embeddings = (1 if self.tied else 2) * self.vocab * self.dim
        return self.layers * layer + embeddings + self.dim


def _llama3(dim: int, layers: int, heads: int, ffn: int, tied: bool = False) -> ModelShape:
    return ModelShape(dim, layers, heads, 8, ffn, 128256, tied)


def _llama2(dim: int, layers: int, heads: int, ffn: int) -> ModelShape:
    return ModelShape(dim, layers, heads, heads, ffn, 32000)


MODELS: dict[str, ModelShape] = {
    "tiny": ModelShape(64, 4, 4, 2, 128, 256),
    "small": ModelShape(256, 8, 8, 4, 688, 256),
    "1B": _llama3(2048, 16, 32, 8192, tied=True),
    "3B": _llama3(3072, 28, 24, 8192, tied=True),
    "8B": _llama3(4096, 32, 32, 14336),
    "70B": _llama3(8192, 80, 64, 28672),
    "7B": _llama2(4096, 32, 32, 11008),
    "13B": _llama2(5120, 40, 40, 13824),
}
assert tuple(MODELS) == BUNDLED_MODELS

# Peak dense (no sparsity) BF16 TFLOPS per GPU from NVIDIA's data sheets: A100 SXM 312, H100 SXM
# 989, H200 989, B200 2,250, GB200 (per Blackwell GPU of a superchip) 2,500.
PEAK_TFLOPS: dict[str, float] = {"A100-80GB": 312.0, "H100-80GB": 989.0, "NVIDIA-GB200": 2500.0, "GB200": 2500.0}
_FAMILIES = (("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100", 989.0), ("A100", 312.0))


@dataclass(frozen=True)
class Link:
    """One GPU's share of a link: bandwidth in GB/s (one direction) and latency in µs."""

    bandwidth_gbps: float
    latency_us: float

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class LinkTable:
    """The link between two GPUs by the innermost level they share (defaults: an HGX H100
    fleet with one 400 Gb/s NIC per GPU, a leaf switch per rack, a spine per block with the
    racks' uplinks oversubscribed 2:1, and a core with the blocks' uplinks oversubscribed 4:1).
    `block` and `cross_block` are a GPU's share of an uplink when all GPUs under it use it;
    a flow gets up to its NIC's `rack` figure when fewer share it (steptime.Fabric)."""

    nvlink: Link = Link(450.0, 5.0)  # NVLink 4: 900 GB/s both ways per H100
    rack: Link = Link(50.0, 8.0)  # 400 Gb/s per GPU through the rack's leaf switch
    block: Link = Link(25.0, 12.0)  # the rack's uplink to the block's spine, 2:1, per GPU
    cross_block: Link = Link(12.5, 20.0)  # the block's uplink to the core, 4:1, per GPU of the block

    def at(self, level: int) -> Link:
        return (self.nvlink, self.rack, self.block, self.cross_block)[level]


LINK_KEYS = {"nvlink": "nvlink", "rack": "rack", "block": "block", "crossBlock": "cross_block"}


@dataclass(frozen=True)
class Assumptions:
    """Everything the model assumes that a spec does not say; `from_json` overrides it."""

    links: LinkTable = field(default_factory=LinkTable)
    utilisation: float = DEFAULT_UTILISATION
    peak_tflops: Mapping[str, float] = field(default_factory=lambda: dict(PEAK_TFLOPS))

    def peak(self, product: str) -> float:
        """Peak dense BF16 TFLOPS of one GPU of this product."""
        if product in self.peak_tflops:
            return self.peak_tflops[product]
        upper = product.upper()
        for family, tflops in _FAMILIES:
            if family in upper:
                return tflops
        raise StepTimeError(
            f"GPU product {product!r}: no peak BF16 TFLOPS known (known: {sorted(self.peak_tflops)}, "
            f"or a name containing {', '.join(f for f, _ in _FAMILIES)}); give it in peakTflops"
        )

    @classmethod
    def from_json(cls, doc: Any, where: str = "") -> Assumptions:
        """Defaults overridden by a document {"links": {"nvlink"|"rack"|"block"|"crossBlock":
        {"bandwidthGBps", "latencyUs"}}, "utilisation", "peakTflops": {product: TFLOPS}}."""
        if not isinstance(doc, Mapping):
            raise StepTimeError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        unknown = set(doc) - {"links", "utilisation", "peakTflops"}
        if unknown:
            raise StepTimeError(f"{where}{sorted(unknown)[0]}: unknown (links, utilisation, peakTflops)")
        base = cls()
        links = _links(doc.get("links", {}), base.links, f"{where}links")
        utilisation = base.utilisation
        if "utilisation" in doc:
            utilisation = _positive(doc["utilisation"], f"{where}utilisation")
            if utilisation > 1:
                raise StepTimeError(f"{where}utilisation: must be in (0, 1], got {utilisation}")
        peaks = dict(base.peak_tflops)
        raw = doc.get("peakTflops", {})
        if not isinstance(raw, Mapping):
            raise StepTimeError(f"{where}peakTflops: expected an object of product -> TFLOPS")
        peaks.update({str(k): _positive(v, f"{where}peakTflops.{k}") for k, v in raw.items()})
        return cls(links=links, utilisation=utilisation, peak_tflops=peaks)

    @classmethod
    def from_file(cls, path: Path) -> Assumptions:
        try:
            doc = json.loads(path.read_text())
        except OSError as exc:
            raise StepTimeError(f"{path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise StepTimeError(f"{path}: not valid JSON: {exc}") from None
        return cls.from_json(doc, f"{path}: ")


def _links(raw: Any, base: LinkTable, where: str) -> LinkTable:
    if not isinstance(raw, Mapping):
        raise StepTimeError(f"{where}: expected an object keyed by {', '.join(LINK_KEYS)}")
    table = base
    for key, value in raw.items():
        if key not in LINK_KEYS:
            raise StepTimeError(f"{where}.{key}: unknown level (one of {', '.join(LINK_KEYS)})")
        if not isinstance(value, Mapping) or set(value) - {"bandwidthGBps", "latencyUs"}:
            raise StepTimeError(f"{where}.{key}: expected {{bandwidthGBps, latencyUs}}")
        link: Link = getattr(table, LINK_KEYS[key])
        if "bandwidthGBps" in value:
            link = replace(link, bandwidth_gbps=_positive(value["bandwidthGBps"], f"{where}.{key}.bandwidthGBps"))
        if "latencyUs" in value:
            link = replace(link, latency_us=_non_negative(value["latencyUs"], f"{where}.{key}.latencyUs"))
        table = replace(table, **{LINK_KEYS[key]: link})
    return table


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StepTimeError(f"{where}: must be a number, got {value!r}")
    return float(value)


def _positive(value: Any, where: str) -> float:
    number = _number(value, where)
    if number <= 0:
        raise StepTimeError(f"{where}: must be > 0, got {value!r}")
    return number


def _non_negative(value: Any, where: str) -> float:
    number = _number(value, where)
    if number < 0:
        raise StepTimeError(f"{where}: must be >= 0, got {value!r}")
    return number


@dataclass(frozen=True)
class Workload:
    """What one step trains: the model and the batch (`spec.training`, the trainer's defaults)."""

    model: str = DEFAULT_MODEL
    seq_len: int = DEFAULT_SEQ_LEN
    global_batch: int = DEFAULT_GLOBAL_BATCH
    micro_batch: int = DEFAULT_MICRO_BATCH

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise StepTimeError(f"training.model: {self.model!r} is not one of {', '.join(MODELS)}")
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StepTimeError(f"training.{_camel(f.name)}: must be an integer >= 1")

    @property
    def shape(self) -> ModelShape:
        return MODELS[self.model]

    def microbatches(self, data: int) -> float:
        """Micro-batches per data replica per step: globalBatch / (microBatch x data)."""
        if self.global_batch < self.micro_batch * data:
            raise StepTimeError(
                f"training.globalBatch ({self.global_batch}) is smaller than microBatch x data "
                f"({self.micro_batch} x {data}): a replica would get no micro-batch"
            )
        return self.global_batch / (self.micro_batch * data)

    @classmethod
    def from_training(cls, training: Mapping[str, Any]) -> Workload:
        """From `spec.training` (camelCase or the trainer's snake_case keys)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            for key in (_camel(f.name), f.name):
                if key in training:
                    values[f.name] = training[key]
                    break
        return cls(**values)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
