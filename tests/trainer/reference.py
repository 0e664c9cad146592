"""A single-process reference trainer: the plain model, no parallelism, no torch.distributed.

The multi-process runs must reproduce its losses; it shares only the model, the
data sampler and the LR schedule with the trainer, so a wrong reduction (sum
where a mean is meant), a wrong data split or a wrong pipeline split shows up.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from topotrain_trainer.config import TrainingConfig
from topotrain_trainer.data import BatchLoader, TokenDataset, ensure_synthetic, model_vocab
from topotrain_trainer.model import Transformer, model_config
from topotrain_trainer.shards import open_store
from topotrain_trainer.train import lr_lambda

from tests.datasets import client_for


def reference_run(
    config: TrainingConfig, steps: int | None = None, model: Transformer | None = None
) -> tuple[list[float], list[float]]:
    """(loss, gradient norm) of each step; `model`: start from it (trained in place) instead of
    the seed's initialisation."""
    root = Path(config.staging_dir or tempfile.mkdtemp())
    uri = str(ensure_synthetic(root, config.seed)) if config.dataset == "synthetic" else config.dataset
    dataset = TokenDataset(open_store(uri, client_for(uri)), config.seq_len)
    if model is None:
        torch.manual_seed(config.seed)
        model = Transformer(model_config(config.model, model_vocab(dataset.vocab_size)))
        model.init_weights()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
        foreach=False,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    loader = BatchLoader(dataset, config.seed, config.global_batch, data=1, dp_rank=0,
                         lengths=config.length_stages())
    micro = config.global_batch // config.micro_batch
    losses, norms = [], []
    for step in range(steps or config.steps):
        inputs, targets = loader.batch_at(step * config.global_batch)
        total = 0.0
        for x, y in zip(inputs.chunk(micro), targets.chunk(micro), strict=True):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1)) / micro
            torch.autograd.backward(loss)
            total += float(loss.detach())
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, norms
