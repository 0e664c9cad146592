"""A plain torchrun DDP training script, as the PyTorch tutorials write it, on topotrain.

Locally:      torchrun --nproc-per-node=2 recipes/ddp_train.py
On topotrain: the TrainingJob's command is
              ["topotrain-launch", "--", "python", "recipes/ddp_train.py"]
              (the launcher starts one worker per local rank with torchrun's environment).

The lines marked `# topotrain` are the ones topotrain needs: 5 of this script's lines.
They resume from the newest committed checkpoint, report progress (the heartbeat), save
every TOPOTRAIN_CHECKPOINT_INTERVAL steps, serve the operator's checkpoint requests, and on
SIGTERM save, commit and exit 75 (docs/byo-trainer.md).
"""

import os

import topotrain_sdk as tt  # topotrain
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(os.environ.get("STEPS", "12"))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data drawn from (step, rank): a step run again sees the same batch."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    dist.init_process_group("gloo")  # CPU; "nccl" on GPUs
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = tt.TrainState(model, optimizer)  # topotrain
    start = tt.load_latest(state)  # topotrain
    for step in range(start + 1, STEPS + 1):
        inputs, targets = batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        tt.step_done(step, state, loss=loss.item())  # topotrain
    tt.finish(STEPS)  # topotrain
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
