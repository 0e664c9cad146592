"""torchtitan's own trainer on topotrain: its mesh in the operator's rank order, its own DCP
checkpoints through the SDK's folder adapter.

torchtitan (`torchtitan` 0.3) assumes an accelerator (CUDA, NCCL). Run it as its users do, from
a torchtitan checkout (its debug model reads the checkout's tests/assets), any torchtitan
argument passed through:

Locally:      torchrun --nproc-per-node=8 recipes/torchtitan_train.py --module llama3 \
                  --config llama3_debugmodel
On topotrain: the TrainingJob's command is
              ["topotrain-launch", "--", "python", "/app/torchtitan_train.py", "--module",
               "llama3", "--config", "llama3_debugmodel"]

The lines marked `# topotrain` are the ones topotrain needs (docs/byo-trainer.md counts them).
They give torchtitan the degrees the operator planned and a world mesh laid out so that each of
its pp/dp/tp groups is one the operator placed together (torchtitan unflattens its world
pp-outermost: the operator's `tp-dp-pp`; under `tp-pp-dp` the ranks are reordered); they
resume from the newest committed checkpoint's folder; after each step they report progress and
save when topotrain asks (the interval, a checkpoint request, SIGTERM: torchtitan's own full
save, then uploaded and committed).
"""

import shutil
import sys
from pathlib import Path
from typing import Any

import torchtitan.distributed.parallel_dims as titan_dims
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger

import topotrain_sdk as tt  # topotrain


def topotrain_args() -> list[str]:  # topotrain
    """The operator's degrees; torchtitan's checkpoints on this pod's disk, saved when asked."""  # topotrain
    sizes = tt.job().mesh_sizes  # topotrain
    return [f"--parallelism.tensor_parallel_degree={sizes['tensor']}",  # topotrain
            f"--parallelism.pipeline_parallel_degree={sizes['pipeline']}",  # topotrain
            f"--parallelism.data_parallel_shard_degree={sizes['data']}",  # topotrain
            "--parallelism.data_parallel_replicate_degree=1", "--checkpoint.enable",  # topotrain
            f"--dump_folder={tt.folder_steps().folder('titan')}", "--checkpoint.keep_latest_k=0",  # topotrain
            "--checkpoint.interval=1000000000", "--checkpoint.last_save_model_only=False"]  # topotrain


def operator_world(device_type: str, shape: Any, mesh_dim_names: Any) -> Any:  # topotrain
    return tt.world_mesh(("pipeline", "data", "tensor"), device_type=device_type)  # topotrain


def main() -> None:
    init_logger()
    config = ConfigManager().parse_args(sys.argv[1:] + topotrain_args())  # topotrain
    titan_dims.init_device_mesh = operator_world  # topotrain: torchtitan's world mesh
    trainer = config.build()
    folder = Path(config.dump_folder) / config.checkpoint.folder  # topotrain
    steps = tt.folder_steps()  # topotrain
    steps.resume(folder / "step-{step}")  # topotrain: torchtitan loads the newest folder there
    own_save = trainer.checkpointer.save  # topotrain

    def save(curr_step: int, last_step: bool = False) -> bool:  # topotrain: after every step
        if not (steps.after_step(curr_step) or last_step):  # topotrain
            return False  # topotrain
        own_save(curr_step, last_step=True)  # topotrain: a full save (last_save_model_only off)
        steps.saved(curr_step, folder / f"step-{curr_step}")  # topotrain: uploaded, committed
        shutil.rmtree(folder / f"step-{curr_step}", ignore_errors=True)  # topotrain
        return True  # topotrain

    trainer.checkpointer.save = save  # topotrain
    try:
        trainer.train()
    finally:
        trainer.close()
    tt.finish(config.training.steps)  # topotrain


if __name__ == "__main__":
    main()
