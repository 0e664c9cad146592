"""Hugging Face Llama weights in and out of the bundled trainer's model (hf.py): a small random
LlamaForCausalLM built by transformers (nothing downloaded) is imported, gives the same logits,
trains a step, is exported and imports back bit-exactly, and transformers reads the export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from topotrain_trainer.config import ConfigError
from topotrain_trainer.hf import (
    SafetensorsSource,
    config_from_hf,
    export_index,
    export_stage,
)
from topotrain_trainer.model import model_config
from topotrain_trainer.shards import DirStore
from topotrain_trainer.weights import weight_map

from tests.hf_import import imported

transformers = pytest.importorskip("transformers")


def hf_llama(path: Path, *, tied: bool) -> torch.nn.Module:
    """A random Llama of the `tiny` shape (width 64, 4 layers, 4 heads, 2 kv heads, FFN 128)."""
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=384, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_import_matches_train_export_and_reimport_bit_exactly(tmp_path: Path, tied: bool) -> None:
    reference = hf_llama(tmp_path / "hf", tied=tied)
    model = imported(tmp_path / "hf")
    assert model.config.vocab_size == 384 and model.config.rope_theta == 500000.0
    assert model.config.tie_embeddings is tied and (model.output is None) is tied
    tokens = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, atol=2e-5, rtol=1e-4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()

    out = DirStore(tmp_path / "out")
    weights = export_stage(out, dict(model.named_parameters()), model.config, 0, 1)
    assert weights == weight_map(model.config, 1)
    export_index(out, weights, model.config, torch.float32)
    again = imported(tmp_path / "out")
    for (name, trained), (_, loaded) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(trained, loaded), name
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model(tokens), atol=2e-5, rtol=1e-4)


def test_weights_of_another_shape_or_scaled_rope_are_a_bad_config(tmp_path: Path) -> None:
    hf_llama(tmp_path / "hf", tied=False)
    source = SafetensorsSource(DirStore(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=r"training.initWeights has the shape .* training.model='small'"):
        config_from_hf(source.config, model_config("small"), "small")
    scaled = {**source.config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0}}
    with pytest.raises(ConfigError, match="RoPE scaling 'llama3' is not implemented"):
        config_from_hf(scaled, model_config("tiny"), "tiny")
