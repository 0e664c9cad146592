"""The bundled trainer's pod supervisor: `topotrain_sdk.supervisor` (one implementation for every
trainer, issue 33), running `python -m topotrain_trainer` as the pod's local ranks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from topotrain_sdk import supervisor as _sdk

# Re-exported: the trainer, its tests and the testbed's stand-in import them from here.
from topotrain_sdk.contract import EXIT_BAD_CONFIG as EXIT_BAD_CONFIG
from topotrain_sdk.contract import EXIT_PEER_LOST as EXIT_PEER_LOST
from topotrain_sdk.contract import TrainerEnv
from topotrain_sdk.supervisor import SPARE_DELAY_ENV as SPARE_DELAY_ENV
from topotrain_sdk.supervisor import SPARE_ENV as SPARE_ENV
from topotrain_sdk.supervisor import Supervisor as Supervisor
from topotrain_sdk.supervisor import WorkerGroup as WorkerGroup
from topotrain_sdk.supervisor import await_activation as await_activation
from topotrain_sdk.supervisor import peer_wait_seconds as peer_wait_seconds
from topotrain_sdk.supervisor import store_reporter as store_reporter
from topotrain_sdk.supervisor import worker_env as worker_env

WORKER_ARGV = (sys.executable, "-m", "topotrain_trainer")
# "0": every rank starts as a fresh interpreter instead of forked from the pod's forker
FORK_RANKS_ENV = "TOPOTRAIN_FORK_RANKS"


def supervise(env: TrainerEnv, control: Path, *, warm_spares: bool = False) -> int:
    """The pod's supervisor over `python -m topotrain_trainer` ranks (its exit status): ranks forked
    from one interpreter that imported the trainer (`topotrain_sdk.forker`) unless FORK_RANKS_ENV
    is "0"."""
    fork = os.environ.get(FORK_RANKS_ENV, "1") != "0"
    return _sdk.supervise(env, control, WORKER_ARGV, warm_spares=warm_spares, fork_ranks=fork)
