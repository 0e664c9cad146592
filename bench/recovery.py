"""Recovery time: injected pod failure -> every replacement pod Running.

On the testbed (real API server, scheduler and controller manager; KWOK GPU
nodes), for clusters of 64 and 512 simulated 8-GPU nodes: a TrainingJob
runs, a random pod of its gang is failed (KWOK's failure stage: exit code 1)
again and again, and the time until the whole replacement gang is Running is
measured from outside the operator, by polling the API server every 50 ms.

Two strategies, measured in the same run on the same cluster and job:

- incremental (topotrain's default): in the pass that detects the failure,
  the operator keeps healthy pods' nodes, re-plans only what was lost, and
  creates the next attempt at once (the scheduler binds each pod as soon as
  the old one on that node is gone);
- recreate (baseline, `topotrain run --recovery recreate`): delete the whole
  gang, wait until it is gone, plan from scratch, create.

    python bench/recovery.py [--sizes 64,512] [--failures 20] [--seed 1]

Uses $KUBECONFIG when set (a testbed already up), otherwise starts the
testbed. Pods run no processes (KWOK): this measures the control plane path.

With --first-step, instead: time to the first training step after a trainer
crash, a pod deletion, a node loss and a hang, restart in place against a
recreate, with the real trainer (bench/recovery_first_step.py):

    python bench/recovery.py --first-step [--repeats 2] [--classes crash,hang] [--warm-spares]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kubernetes import client  # noqa: E402

from testbed.client import api_client  # noqa: E402
from testbed.faults import fail_pod  # noqa: E402
from testbed.nodes import apply_topology, delete_topology, wait_nodes_ready  # noqa: E402

TOPOLOGY_LABEL = "testbed.topotrain.io/topology"
# nodes -> (racks per block, nodes per rack, blocks, job data degree); TP=8 on 8-GPU pods, PP=2
SHAPES = {64: (4, 8, 2, 4), 512: (8, 16, 4, 32)}


def topology(nodes: int) -> dict[str, Any]:
    racks, per_rack, blocks, _ = SHAPES[nodes]
    return {"name": f"recovery-{nodes}", "pools": [{
        "name": f"rb{nodes}", "product": "H100-80GB", "gpusPerNode": 8, "blocks": blocks,
        "racksPerBlock": racks, "nodesPerRack": per_rack, "nvlinkDomainNodes": 1,
    }]}


def job_manifest(name: str, namespace: str, nodes: int) -> dict[str, Any]:
    data = SHAPES[nodes][3]
    return {
        "apiVersion": "topotrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "image": "topotrain/trainer:bench", "parallelism": {"tensor": 8, "pipeline": 2, "data": data},
            "worker": {"gpusPerPod": 8, "nodeSelector": {TOPOLOGY_LABEL: f"recovery-{nodes}"}},
            "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 1000, "progressTimeoutSeconds": 0},
        },
    }


@contextmanager
def operator(kubeconfig: str, namespace: str, strategy: str, log: Path,
             endpoints: str = "127.0.0.1") -> Iterator[None]:
    """The operator as a process, for `namespace` (a comma list: several); `endpoints`:
    TOPOTRAIN_CHECKPOINT_ENDPOINTS (the testbed's S3 server is on loopback)."""
    path = os.pathsep.join(filter(None, [str(REPO / "operator"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "KUBECONFIG": kubeconfig, "TOPOTRAIN_RECONCILE_INTERVAL": "5", "PYTHONPATH": path,
           "TOPOTRAIN_CHECKPOINT_ENDPOINTS": endpoints}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "topotrain.cli", "run", "--standalone", "--namespace", namespace,
             "--recovery", strategy, "--metrics-port", "0", "--health-port", "0"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def gang(core: Any, namespace: str, job: str, attempt: int) -> list[Any]:
    selector = f"topotrain.io/job={job},topotrain.io/attempt={attempt}"
    return [p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
            if p.metadata.deletion_timestamp is None]


def wait_running(core: Any, namespace: str, job: str, attempt: int, pods: int, timeout: float) -> float:
    """Seconds until every pod of `attempt` is Running (raises TimeoutError)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        mine = gang(core, namespace, job, attempt)
        if len(mine) == pods and all(p.status.phase == "Running" for p in mine):
            return time.monotonic() - start
        time.sleep(0.05)
    raise TimeoutError(f"{job} attempt {attempt}: not all {pods} pods Running after {timeout:.0f}s")


def current_attempt(custom: Any, namespace: str, job: str) -> int:
    body = custom.get_namespaced_custom_object("topotrain.io", "v1alpha1", namespace, "trainingjobs", job)
    return int((body.get("status") or {}).get("attempt", 0))


def wait_recovered(core: Any, custom: Any, namespace: str, job: str, failed: int, pods: int,
                   timeout: float) -> None:
    """Until an attempt after `failed` has every pod Running (an unrelated restart counts too)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        attempt = current_attempt(custom, namespace, job)
        mine = gang(core, namespace, job, attempt) if attempt > failed else []
        if len(mine) == pods and all(p.status.phase == "Running" for p in mine):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{job}: no attempt after {failed} fully Running after {timeout:.0f}s")


def measure(api: Any, kubeconfig: str, namespace: str, nodes: int, strategy: str,
            failures: int, rng: random.Random) -> list[float]:
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    job = f"bench-{strategy}"
    pods = 2 * SHAPES[nodes][3]
    with operator(kubeconfig, namespace, strategy, Path(f"/tmp/topotrain-bench-{nodes}-{strategy}.log")):
        custom.create_namespaced_custom_object(
            "topotrain.io", "v1alpha1", namespace, "trainingjobs", job_manifest(job, namespace, nodes))
        wait_running(core, namespace, job, 0, pods, 300)
        times = []
        for number in range(1, failures + 1):
            times.append(fail_and_recover(kubeconfig, api, namespace, job, pods, rng))
            print(f"  {nodes:4d} nodes {strategy:11s} failure {number:2d}: {times[-1]:6.2f}s",
                  flush=True)
        delete_job(api, namespace, job)
    return times


def fail_and_recover(kubeconfig: str, api: Any, namespace: str, job: str, pods: int,
                     rng: random.Random) -> float:
    """Fail a random pod of the job's Running gang (KWOK: exit code 1); seconds until a later
    attempt has all `pods` Running."""
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    attempt = current_attempt(custom, namespace, job)
    wait_running(core, namespace, job, attempt, pods, 300)
    victim = rng.choice(gang(core, namespace, job, attempt))
    fail_pod(kubeconfig, namespace, victim.metadata.name, exit_code=1)
    start = time.monotonic()
    wait_recovered(core, custom, namespace, job, attempt, pods, 300)
    return time.monotonic() - start


def delete_job(api: Any, namespace: str, job: str, timeout: float = 120) -> None:
    """Delete the TrainingJob; wait (at most `timeout`) until its pods are gone."""
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    custom.delete_namespaced_custom_object("topotrain.io", "v1alpha1", namespace, "trainingjobs", job)
    deadline = time.monotonic() + timeout
    while core.list_namespaced_pod(namespace, label_selector=f"topotrain.io/job={job}").items:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(kubeconfig: str, sizes: list[int], failures: int, seed: int) -> list[tuple[Any, ...]]:
    rows = []
    install_crd(kubeconfig)
    with api_client(kubeconfig) as api:
        core = client.CoreV1Api(api)
        for nodes in sizes:
            print(f"creating {nodes} KWOK GPU nodes ...", flush=True)
            names = apply_topology(kubeconfig, topology(nodes))
            wait_nodes_ready(kubeconfig, names, 600)
            namespace = f"bench-recovery-{nodes}-{os.getpid()}"
            core.create_namespace({"metadata": {"name": namespace}})
            results = {}
            for strategy in ("incremental", "recreate"):
                results[strategy] = measure(api, kubeconfig, namespace, nodes, strategy, failures,
                                            random.Random(seed))
            base = statistics.median(results["recreate"])
            for strategy, times in results.items():
                p50 = statistics.median(times)
                rows.append((nodes, 2 * SHAPES[nodes][3], strategy, len(times), p50,
                             percentile(times, 0.95), max(times), base / p50))
            core.delete_namespace(namespace)
            delete_topology(kubeconfig, f"recovery-{nodes}")
    return rows


def install_crd(kubeconfig: str) -> None:
    """The TrainingJob CRD, applied server-side to the cluster `kubeconfig` names."""
    subprocess.run([str(_kubectl()), "apply", "--server-side", "--force-conflicts", "--validate=false", "-f",
                    str(REPO / "crds" / "topotrain.io_trainingjobs.yaml")],
                   env={**os.environ, "KUBECONFIG": kubeconfig}, check=True, capture_output=True)


def _kubectl() -> Path:
    from testbed.binaries import bin_dir

    built = bin_dir() / "kubectl"
    return built if built.exists() else Path("kubectl")


def print_table(rows: list[tuple[Any, ...]]) -> None:
    print()
    print("| nodes | gang pods | strategy | failures | p50 s | p95 s | max s | recreate p50 / p50 |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for nodes, pods, strategy, n, p50, p95, worst, ratio in rows:
        print(f"| {nodes} | {pods} | {strategy} | {n} | {p50:.2f} | {p95:.2f} | {worst:.2f} | {ratio:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,512", help="comma list of node counts (64, 512)")
    parser.add_argument("--failures", type=int, default=20, help="failures per size and strategy")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--first-step", action="store_true",
                        help="time to first step per failure class, in place vs recreate, real trainer")
    parser.add_argument("--repeats", type=int, default=2, help="--first-step: faults per class and mode")
    parser.add_argument("--classes", default="crash,pod deletion,node loss,hang",
                        help="--first-step: comma list of failure classes")
    parser.add_argument("--warm-spares", action="store_true",
                        help="--first-step: the job keeps warm spares (training.warmSpares)")
    args = parser.parse_args(argv)
    if args.first_step:
        sys.path.insert(0, str(REPO / "bench"))
        import recovery_first_step

        classes = tuple(c.strip() for c in args.classes.split(","))
        unknown = [c for c in classes if c not in recovery_first_step.CLASSES]
        if unknown:
            parser.error(f"--classes: unknown {', '.join(unknown)}")
        recovery_first_step.print_table(
            recovery_first_step.run(args.repeats, classes, warm_spares=args.warm_spares))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        parser.error(f"sizes must be among {sorted(SHAPES)}")
    given = os.environ.get("KUBECONFIG")
    if given:
        rows = run(given, sizes, args.failures, args.seed)
    else:
        from testbed.cluster import Testbed

        # Its own testbed, with kwokctl's node lease (200 s): on a busy machine a 40 s lease
        # lets nodes flap NotReady, which would add restarts the benchmark did not inject.
        bed = Testbed(Path("/tmp/topotrain-bench-recovery"), node_lease_seconds=200)
        with bed.session():
            rows = run(str(bed.kubeconfig), sizes, args.failures, args.seed)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
