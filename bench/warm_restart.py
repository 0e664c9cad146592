"""An in-place restart's ranks started three ways: new interpreters, warm spares, forked ranks.
Time from the operator's new attempt to the restarted ranks' first step, on one pod's supervisor
with the real trainer.

    python bench/warm_restart.py [--ranks 2] [--repeats 3]

One pod is a `python -m topotrain_trainer` supervisor with `--ranks` local ranks (tp=1,
pp=1, dp=ranks, the tiny model, gloo on CPU), checkpointing every 2 steps to the testbed's
S3 server (versitygw on loopback). Once it has committed step 2 (and, with warm spares, its
spares are up) the control file is rewritten as the kubelet does for the operator's next
attempt (attempt 1, resume from step 2): the supervisor stops the ranks and starts the
attempt again: in new interpreters (`TOPOTRAIN_FORK_RANKS=0`), in its spares
(`training.warmSpares`, `TOPOTRAIN_FORK_RANKS=0`), or forked from the pod's forker (the default,
`topotrain_sdk.forker`). Measured from the control file's rewrite: `restored` (the checkpoint
loaded) and `first step` (the new attempt's first step done), wall seconds, median over
repeats run in rotating order.

This is the restart every kept pod of an in-place restart does (a hang, a peer lost, a new
attempt for any other reason); a replaced pod starts cold either way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "operator"), str(REPO_ROOT / "trainer_image")]

from topotrain.contract import (  # noqa: E402
    ATTEMPT_ANNOTATION,
    CONTROL_DIR_ENV,
    RESUME_STEP_ANNOTATION,
    format_control,
)
from topotrain_trainer.supervisor import FORK_RANKS_ENV, SPARE_DELAY_ENV  # noqa: E402

from testbed.s3 import S3Server  # noqa: E402
from tests.trainer.harness import TrainerRun, trainer_env  # noqa: E402

INTERVAL = 2
MODES = ("new interpreters", "warm spares", "forked ranks")


def one(s3: S3Server, ranks: int, mode: str, workdir: Path) -> dict[str, float]:
    warm = mode == "warm spares"
    bucket = s3.create_bucket(f"warm-{uuid.uuid4().hex[:8]}")
    control = workdir / f"control-{uuid.uuid4().hex[:6]}"
    control.mkdir()
    training: dict[str, Any] = {
        "model": "tiny", "seq_len": 32, "global_batch": 8, "micro_batch": 1, "steps": 100_000,
        "progress_every": 1, "metrics_port": 0, "staging_dir": str(workdir), "warm_spares": warm,
    }  # fmt: skip
    env = trainer_env(data=ranks, training=training, s3_env=s3.env(),
                      checkpoint_uri=f"s3://{bucket}/warm", interval=INTERVAL, keep=100_000)  # fmt: skip
    env[CONTROL_DIR_ENV] = str(control)
    env[SPARE_DELAY_ENV] = "0"
    env[FORK_RANKS_ENV] = "1" if mode == "forked ranks" else "0"
    run = TrainerRun(env)
    try:
        run.wait_for("checkpoint_committed", step=INTERVAL)
        if warm:
            started = next((e for e in run.events if e.get("event") == "spares_started"), None)
            if started is None:
                run.wait_for("spares_started")
            time.sleep(10.0)  # the spares' imports done (they started at once; a pod gives them 30 s)
        staged = control / ".annotations.new"
        staged.write_text(format_control({ATTEMPT_ANNOTATION: "1", RESUME_STEP_ANNOTATION: str(INTERVAL)}))
        bumped = time.time()
        staged.replace(control / "annotations")
        begun = run.wait_for("workers_started")
        want = {"warm": ranks if warm else 0, "forked": ranks if mode == "forked ranks" else 0}
        if {k: int(begun.get(k, 0)) for k in want} != want:
            raise AssertionError(f"attempt 1 ({mode}) started {begun}")
        restored = run.wait_for("restored")
        first = run.wait_for("step", step=INTERVAL + 1)
        return {"restored": float(restored["time"]) - bumped, "first step": float(first["time"]) - bumped}
    finally:
        run.kill()  # the supervisor, its ranks and its spares


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="warm-restart-") as tmp:
        workdir = Path(tmp)
        s3 = S3Server(workdir / "s3").start()
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        try:
            for repeat in range(args.repeats):
                for mode in MODES[repeat % 3 :] + MODES[: repeat % 3]:
                    sample = one(s3, args.ranks, mode, workdir)
                    samples[mode].append(sample)
                    print(json.dumps({"repeat": repeat, "mode": mode, **{k: round(v, 2) for k, v in sample.items()}}),
                          flush=True)  # fmt: skip
        finally:
            s3.stop()
    print(f"\nin-place restart of one pod's {args.ranks} ranks, median of {args.repeats} "
          "(seconds from the new attempt)")  # fmt: skip
    print("| ranks started in | restored | first step |\n|---|---:|---:|")
    medians = {m: {k: statistics.median(s[k] for s in samples[m]) for k in ("restored", "first step")}
               for m in MODES}  # fmt: skip
    for mode in MODES:
        print(f"| {mode} | {medians[mode]['restored']:.2f} | {medians[mode]['first step']:.2f} |")
    cold = medians["new interpreters"]["first step"]
    for mode in MODES[1:]:
        print(f"first step: new interpreters / {mode} = {cold / medians[mode]['first step']:.2f}x")
    return 0 if all(cold > medians[m]["first step"] for m in MODES[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
