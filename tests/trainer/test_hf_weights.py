"""Hugging Face weights through the real mesh: a tp=2 x pp=2 job (4 gloo ranks) starts from a
random transformers Llama (nothing downloaded) and trains from a dataset `prepare` tokenized;
its first loss is the Hugging Face model's on the same batch, and the weights it exports after
its steps are a single process's, trained from the same import on the same samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from topotrain_trainer.config import TrainingConfig
from topotrain_trainer.data import BatchLoader, TokenDataset, synthetic_sentences
from topotrain_trainer.hf import SafetensorsSource, config_from_hf, import_tensors
from topotrain_trainer.model import Transformer, model_config
from topotrain_trainer.shards import DirStore
from topotrain_trainer.tokens import prepare_dataset

from .harness import TrainerRun, trainer_env
from .reference import reference_run

pytestmark = [pytest.mark.trainer]
transformers = pytest.importorskip("transformers")


def imported(path: Path) -> Transformer:
    source = SafetensorsSource(DirStore(path))
    config = config_from_hf(source.config, model_config("tiny"), "tiny")
    model = Transformer(config)
    model.load_state_dict(import_tensors(source, config, [n for n, _ in model.named_parameters()]))
    return model


def test_a_3d_job_imports_trains_and_exports_hugging_face_weights(tmp_path: Path) -> None:
    docs = [" ".join(synthetic_sentences(20, seed=i)) for i in range(60)]
    prepare_dataset(DirStore(tmp_path / "data"), lambda: docs, vocab_size=300, shard_tokens=4096)
    hf = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=320, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(hf).float().eval()
    llama.save_pretrained(tmp_path / "hf")
    training = {"model": "tiny", "seqLen": 32, "globalBatch": 4, "microBatch": 1, "steps": 2,
                "metricsPort": 0, "progressEvery": 1, "dataset": str(tmp_path / "data"),
                "initWeights": str(tmp_path / "hf"), "exportWeights": str(tmp_path / "out")}  # fmt: skip
    run = TrainerRun(trainer_env(tensor=2, pipeline=2, training=training))
    assert run.finish() == 0, run.tail()
    assert [e["event"] for e in run.events].count("weights_exported") == 1

    inputs, targets = BatchLoader(TokenDataset(tmp_path / "data", 32), 1234, 4, 1, 0).batch_at(0)
    with torch.no_grad():
        logits = llama(inputs).logits
    first = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert run.losses()[1] == pytest.approx(float(first), abs=1e-5)

    model = imported(tmp_path / "hf")
    config = TrainingConfig.from_mapping({**training, "staging_dir": str(tmp_path)})
    losses, _ = reference_run(config, model=model)
    assert [run.losses()[s] for s in (1, 2)] == pytest.approx(losses, abs=1e-5)
    exported = imported(tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]
    for (name, ours), (_, theirs) in zip(model.named_parameters(), exported.named_parameters(), strict=True):
        torch.testing.assert_close(theirs, ours, atol=2e-6, rtol=1e-5, msg=name)
