"""A Hugging Face `transformers` Trainer script, as its users write one, on topotrain.

A small Llama built from a config in code (no model or tokenizer is downloaded), trained on
synthetic token sequences by the stock `Trainer`, which saves and resumes its own checkpoint
folders. One `TrainerCallback` does topotrain's side through the SDK's folder adapter.

Locally:      torchrun --nproc-per-node=2 recipes/hf_trainer.py
On topotrain: the TrainingJob's command is
              ["topotrain-launch", "--fork", "--", "python", "recipes/hf_trainer.py"]

The lines marked `# topotrain` are the ones topotrain needs (docs/byo-trainer.md counts them).
They resume the Trainer from the newest committed checkpoint's folder, report each step (the
heartbeat), save every TOPOTRAIN_CHECKPOINT_INTERVAL steps and on the operator's checkpoint
requests (the Trainer's own save, then uploaded and committed), and on SIGTERM save, commit
and exit 75.
"""

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import topotrain_sdk as tt  # topotrain

STEPS = int(os.environ.get("STEPS", "12"))
GLOBAL_BATCH, SEQUENCE, VOCAB = 8, 16, 256


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Synthetic token sequences, each drawn from its index alone (an arithmetic pattern with
    noise, so there is something to learn)."""

    def __len__(self) -> int:
        return STEPS * GLOBAL_BATCH

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        start, stride = torch.randint(VOCAB, (2,), generator=generator).tolist()
        ids = (start + stride * torch.arange(SEQUENCE)) % VOCAB
        noise = torch.rand(SEQUENCE, generator=generator) < 0.1
        ids = torch.where(noise, torch.randint(VOCAB, (SEQUENCE,), generator=generator), ids)
        return {"input_ids": ids, "labels": ids.clone()}


class Topotrain(TrainerCallback):  # topotrain
    """topotrain's side at the Trainer's step boundaries (needs logging_steps=1)."""  # topotrain

    def __init__(self) -> None:  # topotrain
        self.steps = tt.folder_steps()  # topotrain

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:  # topotrain
        if logs and "loss" in logs and self.steps.after_step(state.global_step, loss=logs["loss"]):  # topotrain
            control.should_save = True  # topotrain: the Trainer saves this step next

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # topotrain
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"  # topotrain
        self.steps.saved(state.global_step, folder)  # topotrain: uploaded, committed
        shutil.rmtree(folder, ignore_errors=True)  # topotrain


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE)
    args = TrainingArguments(
        output_dir=str(tt.folder_steps().folder("hf")),  # topotrain: this pod's own disk
        max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // world, learning_rate=3e-3,
        warmup_steps=2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        ddp_backend="gloo", disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens(),
                      callbacks=[Topotrain()])  # topotrain
    resume = tt.folder_steps().resume()  # topotrain
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    tt.finish(STEPS)  # topotrain


if __name__ == "__main__":
    main()
