"""Hugging Face weights through the real mesh: a tp=2 x pp=2 job (4 gloo ranks) starts from a
random transformers Llama (nothing downloaded) and trains from a dataset `prepare` tokenized into
S3; its first loss is the Hugging Face model's on the same batch, the weights it exports at the
end are a single process's trained from the same import on the same samples, and the on-demand
export of its last committed checkpoint is bit for bit the same."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from topotrain_trainer.config import TrainingConfig
from topotrain_trainer.data import BatchLoader, TokenDataset, synthetic_sentences
from topotrain_trainer.shards import S3Store
from topotrain_trainer.tokens import prepare_dataset
from topotrain_trainer.weights import export_checkpoint

from testbed.s3 import S3Server
from tests.hf_import import imported

from .harness import TrainerRun, trainer_env
from .reference import reference_run

pytestmark = [pytest.mark.trainer]
transformers = pytest.importorskip("transformers")


def test_a_3d_job_imports_trains_and_exports_hugging_face_weights(
    tmp_path: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    bucket = s3.create_bucket(f"hf-{uuid.uuid4().hex[:8]}")
    docs = [" ".join(synthetic_sentences(20, seed=i)) for i in range(60)]
    prepare_dataset(S3Store(f"s3://{bucket}/data", client=s3.client()), lambda: docs, vocab_size=300,
                    shard_tokens=4096)  # fmt: skip
    hf = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=320, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(hf).float().eval()
    llama.save_pretrained(tmp_path / "hf")
    training = {"model": "tiny", "seqLen": 32, "globalBatch": 4, "microBatch": 1, "steps": 2,
                "metricsPort": 0, "progressEvery": 1, "dataset": f"s3://{bucket}/data",
                "initWeights": str(tmp_path / "hf"), "exportWeights": str(tmp_path / "out")}  # fmt: skip
    checkpoints = f"s3://{bucket}/jobs/hf"
    run = TrainerRun(trainer_env(tensor=2, pipeline=2, training=training, s3_env=s3.env(),
                                 checkpoint_uri=checkpoints, interval=2))  # fmt: skip
    assert run.finish() == 0, run.tail()
    assert [e["event"] for e in run.events].count("weights_exported") == 1

    dataset = TokenDataset(S3Store(f"s3://{bucket}/data", client=s3.client()), 32)
    inputs, targets = BatchLoader(dataset, 1234, 4, 1, 0).batch_at(0)
    with torch.no_grad():
        first = torch.nn.functional.cross_entropy(llama(inputs).logits.flatten(0, 1), targets.flatten())
    assert run.losses()[1] == pytest.approx(float(first), abs=1e-5)

    model = imported(tmp_path / "hf")
    losses, _ = reference_run(TrainingConfig.from_mapping({**training, "stagingDir": str(tmp_path)}), model=model)
    assert [run.losses()[s] for s in (1, 2)] == pytest.approx(losses, abs=1e-5)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]  # fmt: skip
    exported = imported(tmp_path / "out")
    for (name, ours), (_, theirs) in zip(model.named_parameters(), exported.named_parameters(), strict=True):
        torch.testing.assert_close(theirs, ours, atol=2e-6, rtol=1e-5, msg=name)

    assert export_checkpoint(checkpoints, None, "tiny", str(tmp_path / "on-demand"))["step"] == 2
    again = imported(tmp_path / "on-demand")
    for (name, at_end), (_, on_demand) in zip(exported.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(at_end, on_demand), name
