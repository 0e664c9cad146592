"""`job()`: the job as the operator describes it to this process (stdlib only).

Inside a TrainingJob the pod environment (`contract.py`) and the launcher's torchrun variables
(RANK, LOCAL_RANK, ...) say everything. Outside one (no TOPOTRAIN_JOB_NAME: a laptop, plain
torchrun, a notebook) `job()` describes a local job: one process, or torchrun's world as data
parallelism, no checkpoint store unless TOPOTRAIN_CHECKPOINT_URI is set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from topotrain_sdk.contract import (
    CONTRACT_VERSION,
    CONTRACT_VERSION_ENV,
    JOB_NAME,
    RANK_ORDERS,
    ContractError,
    TrainerEnv,
    rank_coords,
)

# The mesh dimensions, as the operator names them, and the letters of `rankOrder`.
DIMENSIONS = ("tensor", "pipeline", "data")
_LETTERS = {"tp": "tensor", "pp": "pipeline", "dp": "data"}


@dataclass(frozen=True)
class Job:
    """One process's view of its TrainingJob (or of a local run)."""

    env: TrainerEnv
    rank: int  # global rank
    local_rank: int
    in_training_job: bool  # False: a local run outside the operator
    training: Mapping[str, Any] = field(default_factory=dict)  # spec.training, as JSON

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """{"tensor": TP, "pipeline": PP, "data": DP}."""
        return {"tensor": self.env.tensor, "pipeline": self.env.pipeline, "data": self.env.data}

    @property
    def rank_order(self) -> str:
        """Innermost dimension first, e.g. "tp-pp-dp"."""
        return self.env.rank_order

    def mesh_dims(self) -> list[tuple[str, int]]:
        """(dimension, size), outermost first: the shape of a row-major mesh whose flat index
        is the global rank (for tp-pp-dp: data, pipeline, tensor)."""
        inner_first = [_LETTERS[letter] for letter in self.rank_order.split("-")]
        return [(name, self.mesh_sizes[name]) for name in reversed(inner_first)]

    @property
    def coords(self) -> dict[str, int]:
        """This rank's position: {"tensor": tp, "pipeline": pp, "data": dp}."""
        env = self.env
        tp, pp, dp = rank_coords(self.rank, env.tensor, env.pipeline, env.data, env.rank_order)
        return {"tensor": tp, "pipeline": pp, "data": dp}

    @property
    def attempt(self) -> int:
        return self.env.attempt

    @property
    def resume_step(self) -> int | None:
        """The committed step the operator chose for this attempt; None: start fresh."""
        return self.env.resume_step

    @property
    def checkpoint_prefix(self) -> str:
        """`s3://bucket/<uri>/<namespace>/<name>`; "" without a checkpoint store."""
        return self.env.checkpoint_uri

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints; 0: none but those asked for (SIGTERM, requests)."""
        return self.env.checkpoint_interval

    @property
    def checkpoint_keep(self) -> int:
        return self.env.checkpoint_keep

    @property
    def name(self) -> str:
        return self.env.job_name

    @property
    def contract_version(self) -> int:
        """The contract version the operator speaks (TOPOTRAIN_CONTRACT_VERSION; 0: an operator
        older than versions). This SDK speaks `contract.CONTRACT_VERSION`."""
        return self.env.contract_version

    @property
    def namespace(self) -> str:
        return self.env.job_namespace


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ContractError(f"{key}={raw!r} is not an integer") from None


def job(environ: Mapping[str, str] | None = None) -> Job:
    """This process's job. Raises ContractError (naming the variable) on a broken contract."""
    environ = os.environ if environ is None else environ
    inside = bool(environ.get(JOB_NAME))
    if inside:
        env = TrainerEnv.from_env(environ)
    else:  # plain python or torchrun: torchrun's world is the data parallelism
        world = _int(environ, "WORLD_SIZE", 1)
        local = {k: v for k, v in environ.items() if k not in ("NNODES", "NODE_RANK", "NPROC_PER_NODE")}
        nproc = _int(environ, "LOCAL_WORLD_SIZE", world)
        local.update(NNODES=str(max(1, world // max(1, nproc))), NPROC_PER_NODE=str(nproc),
                     NODE_RANK=str(_int(environ, "GROUP_RANK", 0)))
        local.setdefault("TOPOTRAIN_DP", str(world))
        local.setdefault(CONTRACT_VERSION_ENV, str(CONTRACT_VERSION))  # no operator to differ
        env = TrainerEnv.from_env(local)
    local_rank = _int(environ, "LOCAL_RANK", 0)
    rank = _int(environ, "RANK", env.node_rank * env.nproc_per_node + local_rank)
    if not 0 <= rank < env.world_size:
        raise ContractError(f"RANK={rank} outside [0, {env.world_size})")
    try:
        training = json.loads(env.training_config or "{}")
    except ValueError as err:
        raise ContractError(f"TOPOTRAIN_TRAINING_CONFIG is not JSON: {err}") from None
    if not isinstance(training, dict):
        raise ContractError("TOPOTRAIN_TRAINING_CONFIG must be a JSON object")
    if env.rank_order not in RANK_ORDERS:
        raise ContractError(f"TOPOTRAIN_RANK_ORDER={env.rank_order!r}: must be one of {RANK_ORDERS}")
    return Job(env, rank, local_rank, inside, training)
