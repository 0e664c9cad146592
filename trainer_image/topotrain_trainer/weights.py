"""Which model a job builds, and its Hugging Face weights in and out across the mesh (hf.py has
the format; this module the collectives)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from topotrain_trainer.config import ConfigError, TrainingConfig
from topotrain_trainer.data import model_vocab
from topotrain_trainer.hf import (
    SafetensorsSource,
    config_from_hf,
    export_index,
    export_stage,
    import_tensors,
    stage_file,
)
from topotrain_trainer.model import ModelConfig, model_config, stage_layers
from topotrain_trainer.shards import missing, open_store


def job_model(config: TrainingConfig, dataset_vocab: int) -> tuple[ModelConfig, SafetensorsSource | None]:
    """The model to build: training.model's shape with the dataset tokenizer's vocabulary, or,
    with training.initWeights, the weights' vocabulary (which must cover the dataset's)."""
    if not config.init_weights:
        return model_config(config.model, model_vocab(dataset_vocab)), None
    try:
        source = SafetensorsSource(open_store(config.init_weights))
    except Exception as err:
        if not missing(err):
            raise
        raise ConfigError(f"training.initWeights={config.init_weights!r}: no config.json and "
                          "safetensors there") from None  # fmt: skip
    built = config_from_hf(source.config, model_config(config.model), config.model)
    if dataset_vocab > built.vocab_size:
        raise ConfigError(
            f"training.dataset has vocab_size {dataset_vocab}, but training.initWeights embeds only "
            f"{built.vocab_size} token ids: tokenize the dataset with the weights' tokenizer"
        )
    return built, source


def load_initial(model: nn.Module, source: SafetensorsSource, config: ModelConfig) -> None:
    """Copy the weights of this rank's stage in: each rank reads its stage's tensors whole and
    keeps its shards of them."""
    names = [name for name, _ in model.named_parameters()]
    full: dict[str, Any] = dict(import_tensors(source, config, names))
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, full, options=options)


def weight_map(config: ModelConfig, stages: int) -> dict[str, str]:
    """Which stage file holds each tensor of the whole model (hf.py's names)."""
    from topotrain_trainer.hf import hf_name

    owners: dict[str, int] = {"tok_embeddings.weight": 0, "norm.weight": stages - 1}
    if not config.tie_embeddings:
        owners["output.weight"] = stages - 1
    for stage in range(stages):
        for layer in stage_layers(config.n_layers, stage, stages):
            for module in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                           "attention_norm", "ffn_norm"):  # fmt: skip
                owners[f"layers.{layer}.{module}.weight"] = stage
    return {hf_name(name): stage_file(stage, stages) for name, stage in owners.items()}


def export(model: nn.Module, config: ModelConfig, uri: str, *, stage: int, stages: int,
           writer: bool) -> None:  # fmt: skip
    """Gather this stage's parameters one at a time (every rank of the stage takes part); the
    stage's `writer` writes its file, then global rank 0 the index and config.json."""
    tensors: dict[str, torch.Tensor] = {}
    dtype = torch.float32
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        dtype = full.dtype
        if writer:
            tensors[name] = full.cpu()
    store = open_store(uri)
    if writer:
        export_stage(store, tensors, config, stage, stages)
    dist.barrier()
    if dist.get_rank() == 0:
        export_index(store, weight_map(config, stages), config, dtype)


def export_checkpoint(job_prefix: str, step: int | None, model: str, out_uri: str) -> dict[str, object]:
    """On demand, in one process without torch.distributed: a committed checkpoint's model (the
    newest, or `step`) as Hugging Face safetensors at `out_uri`. The checkpoint's tensors give
    the vocabulary and the tying; `model` the shape and RoPE theta (one given by initWeights is
    not recorded in the checkpoint)."""
    from dataclasses import replace

    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from topotrain_sdk.checkpoints import CheckpointStore
    from topotrain_sdk.s3reader import S3RangeReader
    from topotrain_trainer.hf import export_stage
    from topotrain_trainer.model import Transformer

    store = CheckpointStore(job_prefix)
    commit = store.latest_committed() if step is None else store.read_commit(step)
    if commit is None:
        raise FileNotFoundError(f"{job_prefix}: no committed checkpoint{'' if step is None else f' {step}'}")
    stored = S3RangeReader(store, commit.step, commit.shards).read_metadata().state_dict_metadata
    embedding = stored["app.model.tok_embeddings.weight"]
    config = replace(model_config(model, int(embedding.size[0])),  # type: ignore[union-attr]
                     tie_embeddings="app.model.output.weight" not in stored)  # fmt: skip
    built = Transformer(config)
    state = {"app": {"model": built.state_dict()}}
    dcp_load(state, storage_reader=S3RangeReader(store, commit.step, commit.shards))
    built.load_state_dict(state["app"]["model"])
    out = open_store(out_uri)
    weights = export_stage(out, dict(built.named_parameters()), config, 0, 1)
    export_index(out, weights, config, next(built.parameters()).dtype)
    return {"step": commit.step, "out": out.uri, "vocab_size": config.vocab_size}
