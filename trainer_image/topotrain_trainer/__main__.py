"""`python -m topotrain_trainer`: train as the contract environment says.

In a pod, the command is just `python -m topotrain_trainer`: outside torchrun
(no LOCAL_RANK) it validates the configuration, then becomes the pod's
supervisor (`supervisor.py`), which starts NPROC_PER_NODE local ranks that
rejoin here and restarts them in place when the operator bumps the attempt.
Under torchrun (or the supervisor) it trains. `python -m topotrain_trainer prepare ...` writes a
dataset.

Exit codes: 0 when `steps` are done; 78 (EX_CONFIG) for a configuration or
contract error, which retrying cannot fix; a rank exits 76 (EXIT_PEER_LOST)
when a collective lost a peer (its own pod is healthy), or when the rendezvous it
reached serves a newer attempt (it lags behind a restart); anything else is a
failure worth a restart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from topotrain.contract import ContractError, TrainerEnv, control_path, read_control, with_control

# die_with_parent: torchrun starts each rank in its own session; should the launcher be killed
# outright (SIGKILL), its ranks must not linger holding ports and CPUs
from topotrain_sdk.forker import FORK_ENV, FORKER_COMM, die_with_parent, serve

# first of the trainer's imports: a warm spare takes its process name before torch loads
from topotrain_trainer._procname import SPARE_ENV, set_process_name
from topotrain_trainer.config import EXIT_BAD_CONFIG, EXIT_PEER_LOST, ConfigError, TrainingConfig
from topotrain_trainer.data import check_vocab
from topotrain_trainer.supervisor import await_activation


def load() -> tuple[TrainerEnv, TrainingConfig]:
    env = TrainerEnv.from_env()
    if "LOCAL_RANK" not in os.environ:  # the supervisor: validate the attempt it will start
        with_control(env, read_control(control_path()))
    config = TrainingConfig.from_json(env.training_config)
    config.check_mesh(env.tensor, env.pipeline, env.data)
    vocabs = {check_vocab(uri, config.model) for uri in config.datasets()} - {None}
    if len(vocabs) > 1:
        raise ConfigError(f"training.dataset={config.dataset!r}: the datasets' vocab_size differ "
                          f"({sorted(v for v in vocabs if v is not None)}): tokenize them with one tokenizer")  # fmt: skip
    vocab = max((v for v in vocabs if v is not None), default=None)
    if config.init_weights:  # the weights' shape and vocabulary, before any rank starts
        from topotrain_trainer.weights import job_model

        job_model(config, vocab or 0)
    return env, config


def warm_spare() -> int:
    """A supervisor's warm spare: import what a rank imports, wait to be told which rank of
    which attempt to be (`supervisor.await_activation`), then train as that rank."""
    die_with_parent()
    import topotrain_trainer.train  # noqa: F401  torch, the model, the checkpointing: the slow part

    env = await_activation()
    if env is None:
        return 0  # let go: the supervisor exits or no longer needs it
    set_process_name("python")
    os.environ.clear()
    os.environ.update(env)
    os.environ.pop(SPARE_ENV, None)
    return main([])


def fork_ranks() -> int:
    """The pod's forker (`topotrain_sdk.forker`): import what a rank imports once, then fork
    each rank the supervisor asks for; each child goes on here as that rank."""
    die_with_parent()
    set_process_name(FORKER_COMM)
    import topotrain_trainer.train  # noqa: F401  torch, the model, the checkpointing: the slow part

    if serve() is None:
        return 0  # let go: the supervisor exits
    set_process_name("python")  # a rank now (serve() made it die with the forker)
    return main([])


def torchrun_argv(env: TrainerEnv) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={env.nnodes}", f"--node-rank={env.node_rank}",
        f"--nproc-per-node={env.nproc_per_node}",
        f"--master-addr={env.master_addr}", f"--master-port={env.master_port}",
        "--max-restarts=0",  # the operator restarts the whole gang from a checkpoint
        "-m", "topotrain_trainer",
    ]  # fmt: skip


# gloo's messages when the other end of a connection went away (its process died or hung), and
# NCCL's when a remote rank failed, a collective timed out or the watchdog aborted the communicator
PEER_LOSS_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
    "Timed out", "timed out", "gloo/transport",
    "remote process exited", "ncclRemoteError", "NCCL communicator was aborted",
    "operations have failed or timed out",
)


def peer_lost(err: BaseException) -> bool:
    """A collective failed because a rank elsewhere went away, not from this rank's own fault.

    The whole cause chain is read: torch's pipeline stages wrap the transport's error in their
    own ("[Stage 0] failed to run forward", raised `from` the gloo error).
    """
    import torch.distributed as dist

    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, (dist.DistNetworkError, dist.DistStoreError)):
            return True
        if isinstance(cause, RuntimeError) and any(m in str(cause) for m in PEER_LOSS_MARKERS):
            return True  # DistBackendError (NCCL) is a RuntimeError too
        cause = cause.__cause__ or cause.__context__
    return False


def train_rank(env: TrainerEnv, config: TrainingConfig) -> int:
    from topotrain_trainer.parallel import StaleAttempt
    from topotrain_trainer.train import train

    try:
        train(env, config)
    except StaleAttempt as err:  # a rank of an older attempt: nothing is wrong with its pod
        print(json.dumps({"event": "stale_attempt", "error": str(err)}), flush=True)
        return EXIT_PEER_LOST
    except Exception as err:
        if not peer_lost(err):
            raise
        print(json.dumps({"event": "peer_lost", "rank": os.environ.get("RANK", ""),
                          "error": str(err)[:500]}), flush=True)  # fmt: skip
        # Background threads (prefetch, checkpoint uploads) may block on the dead peer: no cleanup.
        os._exit(EXIT_PEER_LOST)
    return 0


def prepare_parser() -> argparse.ArgumentParser:
    from topotrain_trainer.data import DEFAULT_SHARD_TOKENS

    parser = argparse.ArgumentParser(
        prog="python -m topotrain_trainer prepare",
        description="Tokenize text files (.jsonl: one document per line's \"text\"; any other file: "
        "one document) into uint32 token shards + index.json for training.dataset, in a directory "
        "or under s3://bucket/prefix (credentials and endpoint from AWS_*).")  # fmt: skip
    parser.add_argument("--out", required=True, help="dataset directory or s3://bucket/prefix")
    parser.add_argument("texts", nargs="*", type=Path, help="text files to tokenize")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json to use (default: train a BPE)")
    parser.add_argument("--vocab-size", type=int, default=32000, help="the BPE's size when one is trained")
    parser.add_argument("--eod-token", help="the given tokenizer's end-of-document token")
    parser.add_argument("--bytes", action="store_true", help="byte tokens (vocab 256), no tokenizer")
    parser.add_argument("--synthetic-tokens", type=int, default=0,
                        help="generate this many synthetic byte tokens instead")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    return parser


def prepare(argv: list[str]) -> int:
    from topotrain_trainer.data import byte_tokens, synthetic_tokens, write_dataset
    from topotrain_trainer.shards import open_store

    parser = prepare_parser()
    args = parser.parse_args(argv)
    if bool(args.texts) == bool(args.synthetic_tokens):
        parser.error("give text files or --synthetic-tokens, not both or neither")
    store = open_store(args.out)
    if args.synthetic_tokens or args.bytes:
        chunks = byte_tokens(args.texts) if args.texts else synthetic_tokens(args.synthetic_tokens, args.seed)
        write_dataset(store, chunks, args.shard_tokens, vocab=256, dtype="uint16")
        print(json.dumps({"event": "prepared", "dataset": store.uri, "vocab_size": 256}))
        return 0
    from tokenizers import Tokenizer

    from topotrain_trainer.tokens import documents, prepare_dataset

    tokenizer = Tokenizer.from_file(str(args.tokenizer)) if args.tokenizer else None
    summary = prepare_dataset(store, lambda: documents(args.texts), tokenizer=tokenizer,
                              vocab_size=args.vocab_size, eod_token=args.eod_token,
                              shard_tokens=args.shard_tokens)  # fmt: skip
    print(json.dumps({"event": "prepared", **summary}))
    return 0


def export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m topotrain_trainer export",
        description="Write a committed checkpoint's model as Hugging Face safetensors (one "
        "process, no GPU needed); S3 credentials and endpoint from AWS_*.")  # fmt: skip
    parser.add_argument("--checkpoint", required=True,
                        help="the job's checkpoint prefix: <checkpoint.uri>/<namespace>/<name>")  # fmt: skip
    parser.add_argument("--step", type=int, help="the committed step (default: the newest)")
    parser.add_argument("--model", required=True, help="training.model of the job")
    parser.add_argument("--out", required=True, help="directory or s3://bucket/prefix")
    args = parser.parse_args(argv)
    from topotrain_trainer.weights import export_checkpoint

    summary = export_checkpoint(args.checkpoint, args.step, args.model, args.out)
    print(json.dumps({"event": "weights_exported", **summary}))
    return 0


USAGE = """usage: python -m topotrain_trainer [prepare ... | export ...]

Without arguments: train, configured by the operator's pod environment (TOPOTRAIN_*,
MASTER_ADDR, ...) and TOPOTRAIN_TRAINING_CONFIG (JSON); exit 78 on a bad configuration.
prepare: write a token dataset (`python -m topotrain_trainer prepare --help`).
export: a committed checkpoint as Hugging Face safetensors (`... export --help`)."""


def main(argv: list[str]) -> int:
    if argv[:1] == ["prepare"]:
        return prepare(argv[1:])
    if argv[:1] == ["export"]:
        return export(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv:
        print(f"unknown arguments {' '.join(argv)!r}\n{USAGE}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if os.environ.get(SPARE_ENV) == "1":
        return warm_spare()
    if os.environ.get(FORK_ENV):
        return fork_ranks()
    try:
        env, config = load()
    except (ContractError, ConfigError) as err:
        print(json.dumps({"event": "bad_config", "error": str(err)}), flush=True)
        return EXIT_BAD_CONFIG
    if "LOCAL_RANK" not in os.environ:
        from topotrain_trainer.supervisor import supervise

        return supervise(env, control_path(), warm_spares=config.warm_spares)
    die_with_parent()
    return train_rank(env, config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
