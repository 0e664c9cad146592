"""`topotrain-launch -- <command ...>`: any trainer's pod supervisor.

The pod's command becomes `topotrain-launch -- python train.py ...` (or `python -m
topotrain_sdk.launch -- ...`). It starts NPROC_PER_NODE workers running the command, each with
the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, GROUP_RANK) besides the operator's contract, and supervises them
(`supervisor.py`): when the operator moves the pod to a new attempt (the control file's
`topotrain.io/attempt`), it stops the workers and starts them again for that attempt, keeping
the pod; a worker's own failure is reported to the checkpoint store (`failure.json`) and the
pod stays up for the operator's in-place restart; SIGTERM is forwarded to the workers (they
save and commit, `topotrain_sdk.stop_requested()`), and the launcher exits with their code.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from topotrain_sdk.contract import (
    EXIT_BAD_CONFIG,
    ContractError,
    TrainerEnv,
    control_path,
    read_control,
    with_control,
)
from topotrain_sdk.forker import python_command
from topotrain_sdk.supervisor import supervise

USAGE = """usage: topotrain-launch [--no-keep-pod] [--fork[=mod,...]] -- <command> [args ...]

Runs <command> as this pod's NPROC_PER_NODE workers with torchrun's environment and restarts
them in place when the operator starts a new attempt. --no-keep-pod: a worker's own failure
fails the pod instead of being reported for an in-place restart. --fork (for `python
script.py ...` or `python -m module ...`): the workers are forked from one interpreter that has
imported torch (or the modules named) once, instead of each starting a new interpreter."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options = args[: args.index("--")] if "--" in args else []
    command = args[args.index("--") + 1 :] if "--" in args else [a for a in args if a != "--no-keep-pod"]
    if not command or command[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not command else sys.stdout)
        return EXIT_BAD_CONFIG if not command else 0
    keep_pod = "--no-keep-pod" not in options
    fork = next((o for o in options if o == "--fork" or o.startswith("--fork=")), None)
    worker_argv = command
    if fork is not None:
        script = python_command(command)
        if script is None:
            print(json.dumps({"event": "bad_config", "source": "launcher", "error": "--fork needs a "
                              f"`python script.py ...` or `python -m module ...` command, not {command[:2]}"}),
                  flush=True)  # fmt: skip
            return EXIT_BAD_CONFIG
        preload = ["--preload", fork.partition("=")[2]] if "=" in fork else []
        worker_argv = [command[0], "-m", "topotrain_sdk.forker", *preload, *script]
    try:
        env = TrainerEnv.from_env()
        with_control(env, read_control(control_path()))  # a malformed attempt is not worth a start
    except ContractError as err:
        print(json.dumps({"event": "bad_config", "error": str(err), "source": "launcher"}), flush=True)
        return EXIT_BAD_CONFIG
    return supervise(env, control_path(), worker_argv, keep_pod_on_failure=keep_pod, fork_ranks=fork is not None)


if __name__ == "__main__":
    sys.exit(main())
