"""Hugging Face Llama weights in and out: safetensors files and config.json, in a directory or
under an S3 prefix (shards.py's stores).

Import (`training.initWeights`): the weights must have the shape of `training.model` (width,
layers, heads, kv heads, FFN width); their vocabulary, RoPE theta, norm epsilon and embedding
tying are taken from their config.json. Each rank reads only the tensors of its own pipeline
stage, by byte range from the safetensors files (a file is an 8-byte header length, a JSON header
of {name: {dtype, shape, data_offsets}}, then the data), never a whole file.

Export (`training.exportWeights`, at the end of training; `python -m topotrain_trainer export`
for any committed checkpoint): one safetensors file per pipeline stage, the index that maps each
tensor to its file, and a config.json for LlamaForCausalLM, in the dtype the model trains in
(fp32 master weights: a re-import is bit-exact).

The two layouts differ in one place: this model rotates interleaved pairs (x[2i], x[2i+1]) in
RoPE, Hugging Face's Llama rotates halves (x[i], x[i + d/2]); the rows of the query and key
projections are permuted between them, as Hugging Face's own conversion of Meta's weights does.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from topotrain_trainer.config import ConfigError
from topotrain_trainer.model import ModelConfig
from topotrain_trainer.shards import DatasetStore

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}  # fmt: skip


def hf_name(name: str) -> str:
    """Hugging Face's name of one of this model's parameters."""
    if name in _TOP:
        return _TOP[name]
    _, index, rest = name.split(".", 2)  # layers.<i>.<module>.weight
    module = rest.rsplit(".", 1)[0]
    return f"model.layers.{index}.{_LAYER[module]}.weight"


def _rope_rows(weight: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """Reorder a q/k projection's rows between interleaved-pair and half-split RoPE."""
    rows, cols = weight.shape
    half = rows // heads // 2
    if to_hf:
        return weight.view(heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)
    return weight.view(heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def convert(name: str, tensor: torch.Tensor, config: ModelConfig, *, to_hf: bool) -> torch.Tensor:
    if name.endswith("attention.wq.weight"):
        return _rope_rows(tensor, config.n_heads, to_hf)
    if name.endswith("attention.wk.weight"):
        return _rope_rows(tensor, config.n_kv_heads, to_hf)
    return tensor


class SafetensorsSource:
    """The tensors of a Hugging Face checkpoint in a store, read by byte range."""

    def __init__(self, store: DatasetStore) -> None:
        self.store = store
        self.config: dict[str, Any] = json.loads(store.read(CONFIG))
        try:
            weight_map: dict[str, str] = json.loads(store.read(INDEX))["weight_map"]
        except Exception as err:
            if not _missing(err):
                raise
            weight_map = {}
        files = sorted(set(weight_map.values())) or [SINGLE]
        self.where: dict[str, tuple[str, dict[str, Any], int]] = {}
        for file in files:
            (length,) = struct.unpack("<Q", store.read_range(file, 0, 8))
            header: dict[str, Any] = json.loads(store.read_range(file, 8, length))
            header.pop("__metadata__", None)
            for key, entry in header.items():
                self.where[key] = (file, entry, 8 + length)

    def tensor(self, key: str) -> torch.Tensor:
        file, entry, base = self.where[key]
        begin, end = entry["data_offsets"]
        data = bytearray(self.store.read_range(file, base + begin, end - begin))
        flat = torch.frombuffer(data, dtype=DTYPES[entry["dtype"]]) if data else torch.empty(0)
        return flat.reshape(entry["shape"])


def _missing(err: BaseException) -> bool:
    from topotrain_trainer.shards import missing

    return missing(err)


def rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConfigError(f"training.initWeights: RoPE scaling {kind!r} is not implemented "
                          "(only the default RoPE)")  # fmt: skip
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict[str, Any], base: ModelConfig, model: str) -> ModelConfig:
    """`base` (training.model's shape) with the weights' vocabulary, RoPE, epsilon and tying;
    ConfigError when their shape is another."""
    theirs = {"dim": hf.get("hidden_size"), "n_layers": hf.get("num_hidden_layers"),
              "n_heads": hf.get("num_attention_heads"),
              "n_kv_heads": hf.get("num_key_value_heads", hf.get("num_attention_heads")),
              "ffn_dim": hf.get("intermediate_size")}  # fmt: skip
    ours = {key: getattr(base, key) for key in theirs}
    head_dim = hf.get("head_dim") or base.head_dim
    if theirs != ours or head_dim != base.head_dim:
        raise ConfigError(f"training.initWeights has the shape {theirs}, training.model={model!r} "
                          f"has {ours}: name the model of that shape")  # fmt: skip
    return replace(base, vocab_size=int(hf["vocab_size"]), rope_theta=rope_theta(hf),
                   norm_eps=float(hf.get("rms_norm_eps", base.norm_eps)),
                   tie_embeddings=bool(hf.get("tie_word_embeddings", False)))  # fmt: skip


def import_tensors(source: SafetensorsSource, config: ModelConfig, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """This model's full tensors for `names` (one stage's parameters), converted."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        key = hf_name(name)
        if key not in source.where:
            raise ConfigError(f"training.initWeights has no tensor {key} (for {name})")
        out[name] = convert(name, source.tensor(key), config, to_hf=False)
    return out


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with this model's shape."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": config.dim, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "intermediate_size": config.ffn_dim,
        "vocab_size": config.vocab_size, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip


def stage_file(stage: int, stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def export_stage(store: DatasetStore, tensors: dict[str, torch.Tensor], config: ModelConfig,
                 stage: int, stages: int) -> dict[str, str]:  # fmt: skip
    """Write one stage's full tensors as a safetensors file; returns its part of the weight map."""
    converted = {hf_name(n): convert(n, t.detach().cpu(), config, to_hf=True).contiguous()
                 for n, t in tensors.items()}  # fmt: skip
    file = stage_file(stage, stages)
    store.write(file, save_safetensors(converted, metadata={"format": "pt"}))
    return dict.fromkeys(converted, file)


def export_index(store: DatasetStore, weight_map: dict[str, str], config: ModelConfig,
                 dtype: torch.dtype) -> None:  # fmt: skip
    """The index and config.json, written after every stage's file (config.json last)."""
    store.write(INDEX, json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))},
                                  indent=1).encode())  # fmt: skip
    store.write(CONFIG, json.dumps(hf_config(config, dtype), indent=1).encode())
