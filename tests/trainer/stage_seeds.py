"""A rank of the three-stage seeding check (test_stage_seeding.py): builds its pipeline stage of a
three-layer model on the meta device, initialises it as the trainer does for models too large to
build whole, and saves its layer's weights to <out>/stage-<pp>.pt. Run under torchrun."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from topotrain_trainer.model import model_config
from topotrain_trainer.parallel import build_mesh, build_stage, init_distributed


def main(out: Path) -> None:
    device = init_distributed()
    mesh = build_mesh(device, 1, dist.get_world_size(), 1, "tp-pp-dp")
    config = replace(model_config("tiny"), n_layers=dist.get_world_size())
    model = build_stage(config, mesh, seed=1234, bf16=False, activation_checkpointing=False, meta_init=True)
    state = {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()
             if name.startswith("layers.")}  # fmt: skip
    torch.save(state, out / f"stage-{mesh.pp_rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
