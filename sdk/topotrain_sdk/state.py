"""`TrainState`: a model and its optimizer as one DCP-stateful object (torch).

Optimizer state is keyed per parameter name (flattened), so a checkpoint loads back onto
another data degree or another wrapping (DDP, FSDP) of the same model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainState(Stateful):
    """What a resume needs: the model, the optimizer, and any other Stateful (a scheduler...)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **extra: Any) -> None:
        self.model, self.optimizer, self.extra = model, optimizer, extra

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer, options=OPTIONS)
        return {"model": model, "optim": optim,
                **{name: item.state_dict() for name, item in self.extra.items()}}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=OPTIONS)  # fmt: skip
        for name, item in self.extra.items():
            item.load_state_dict(state[name])
