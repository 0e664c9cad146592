"""The bundled trainer's model shapes against the published Llama ones, its names against the
CRD's, its loss over low-precision logits, and its FLOPs per token."""

from __future__ import annotations

import pytest
import torch
import yaml
from topotrain.degrees import BUNDLED_MODELS
from topotrain_trainer import parallel
from topotrain_trainer.config import ConfigError, TrainingConfig
from topotrain_trainer.metrics import peak_flops, throughput
from topotrain_trainer.model import MODEL_CONFIGS

from tests.example_manifests import ROOT

# Parameter counts of the published checkpoints (Llama 3.2 1B/3B with tied embeddings, Llama 3
# 8B/70B, Llama 2 7B/13B), as their safetensors hold them.
PUBLISHED = {"1B": 1_235_814_400, "3B": 3_212_749_824, "8B": 8_030_261_248, "70B": 70_553_706_496,
             "7B": 6_738_415_616, "13B": 13_015_864_320}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_llama_shapes_have_the_published_parameter_counts(name: str) -> None:
    config = MODEL_CONFIGS[name]
    assert config.num_params() == PUBLISHED[name]
    llama3 = name in ("1B", "3B", "8B", "70B")
    assert config.rope_theta == (500000.0 if llama3 else 10000.0)
    assert config.tie_embeddings is (name in ("1B", "3B"))


def test_the_crd_knows_exactly_the_trainers_models() -> None:
    assert set(BUNDLED_MODELS) == set(MODEL_CONFIGS)
    crd = yaml.safe_load((ROOT / "crds" / "topotrain.io_trainingjobs.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["training"]["properties"]["model"]["enum"] == list(BUNDLED_MODELS)


def test_a_tied_model_takes_no_pipeline() -> None:
    config = TrainingConfig(model="1B", global_batch=8, micro_batch=1)
    config.check_mesh(1, 1, 8)
    with pytest.raises(ConfigError, match=r"ties its output projection .* pipeline must be 1, not 2"):
        config.check_mesh(1, 2, 4)


def test_the_chunked_loss_of_bf16_logits_equals_the_whole_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "LOSS_CHUNK", 16)
    logits = torch.randn(3, 20, 50, generator=torch.Generator().manual_seed(0)).bfloat16()
    targets = torch.randint(0, 50, (3, 20), generator=torch.Generator().manual_seed(1))
    chunked, whole = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = parallel.cross_entropy(chunked, targets)
    reference = torch.nn.functional.cross_entropy(whole.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    reference.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, atol=1e-6, rtol=1e-6)
    assert chunked.grad is not None and whole.grad is not None
    torch.testing.assert_close(chunked.grad, whole.grad)


def test_flops_per_token_and_mfu() -> None:
    config = MODEL_CONFIGS["8B"]
    # 6 x the matmul weights (all but the embedding lookup) + 12 x layers x width x sequence
    expected = 6 * (8_030_261_248 - 128256 * 4096 - 4096 - 32 * 2 * 4096) + 12 * 32 * 4096 * 4096
    assert config.flops_per_token(4096) == expected
    tflops, mfu = throughput(expected, tokens=4096, seconds=1.0, devices=8, peak=peak_flops("NVIDIA H100 80GB HBM3"))
    assert tflops == pytest.approx(expected * 4096 / 8 / 1e12)
    assert mfu == pytest.approx(tflops * 1e12 / 989e12)
    assert throughput(expected, 4096, 1.0, 1, peak_flops("cpu"))[1] is None
