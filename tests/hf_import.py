"""A Hugging Face Llama folder loaded into one process's model: the trainer's import
(topotrain_trainer.hf) without its per-stage split, shared by the unit and trainer tests."""

from __future__ import annotations

from pathlib import Path

from topotrain_trainer.hf import SafetensorsSource, config_from_hf, import_tensors
from topotrain_trainer.model import Transformer, model_config
from topotrain_trainer.shards import DirStore


def imported(path: Path) -> Transformer:
    source = SafetensorsSource(DirStore(path))
    config = config_from_hf(source.config, model_config("tiny"), "tiny")
    model = Transformer(config)
    model.load_state_dict(import_tensors(source, config, [n for n, _ in model.named_parameters()]))
    return model
