"""The chaos soak as a benchmark: faults of every class on concurrent jobs,
then the invariant checkers; prints a table per fault class, the invariants,
the fleet's goodput, the seed, the duration and the machine load.

    python bench/chaos.py --faults 60 --jobs 3 --replicas 2 --gap 2.5 --calm 8 \
        --steps 60-100 --seed 119                                  # the bounded form
    python bench/chaos.py --faults 1000 --jobs 20 --replicas 2 --kueue   # the long form

It starts a private testbed under --workdir (default .testbed/chaos-<seed>),
so restarting its API server disturbs no one. Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed.chaos.catalogue import CLASSIC, Kind  # noqa: E402
from testbed.chaos.report import table  # noqa: E402
from testbed.chaos.soak import SoakConfig, replay, run_soak, summary  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=60)
    parser.add_argument("--jobs", type=int, default=3, help="jobs running at once")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one, printed")
    parser.add_argument("--gap", type=float, default=3.0, help="mean seconds between faults")
    parser.add_argument("--calm", type=float, default=30.0, help="seconds between global faults")
    parser.add_argument("--replicas", type=int, default=1, choices=(1, 2), help="operator replicas")
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--steps", default="150-250", help="steps per job, a range LOW-HIGH")
    parser.add_argument("--kinds", default="", help="comma-separated fault classes (default: all; "
                        "'classic': the bounded soak's, those from before issue 37)")
    parser.add_argument("--drain", type=float, default=600.0,
                        help="seconds the jobs left when the faults end get to finish (invariant 4 "
                             "judges the unfinished ones)")
    parser.add_argument("--kueue", action="store_true",
                        help="run the real Kueue beside the operator: queued jobs, kueue-preempt, invariant 14 "
                             "(needs `testbed/build.sh kueue`)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--replay", type=Path, default=None, help="re-check a recorded history.jsonl")
    args = parser.parse_args(argv)
    if args.replay is not None:
        verdicts, rows = replay(args.replay)
        print(table(rows), "", *(v.line() for v in verdicts), sep="\n")
        return 0 if all(v.ok for v in verdicts) else 1
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 20)
    kinds = set(CLASSIC) if args.kinds == "classic" else {Kind(k) for k in args.kinds.split(",") if k} or None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"chaos-{seed}-", dir=ROOT / ".testbed"))
    config = SoakConfig(seed, args.faults, args.jobs, mean_gap=args.gap, replicas=args.replicas,
                        step_seconds=args.step_seconds, kinds=kinds, calm=args.calm, drain_seconds=args.drain,
                        kueue=args.kueue,
                        steps=tuple(int(x) for x in args.steps.split("-", 1)))  # fmt: skip
    # `timeout` or a CI runner stops it with SIGTERM: unwind through the rig's teardown, so no
    # API server, operator replica or trainer of the private testbed outlives the bench.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run_soak(config, workdir, log=lambda line: print(line, flush=True))
    print(summary(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
