"""Isolation between namespaces: recovery in namespace B while namespace A's store is a tarpit.

Issue 37: sixteen jobs whose `spec.checkpoint.endpoint` trickled bytes once held every
thread the operator made its calls in, and failure recovery stopped for every job in the
cluster. The operator now reads checkpoint stores in a pool of their own, at most two reads
per namespace at once, each within a 30 s deadline (controller/storecalls.py). This
benchmark measures the effect on the testbed (real API server, scheduler and controller
manager; KWOK GPU nodes; the real S3 server, versitygw), with ONE operator process watching
both namespaces:

- namespace B: `--jobs` TrainingJobs of bench/recovery.py's 64-node shape (TP=8 PP=2
  DP=4, 8 pods of 8 GPUs) with their checkpoints in the real S3 server. Before each
  injected failure a new commit is written to the job's store; a recovery counts as
  having read the store when the job resumed from that very step (status.recovery);
- namespace A: `--tarpit-jobs` one-pod jobs on a 1-GPU KWOK pool of their own. In the
  "tarpit" phase their endpoint is a `testbed.tarpit.Tarpit` (every request: a 200 that
  trickles one byte every 0.5 s); in the "no tarpit" phase, the baseline, the same jobs
  point at the real S3 server (they run). Only the endpoint differs between the phases.

In each phase a random pod of a random job of B is failed (KWOK: exit code 1) and the time
until the next attempt's whole gang is Running is measured from outside the operator,
polling the API server every 50 ms (bench/recovery.py's functions). The phases alternate
in ABBA order over `--rounds` (no tarpit, tarpit, tarpit, no tarpit, ...), each phase
kind taking the same victims from its own `random.Random(seed)`, to cancel drift. As
evidence that A's reads really reach the tarpit: the tarpit's request count and most
requests at once, and A's CheckpointStoreReachable conditions.

    python bench/isolation.py [--failures 16] [--rounds 2] [--jobs 2] [--tarpit-jobs 16] [--seed 1]

Uses $KUBECONFIG when set (a testbed already up; TOPOTRAIN_E2E_S3_ENDPOINT, _ACCESS_KEY and
_SECRET_KEY then name the S3 store, which the operator must reach), otherwise starts its
own testbed. Pods run no processes (KWOK): this measures the control plane path. A
benchmark, not a test: it prints whether the goal (tarpit p50 and p95 within 20% of the
baseline's) was met and exits nonzero only on errors.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "operator"), str(REPO / "sdk")]

import recovery  # noqa: E402
from kubernetes import client  # noqa: E402
from topotrain.checkpoints import CheckpointStore, job_prefix  # noqa: E402

from testbed.client import api_client  # noqa: E402
from testbed.harness_stack import S3Target  # noqa: E402
from testbed.nodes import apply_topology, delete_topology, wait_nodes_ready  # noqa: E402
from testbed.tarpit import Tarpit  # noqa: E402

NODES = 64  # bench/recovery.py's smaller shape
GANG = 2 * recovery.SHAPES[NODES][3]  # pods of one job of B
POOL_A = "isolation-a"
SECRET = "s3creds"
STORE_REACHABLE = "CheckpointStoreReachable"
PHASES = ("no tarpit", "tarpit")
GROUP = ("topotrain.io", "v1alpha1")


@dataclass
class Bench:
    kubeconfig: str
    api: Any
    s3: S3Target
    ns_a: str
    ns_b: str
    tarpit_jobs: int
    b_jobs: list[str] = field(default_factory=list)
    step: int = 100  # the next commit written to a store of B


@dataclass
class PhaseRun:
    phase: str
    round: int
    times: list[float]
    resumed: int  # recoveries that resumed from the commit written just before the failure
    evidence: str


def store_target(bed: Any) -> S3Target:
    """A fresh bucket in the testbed's S3 server (`bed`), or in the TOPOTRAIN_E2E_S3_* store."""
    bucket = f"isolation-{uuid.uuid4().hex[:8]}"
    if bed is not None:
        server = bed.s3
        target = S3Target(server.endpoint, server.access_key, server.secret_key, bucket)
    else:
        names = ("TOPOTRAIN_E2E_S3_ENDPOINT", "TOPOTRAIN_E2E_S3_ACCESS_KEY", "TOPOTRAIN_E2E_S3_SECRET_KEY")
        missing = [n for n in names if not os.environ.get(n)]
        if missing:
            raise SystemExit(f"with KUBECONFIG set, {', '.join(missing)} must name the S3 store")
        target = S3Target(*(os.environ[n] for n in names), bucket)
    target.client().create_bucket(Bucket=bucket)
    return target


def b_manifest(bench: Bench, name: str) -> dict[str, Any]:
    body = recovery.job_manifest(name, bench.ns_b, NODES)
    body["spec"]["checkpoint"] = {"uri": f"s3://{bench.s3.bucket}/b", "endpoint": bench.s3.endpoint,
                                  "credentialsSecret": SECRET}
    return body


def a_manifest(bench: Bench, name: str, endpoint: str) -> dict[str, Any]:
    return {
        "apiVersion": "/".join(GROUP), "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": bench.ns_a},
        "spec": {
            "image": "topotrain/trainer:bench", "parallelism": {"tensor": 1, "pipeline": 1, "data": 1},
            "worker": {"gpusPerPod": 1, "nodeSelector": {recovery.TOPOLOGY_LABEL: POOL_A}},
            "checkpoint": {"uri": f"s3://{bench.s3.bucket}/a", "endpoint": endpoint,
                           "credentialsSecret": SECRET},
            "failurePolicy": {"backoffSeconds": 0, "progressTimeoutSeconds": 0, "restartInPlace": False},
        },
    }


def job_status(bench: Bench, namespace: str, name: str) -> dict[str, Any]:
    body: Any = client.CustomObjectsApi(bench.api).get_namespaced_custom_object(
        *GROUP, namespace, "trainingjobs", name)
    return dict(body.get("status") or {})


def jobs_in(bench: Bench, namespace: str) -> list[dict[str, Any]]:
    listed: Any = client.CustomObjectsApi(bench.api).list_namespaced_custom_object(
        *GROUP, namespace, "trainingjobs")
    return list(listed["items"])


def store_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c.get("type") == STORE_REACHABLE), {})


def wait_for(what: str, ready: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s")
        time.sleep(0.5)


@contextmanager
def namespace_a(bench: Bench, phase: str, round_: int) -> Iterator[Tarpit | None]:
    """A's jobs for one phase, on the tarpit or on the real store, set up until they show it;
    deleted (and the tarpit stopped: its stuck reads end) afterwards."""
    tarpit = Tarpit().start() if phase == "tarpit" else None
    endpoint = tarpit.url if tarpit is not None else bench.s3.endpoint
    names = [f"a{round_}-{'t' if tarpit else 's'}-{i:02d}" for i in range(bench.tarpit_jobs)]
    custom = client.CustomObjectsApi(bench.api)
    try:
        for name in names:
            custom.create_namespaced_custom_object(*GROUP, bench.ns_a, "trainingjobs",
                                                   a_manifest(bench, name, endpoint))
        if tarpit is None:
            core = client.CoreV1Api(bench.api)
            for name in names:
                recovery.wait_running(core, bench.ns_a, name, 0, 1, 300)
        else:
            wait_for("A's jobs report their store unreachable", lambda: all(
                store_condition(dict(j.get("status") or {})).get("status") == "False"
                for j in jobs_in(bench, bench.ns_a)))
        yield tarpit
    finally:
        clear_jobs(bench, bench.ns_a)
        if tarpit is not None:
            tarpit.stop()


def clear_jobs(bench: Bench, namespace: str) -> None:
    """Delete every TrainingJob of `namespace` (while the operator runs: it removes their
    finalizers); wait until they and their pods are gone."""
    custom, core = client.CustomObjectsApi(bench.api), client.CoreV1Api(bench.api)
    custom.delete_collection_namespaced_custom_object(*GROUP, namespace, "trainingjobs")
    wait_for(f"the TrainingJobs of {namespace} deleted", lambda: not (
        jobs_in(bench, namespace) or core.list_namespaced_pod(namespace, label_selector="topotrain.io/job").items),
        180)


def a_evidence(bench: Bench, tarpit: Tarpit | None) -> str:
    """What A's jobs and the tarpit show at the end of a phase."""
    items = jobs_in(bench, bench.ns_a)
    conditions = [store_condition(dict(j.get("status") or {})) for j in items]
    if tarpit is None:
        running = sum(1 for j in items if (j.get("status") or {}).get("phase") == "Running")
        answered = sum(1 for c in conditions if c.get("status") == "True")
        return f"A: {running}/{len(items)} jobs Running, {answered} with {STORE_REACHABLE}=True"
    down = [c.get("message", "") for c in conditions if c.get("status") == "False"]
    stuck = sum(1 for m in down if "did not answer within" in m)
    queued = sum(1 for m in down if "could start within" in m)
    return (f"A: {len(down)}/{len(items)} jobs {STORE_REACHABLE}=False (last read: {stuck} past "
            f"the deadline, {queued} found no free slot of the namespace); tarpit: "
            f"{tarpit.requests} requests, at most {tarpit.most_trickling} at once, "
            f"{tarpit.trickling} still trickling")


def commit_next(bench: Bench, job: str) -> int:
    """Write the next committed step to `job`'s store (as its trainer would); returns it."""
    bench.step += 1
    prefix = job_prefix(f"s3://{bench.s3.bucket}/b", bench.ns_b, job)
    mesh = {"tensor": 8, "pipeline": 2, "data": recovery.SHAPES[NODES][3]}
    CheckpointStore(prefix, client=bench.s3.client()).write_commit(bench.step, mesh, 1)
    return bench.step


def measure(bench: Bench, phase: str, round_: int, failures: int, rng: random.Random) -> PhaseRun:
    with namespace_a(bench, phase, round_) as tarpit:
        times, resumed = [], 0
        for number in range(1, failures + 1):
            job = rng.choice(bench.b_jobs)
            step = commit_next(bench, job)
            times.append(recovery.fail_and_recover(bench.kubeconfig, bench.api, bench.ns_b, job, GANG, rng))
            recovered = job_status(bench, bench.ns_b, job).get("recovery") or {}
            resumed += recovered.get("resumeStep") == step
            print(f"  round {round_} {phase:9s} failure {number:2d} ({job}): {times[-1]:6.2f}s, "
                  f"resumed from step {recovered.get('resumeStep')} (committed {step})", flush=True)
        evidence = a_evidence(bench, tarpit)
        print(f"  round {round_} {phase}: {evidence}", flush=True)
    return PhaseRun(phase, round_, times, resumed, evidence)


def schedule(failures: int, rounds: int) -> list[tuple[int, str, int]]:
    """(round, phase, failures) in ABBA order; each phase kind gets `failures` in all."""
    plan = []
    for r in range(rounds):
        count = failures // rounds + (1 if r < failures % rounds else 0)
        for phase in PHASES if r % 2 == 0 else PHASES[::-1]:
            plan.append((r, phase, count))
    return plan


def run(kubeconfig: str, s3: S3Target, failures: int, rounds: int, jobs: int, tarpit_jobs: int,
        seed: int) -> list[PhaseRun]:
    recovery.install_crd(kubeconfig)
    print(f"creating {NODES} 8-GPU and {tarpit_jobs} 1-GPU KWOK nodes ...", flush=True)
    names = apply_topology(kubeconfig, recovery.topology(NODES))
    names += apply_topology(kubeconfig, {"name": POOL_A, "pools": [{
        "name": "iso-a", "product": "BENCH-1G", "gpusPerNode": 1, "nodesPerRack": tarpit_jobs}]})
    wait_nodes_ready(kubeconfig, names, 600)
    endpoints = ",".join(sorted({"127.0.0.1", urlsplit(s3.endpoint).hostname or "127.0.0.1"}))
    with api_client(kubeconfig) as api:
        core = client.CoreV1Api(api)
        bench = Bench(kubeconfig, api, s3, f"bench-isolation-a-{os.getpid()}",
                      f"bench-isolation-b-{os.getpid()}", tarpit_jobs)
        for ns in (bench.ns_a, bench.ns_b):
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
            core.create_namespaced_secret(ns, client.V1Secret(
                metadata=client.V1ObjectMeta(name=SECRET),
                string_data={"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}))
        log = Path(f"/tmp/topotrain-bench-isolation-{os.getpid()}.log")
        print(f"operator log: {log}", flush=True)
        try:
            with recovery.operator(kubeconfig, f"{bench.ns_a},{bench.ns_b}", "incremental", log, endpoints):
                try:
                    return measure_all(bench, failures, rounds, jobs, seed)
                finally:
                    for ns in (bench.ns_a, bench.ns_b):
                        clear_jobs(bench, ns)
        finally:
            for ns in (bench.ns_a, bench.ns_b):
                core.delete_namespace(ns)
            delete_topology(kubeconfig, recovery.topology(NODES)["name"])
            delete_topology(kubeconfig, POOL_A)


def measure_all(bench: Bench, failures: int, rounds: int, jobs: int, seed: int) -> list[PhaseRun]:
    """B's jobs Running, then every phase of the schedule."""
    custom, core = client.CustomObjectsApi(bench.api), client.CoreV1Api(bench.api)
    bench.b_jobs = [f"b-{i}" for i in range(jobs)]
    for job in bench.b_jobs:
        custom.create_namespaced_custom_object(*GROUP, bench.ns_b, "trainingjobs", b_manifest(bench, job))
    for job in bench.b_jobs:
        recovery.wait_running(core, bench.ns_b, job, 0, GANG, 300)
    victims = {phase: random.Random(seed) for phase in PHASES}  # the same draws for both kinds
    runs = [measure(bench, phase, r, count, victims[phase]) for r, phase, count in schedule(failures, rounds)]
    for job in bench.b_jobs:
        condition = store_condition(job_status(bench, bench.ns_b, job))
        print(f"  B {job}: {STORE_REACHABLE}={condition.get('status')} ({condition.get('reason')})")
    return runs


def report(runs: list[PhaseRun], seed: int, seconds: float, load: tuple[tuple[float, ...], ...]) -> None:
    times = {p: [t for r in runs if r.phase == p for t in r.times] for p in PHASES}
    resumed = {p: sum(r.resumed for r in runs if r.phase == p) for p in PHASES}
    stats = {p: (statistics.median(v), recovery.percentile(v, 0.95), max(v)) for p, v in times.items()}
    print()
    print("| phase | failures | p50 s | p95 s | max s | resumed from the step committed before |")
    print("|---|---:|---:|---:|---:|---:|")
    for phase in PHASES:
        p50, p95, worst = stats[phase]
        print(f"| {phase} | {len(times[phase])} | {p50:.2f} | {p95:.2f} | {worst:.2f} | "
              f"{resumed[phase]}/{len(times[phase])} |")
    ratio50 = stats["tarpit"][0] / stats["no tarpit"][0]
    ratio95 = stats["tarpit"][1] / stats["no tarpit"][1]
    print(f"| tarpit / no tarpit | | {ratio50:.2f}x | {ratio95:.2f}x | "
          f"{stats['tarpit'][2] / stats['no tarpit'][2]:.2f}x | |")
    print()
    for r in runs:
        print(f"- round {r.round}, {r.phase}: {len(r.times)} failures, p50 {statistics.median(r.times):.2f} s; "
              f"{r.evidence}")
    met = ratio50 <= 1.2 and ratio95 <= 1.2
    print(f"\ngoal (tarpit p50 and p95 within 20% of no tarpit): {'met' if met else 'NOT met'}")
    print(f"seed {seed}; {seconds / 60:.1f} min; load average (1, 5, 15 min) at start "
          f"{', '.join(f'{x:.2f}' for x in load[0])}, at end {', '.join(f'{x:.2f}' for x in load[1])}; "
          f"{os.cpu_count()} CPUs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=int, default=16, help="failures per phase kind (both get as many)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the two phases, in ABBA order")
    parser.add_argument("--jobs", type=int, default=2, help="TrainingJobs in namespace B (8 pods each)")
    parser.add_argument("--tarpit-jobs", type=int, default=16, help="one-pod TrainingJobs in namespace A")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.failures < args.rounds or args.rounds < 1 or not 1 <= args.jobs <= 8 or args.tarpit_jobs < 1:
        parser.error("need --failures >= --rounds >= 1, 1 <= --jobs <= 8 and --tarpit-jobs >= 1")
    began, load = time.monotonic(), os.getloadavg()
    given = os.environ.get("KUBECONFIG")
    shape = (args.failures, args.rounds, args.jobs, args.tarpit_jobs, args.seed)
    if given:
        runs = run(given, store_target(None), *shape)
    else:
        from testbed.cluster import Testbed

        # kwokctl's node lease (200 s), as bench/recovery.py: no node flaps NotReady on a busy machine
        bed = Testbed(Path("/tmp/topotrain-bench-isolation"), node_lease_seconds=200)
        with bed.session():
            runs = run(str(bed.kubeconfig), store_target(bed), *shape)
    report(runs, args.seed, time.monotonic() - began, (load, os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
