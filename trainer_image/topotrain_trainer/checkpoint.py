"""The bundled trainer's checkpoint state: what an exact resume needs (AppState).

Saving and restoring are `topotrain_sdk.dcp` (asynchronous DCP to S3, the commit protocol,
retention, ranged restore with resharding: one implementation for every trainer, issue 33);
its names are re-exported here.
"""

from __future__ import annotations

import io
import pickle
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from topotrain_sdk.dcp import Checkpointer as Checkpointer
from topotrain_sdk.dcp import Heartbeat as Heartbeat
from topotrain_sdk.dcp import RestoreStats as RestoreStats
from topotrain_sdk.dcp import make_stager as make_stager
from topotrain_sdk.dcp import staging_options as staging_options

# Optimizer state keyed per parameter name (not per param group), so a pipeline
# stage loads exactly its parameters' state from a checkpoint of any split.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Progress:
    """Where training stands: optimizer steps taken and global samples consumed."""

    def __init__(self) -> None:
        self.step = 0
        self.consumed_samples = 0


class AppState(Stateful):
    """Everything an exact resume needs, as one DCP-stateful object."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        progress: Progress,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.progress = (
            model,
            optimizer,
            scheduler,
            progress,
        )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # False only while loading a checkpoint of another mesh (RNG streams are per rank), so
        # that load asks for no RNG entry; every save carries this rank's RNG state.
        self.load_rng = True

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
        state: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "step": self.progress.step,
            "consumed_samples": self.progress.consumed_samples,
        }
        if self.load_rng:
            state[f"rng_rank{self.rank}"] = _rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=STATE_OPTIONS,
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.progress.step = int(state["step"])
        self.progress.consumed_samples = int(state["consumed_samples"])
        rng = state.get(f"rng_rank{self.rank}")
        if self.load_rng and isinstance(rng, io.BytesIO):
            _set_rng_state(rng)


def _rng_state() -> io.BytesIO:
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # this rank's GPU's generator
        states["cuda"] = torch.cuda.get_rng_state()
    return io.BytesIO(pickle.dumps(states))


def _set_rng_state(buffer: io.BytesIO) -> None:
    buffer.seek(0)
    states = pickle.loads(buffer.read())  # our own checkpoint, written by this trainer
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
