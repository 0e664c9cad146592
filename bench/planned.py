"""Lost steps per planned change, with and without checkpoint-on-demand.

    python bench/planned.py                 # scale down, scale up, drain; each mode
    python bench/planned.py --interval 40   # a longer checkpoint interval

One TrainingJob per mode (tp=1, pp=1, dp=2 on 1-GPU pods, the tiny model, minData 1)
runs with the real operator (Helm chart, ServiceAccount), the real trainer processes
(pod process harness) and the real S3 server, on a KWOK pool of its own (four 1-GPU
nodes: room for the gang to move). Three planned changes strike it in turn, each
mid-way between two periodic checkpoints (the expected phase of a change that comes
at a random moment):

- scale down: `kubectl scale --replicas=1` (data 2 -> 1);
- scale up: `kubectl scale --replicas=2` (data 1 -> 2);
- drain: `kubectl drain` of the gang's nodes with a PodDisruptionBudget of
  `minAvailable: <pods>`, so the operator moves the gang off the cordoned nodes.

Modes: `on demand` is the default operator (it asks the running gang for a
checkpoint of its current step and waits for its COMMITTED before changing it);
`last commit` is the same operator with `operator.checkpointRequestTimeoutSeconds: 0`
(no request: the change resumes from the newest periodic checkpoint, as before
checkpoint-on-demand existed).

Per change: the step the old gang had logged when the change was asked for (read
just before the `kubectl` call, so a lower bound), the step the next attempt
restored, **lost steps** = asked - restored when positive (training done before
the request that has to be done again), redone steps = the old gang's last logged
step - restored (also counts the steps it trained while saving; the harness may
miss a deleted pod's last log lines, so this is a lower bound), and seconds from
the request to the new attempt's first step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from goodput import cluster, node_pool

from testbed.client import api_client
from testbed.harness_stack import Stack, stack_in_new_namespace
from testbed.kube import Kube
from testbed.procs import wait_until
from tests.e2e.jobs import attempts, last_step, of_kind

JOB = "planned"
CHANGES = ("scale down", "scale up", "drain")
MODES: dict[str, dict[str, object]] = {
    "on demand": {},
    "last commit": {"checkpointRequestTimeoutSeconds": 0},
}
TIMEOUT = 900.0


def job_spec(product: str, interval: int) -> dict[str, Any]:
    return {
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2, "minData": 1},
        "worker": {"gpusPerPod": 1, "gpuTypes": [product]},
        "checkpoint": {"intervalSteps": interval, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 0},
        "training": {"model": "tiny", "steps": 1_000_000, "globalBatch": 8, "microBatch": 2,
                     "progressEvery": 1, "metricsPort": 0},
    }  # fmt: skip


@dataclass
class Change:
    kind: str
    mode: str
    asked: int  # the old gang's last logged step when the change was asked for
    restored: int  # the step the next attempt resumed from (0: from scratch)
    last_old: int  # the old gang's last logged step
    seconds: float  # request -> the next attempt's first step
    served: bool  # the operator's checkpoint request was committed and used

    @property
    def lost(self) -> int:
        return max(0, self.asked - self.restored)

    @property
    def redone(self) -> int:
        return max(0, self.last_old - self.restored)


class PlannedBench:
    def __init__(self, stack: Stack, mode: str, interval: int) -> None:
        self.stack, self.mode, self.interval = stack, mode, interval

    def _attempt(self) -> int:
        return int((self.stack.job(JOB).get("status") or {}).get("attempt", 0))

    def _mid_interval(self, attempt: int) -> int:
        """Wait until `attempt` trained to the middle of a checkpoint interval past a commit."""
        half = self.interval // 2
        now = last_step(attempts(self.stack, JOB).get(attempt, []))
        target = max(now // self.interval * self.interval + half, self.interval + half)
        if target <= now:
            target += self.interval
        wait_until(lambda: last_step(attempts(self.stack, JOB).get(attempt, [])) >= target,
                   timeout=TIMEOUT, what=f"attempt {attempt} at step {target}")  # fmt: skip
        return last_step(attempts(self.stack, JOB)[attempt])

    def change(self, kind: str, act: Callable[[], None], done: Callable[[dict[str, Any]], bool]) -> Change:
        attempt = self._attempt()
        asked = self._mid_interval(attempt)
        started = time.monotonic()
        act()
        job = self.stack.wait_job(
            JOB, lambda j: int((j.get("status") or {}).get("attempt", 0)) > attempt and done(j),
            timeout=TIMEOUT, what=f"{kind}: the next attempt",
        )  # fmt: skip
        new = int(job["status"]["attempt"])
        wait_until(lambda: bool(of_kind(attempts(self.stack, JOB).get(new, []), "step")),
                   timeout=TIMEOUT, what=f"{kind}: attempt {new}'s first step")  # fmt: skip
        seconds = time.monotonic() - started
        logs = attempts(self.stack, JOB)
        restored = of_kind(logs[new], "restored")
        request = self.stack.job(JOB)["status"].get("checkpointRequest") or {}
        result = Change(
            kind, self.mode, asked, int(restored[0]["step"]) if restored else 0,
            last_step(logs[attempt]), seconds,
            request.get("attempt") == attempt and request.get("state") == "Committed",
        )  # fmt: skip
        print(f"  {self.mode:11s} {kind:10s} asked at {result.asked}, restored {result.restored}, "
              f"old gang's last step {result.last_old}: lost {result.lost}, redone {result.redone}, "
              f"{seconds:.1f}s to the first step", flush=True)  # fmt: skip
        return result

    def scale(self, data: int) -> Change:
        def act() -> None:
            self.stack.kubectl("-n", self.stack.namespace, "scale", f"trainingjobs.topotrain.io/{JOB}",
                               f"--replicas={data}")  # fmt: skip

        def done(job: dict[str, Any]) -> bool:
            return bool((job["status"].get("parallelism") or {}).get("data") == data)

        return self.change("scale down" if data == 1 else "scale up", act, done)

    def drain(self) -> Change:
        stack = self.stack
        nodes = sorted({p["spec"]["nodeName"] for p in stack.pods(JOB) if p["spec"].get("nodeName")})
        stack.disruption_budget(JOB, len(stack.pods(JOB)))
        drained: list[int] = []

        def drain() -> None:
            done = stack.kubectl("drain", *nodes, "--pod-selector", f"topotrain.io/job={JOB}",
                                 "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=600s",
                                 check=False)  # fmt: skip
            drained.append(done.returncode)

        worker = threading.Thread(target=drain, daemon=True)
        try:
            result = self.change("drain", worker.start, lambda _: True)
            worker.join(timeout=TIMEOUT)
            if drained != [0]:
                raise RuntimeError(f"kubectl drain of {nodes} did not finish: {drained}")
            return result
        finally:
            stack.kubectl("uncordon", *nodes, check=False)


def run(interval: int, modes: list[str]) -> list[Change]:
    changes: list[Change] = []
    with ExitStack() as stack:
        kubeconfig, s3 = cluster(stack, prefix="planned")
        api = stack.enter_context(api_client(kubeconfig))
        kube = Kube(kubeconfig, api, testbed=None)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="planned-")))
        for mode in modes:
            with ExitStack() as per_mode:
                product = node_pool(kubeconfig, "planned", per_mode, nodes=4, gpus=1)
                key = mode.replace(" ", "-")
                job_stack = per_mode.enter_context(
                    stack_in_new_namespace(kube, s3, workdir, f"planned-{key}", **MODES[mode])
                )
                job_stack.apply_job(JOB, job_spec(product, interval))
                bench = PlannedBench(job_stack, mode, interval)
                changes += [bench.scale(1), bench.scale(2), bench.drain()]
    return changes


def report(changes: list[Change], interval: int) -> bool:
    print()
    print(f"checkpoint every {interval} steps; each change asked for mid-interval")
    print()
    print("| change | mode | step when asked | resumed from | lost steps | redone steps "
          "| request -> first step s | checkpoint request served |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for c in changes:
        print(f"| {c.kind} | {c.mode} | {c.asked} | {c.restored} | {c.lost} | {c.redone} "
              f"| {c.seconds:.1f} | {'yes' if c.served else 'no'} |")  # fmt: skip
    on_demand = [c for c in changes if c.mode == "on demand"]
    zero = all(c.lost == 0 and c.served for c in on_demand)
    print()
    for mode in dict.fromkeys(c.mode for c in changes):
        mine = [c for c in changes if c.mode == mode]
        print(f"{mode}: {sum(c.lost for c in mine)} steps lost, {sum(c.redone for c in mine)} redone "
              f"over {len(mine)} changes")  # fmt: skip
    if on_demand:
        print(f"checkpoint-on-demand loses no step on any change: {'yes' if zero else 'NO'}")
    return zero


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=int, default=20, help="checkpoint interval (steps)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of: {', '.join(MODES)}")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}")
    if args.interval < 4:
        parser.error("--interval: at least 4 steps, so a change can land mid-interval")
    return 0 if report(run(args.interval, modes), args.interval) else 1


if __name__ == "__main__":
    sys.exit(main())
