"""The CPU trainer image's build check (trainer_image/Dockerfile, FLAVOUR=cpu).

After trainer_image/cpu-prune.txt removed the CUDA files a CPU process never opens: torch
imports, and what the trainer does on CPU still works (a gloo process group and an
all-reduce, autograd and an AdamW step, a DCP save and load).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

assert dist.is_gloo_available(), "torch.distributed has no gloo"
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(4)
dist.all_reduce(t)
model = torch.nn.Linear(8, 8)
optim = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 8)).sum().backward()
optim.step()
with tempfile.TemporaryDirectory() as d:
    dcp.save({"model": model.state_dict()}, checkpoint_id=d)
    loaded = {"model": torch.nn.Linear(8, 8).state_dict()}
    dcp.load(loaded, checkpoint_id=d)
    assert torch.equal(loaded["model"]["weight"], model.state_dict()["weight"]), "DCP round trip"
dist.destroy_process_group()
print("torch", torch.__version__, "CPU check passed")
