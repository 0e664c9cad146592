"""A plain torchrun DDP training script, as the PyTorch tutorials write it, on topotrain.

Locally:      torchrun --nproc-per-node=2 recipes/ddp_train.py
On topotrain: the TrainingJob's command is
              ["topotrain-launch", "--fork", "--", "python", "recipes/ddp_train.py"]
              (the launcher starts one worker per local rank with torchrun's environment;
              --fork: forked from one interpreter that imported torch once).

The lines marked `# topotrain` are the ones topotrain needs: 5 of this script's lines.
They resume from the newest committed checkpoint, report progress (the heartbeat), save
every TOPOTRAIN_CHECKPOINT_INTERVAL steps, serve the operator's checkpoint requests, and on
SIGTERM save, commit and exit 75 (docs/byo-trainer.md).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import topotrain_sdk as tt  # topotrain

STEPS = int(os.environ.get("STEPS", "12"))
GLOBAL_BATCH = 32


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's global batch, drawn from the step alone: a step run
    again, at any number of ranks, trains on the same samples."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=generator).chunk(world)[rank]
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    dist.init_process_group("gloo")  # CPU; "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = tt.TrainState(model, optimizer)  # topotrain
    start = tt.load_latest(state)  # topotrain
    for step in range(start + 1, STEPS + 1):
        inputs, targets = batch(step, rank, world)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dist.all_reduce(global_loss := loss.detach() / world)  # the global batch's loss
        tt.step_done(step, state, loss=global_loss.item())  # topotrain
    tt.finish(STEPS)  # topotrain
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
