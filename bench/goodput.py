"""Goodput under failures: topotrain vs synchronous checkpoints vs full-gang restart.

    python bench/goodput.py            # 350 steps, a node failure every 100 steps
    python bench/goodput.py --quick    # 150 steps, one failure (CI)
    python bench/goodput.py --failure crash   # a trainer process killed instead

Three TrainingJobs run at the same time on the testbed (or the cluster
KUBECONFIG names), each with its own operator and KWOK node pool, so all
three share the machine's load: the real operator (installed by the Helm
chart, run locally with its ServiceAccount), the real trainer processes
(through the pod process harness) and the real S3 server.

- topotrain: asynchronous checkpoints, incremental recovery (the defaults): a
  failure that leaves the rest of the gang healthy (a crashed rank, a lost node
  that held one pod) restarts the kept pods in place;
- topotrain + warm spares: the same with `training.warmSpares` (each pod keeps an
  interpreter with torch imported for the next attempt);
- synchronous checkpoints: training blocks for the whole save (`syncCheckpoint`);
- full-gang restart: the operator's `recreate` recovery (the whole gang is
  deleted and planned from scratch).

Every `--fail-every` steps the node of one pod fails (KWOK NotReady; its
processes are killed at once), or with `--failure crash` its trainer rank is
SIGKILLed, mid-way between two checkpoints (steps 95,
195, ... with the defaults): the expected phase of a failure that strikes at
random. Goodput = useful step time (each step's last
execution, which is the one that counts) / wall time from job creation to the
trainer's last step, so checkpoint stalls, lost and recomputed steps and
restarts all count against it. Recovery = node failure -> training state
restored, split into detection, re-plan, pod start, process start and
checkpoint load (the last only when the trainer reports `load_seconds`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from goodput_run import FAILURES, MODES, Failure, Mode, ModeResult, Runner

from testbed.client import api_client
from testbed.harness_stack import S3Target, stack_in_new_namespace
from testbed.kube import Kube
from testbed.nodes import add_node, delete_node, wait_nodes_ready

PHASES = ("detection", "re-plan", "pod start", "process start", "checkpoint load")


def cluster(stack: ExitStack, prefix: str = "goodput") -> tuple[Path, S3Target]:
    """The cluster KUBECONFIG names (with the TOPOTRAIN_E2E_S3_* store) or the testbed, and a
    fresh bucket; `stack` undoes what was started."""
    bucket = f"{prefix}-{uuid.uuid4().hex[:8]}"
    if os.environ.get("KUBECONFIG"):
        target = S3Target(
            os.environ["TOPOTRAIN_E2E_S3_ENDPOINT"], os.environ["TOPOTRAIN_E2E_S3_ACCESS_KEY"],
            os.environ["TOPOTRAIN_E2E_S3_SECRET_KEY"], bucket,
        )  # fmt: skip
        target.client().create_bucket(Bucket=target.bucket)
        return Path(os.environ["KUBECONFIG"]), target
    from testbed.cluster import Testbed

    bed = stack.enter_context(Testbed().session())
    s3 = bed.s3
    return bed.kubeconfig, S3Target(
        s3.endpoint, s3.access_key, s3.secret_key, s3.create_bucket(bucket)
    )


def node_pool(kubeconfig: Path, key: str, stack: ExitStack, nodes: int = 3, gpus: int = 1) -> str:
    """`nodes` nodes of `gpus` GPUs in one rack, of a product of their own (returned), so that
    only this pool's job lands there; deleted when `stack` closes. Goodput: three 1-GPU nodes,
    two for the gang and one spare."""
    product = f"BENCH-{key.upper()}-{uuid.uuid4().hex[:4]}"
    names = []
    for i in range(nodes):
        name = f"{key}-{product[-4:].lower()}-{i}"
        add_node(
            kubeconfig,
            name,
            product=product,
            gpus=gpus,
            block=f"{name}-b",
            rack=f"{key}-{product}-r",
        )
        stack.callback(delete_node, kubeconfig, name)
        names.append(name)
    wait_nodes_ready(kubeconfig, names, timeout=120)
    return product


def run(steps: int, fail_every: int, interval: int, timeout: float, failure: str = "node",
        modes: tuple[Mode, ...] = MODES) -> list[ModeResult]:
    with ExitStack() as stack:
        kubeconfig, s3 = cluster(stack)
        api = stack.enter_context(api_client(kubeconfig))
        kube = Kube(kubeconfig, api, testbed=None)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="goodput-")))
        runners = []
        for mode in modes:
            product = node_pool(kubeconfig, f"goodput-{mode.key}", stack)
            job_stack = stack.enter_context(
                stack_in_new_namespace(
                    kube, s3, workdir, f"goodput-{mode.key}", recovery=mode.recovery
                )
            )
            runners.append(Runner(job_stack, mode, steps, fail_every, interval, product, failure))
        with ThreadPoolExecutor(len(runners)) as pool:
            return list(pool.map(lambda r: r.run(timeout), runners))


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _phase_means(failures: list[Failure]) -> dict[str, float]:
    timed = [f.phases() for f in failures if f.phases()]
    return {p: _mean([t[p] for t in timed]) for p in PHASES}


def report(results: list[ModeResult], interval: int) -> bool:
    base = results[0]
    print(f"\n{'mode':<36} {'goodput':>8} {'topotrain/x':>11} {'failures':>8} {'lost steps':>10} "
          f"{'lost s':>7} {'recovery s':>10} {'stall s/ckpt':>12} {'steps':>6} {'phase':>10}")  # fmt: skip
    for r in results:
        lost = [f.lost_steps for f in r.failures if f.done]
        print(f"{r.mode.label:<36} {r.goodput:>8.3f} {base.goodput / r.goodput if r.goodput else float('nan'):>11.2f} "
              f"{len(r.failures):>8} {_mean([float(x) for x in lost]):>10.1f} "
              f"{_mean([f.lost_seconds for f in r.failures]):>7.1f} {_mean([f.recovery for f in r.failures if f.done]):>10.1f} "
              f"{_mean(r.stalls):>12.3f} {r.steps:>6} {r.phase:>10}")  # fmt: skip
    print(
        f"\nrestart time by phase (seconds, mean over failures)\n{'mode':<36} "
        + " ".join(f"{p:>15}" for p in PHASES)
    )
    for r in results:
        means = _phase_means(r.failures)
        slowest = max(means, key=lambda p: means[p] if means[p] == means[p] else -1.0)
        print(
            f"{r.mode.label:<36} "
            + " ".join(f"{means[p]:>14.2f}{'*' if p == slowest else ' '}" for p in PHASES)
        )
    print("(* the slowest phase; checkpoint load is 0 when the trainer does not report load_seconds,"
          " and is then part of process start)")  # fmt: skip
    print("\nper failure: step struck -> resumed from, recovery s, warm ranks/ranks started")
    for r in results:
        each = ", ".join(f"{f.step}->{f.resumed_step} {f.recovery:.1f}s {f.warm or '-'}" for f in r.failures)
        print(f"{r.mode.label:<36} {each}")
    lost_ok = all(f.lost_steps <= interval for f in base.failures if f.done)
    beats = all(base.goodput > r.goodput for r in results if r.mode.baseline)
    print(
        f"\ntopotrain goodput higher than every baseline: {'yes' if beats else 'NO'}; "
        f"lost work per failure <= one checkpoint interval ({interval} steps): {'yes' if lost_ok else 'NO'}"
    )
    return beats and lost_ok and all(r.phase == "Succeeded" for r in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="150 steps, one failure (for CI)")
    parser.add_argument("--steps", type=int, default=350)
    parser.add_argument(
        "--fail-every", type=int, default=100, help="steps between injected node failures"
    )
    parser.add_argument("--interval", type=int, default=10, help="checkpoint interval (steps)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    parser.add_argument("--failure", choices=FAILURES, default="node",
                        help="node: a node goes NotReady; crash: one pod's trainer rank is killed")
    parser.add_argument("--modes", default=",".join(m.key for m in MODES),
                        help="comma-separated, the first is the one compared (default: all)")
    args = parser.parse_args(argv)
    steps = 150 if args.quick else args.steps
    by_key = {m.key: m for m in MODES}
    unknown = [k for k in args.modes.split(",") if k not in by_key]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(by_key)})")
    modes = tuple(by_key[k] for k in args.modes.split(","))
    print(f"goodput: {steps} steps, a {args.failure} failure every {args.fail_every} steps, "
          f"a checkpoint every {args.interval} steps; modes run concurrently", flush=True)  # fmt: skip
    results = run(steps, args.fail_every, args.interval, args.timeout, args.failure, modes)
    return 0 if report(results, args.interval) else 1


if __name__ == "__main__":
    sys.exit(main())
