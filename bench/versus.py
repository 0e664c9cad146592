"""topotrain against Kueue's topology-aware scheduling with JobSet: same testbed, same
fragmented fleet, same seeded job stream, one run.

    python bench/versus.py --quick                  # 40 nodes, 8 jobs: about 3 minutes
    python bench/versus.py --nodes 1000 --jobs 40   # docs/benchmarks.md

A private testbed (real API server, scheduler, controller manager; KWOK nodes, no trainer
runs) gets bench/scale_workload.py's fleet (H100 and A100 pools of 8-GPU nodes in racks and
blocks), then filler pods bound to random nodes holding `--used` of the GPUs in 1-8 GPU
pieces (the fragmented cluster; they stay for both systems). First the placement phase
(bench/versus_placement.py): per filler seed and job shape, each system places that one
job alone on the same free GPUs, and the cost model and the step-time model (docs/placement.md,
"Step-time model": the predicted step of each system's placement, with the ratio) are
evaluated on both; then the recovery
phase (bench/versus_recovery.py): the largest job alone under each system on the stream's
fillers, the node of its pod 0 deleted, timed until it all runs again. Then the stream,
one system after the other, on that same state:

- topotrain: the operator (`topotrain run --standalone`, its defaults), the stream as
  TrainingJobs;
- Kueue + JobSet: Kueue (TAS on), JobSet, a Topology with the operator's levels, a
  ResourceFlavor per pool (H100 first), one ClusterQueue, a LocalQueue; the stream as the
  JobSets of bench/versus_jobs.py (the annotations `topotrain.core.kueue` would ask for).

Only one system's controllers run at a time. Measured per system, by the same pod poll:
apply -> all pods Running per job, admissions per minute (jobs Running over first apply ->
last Running), the cost model and the predicted step time of docs/placement.md on the nodes
each gang got; then a node
loss (the Node object of a gang's pod 0 deleted, as a machine leaving) under one chosen job:
time until the gang is all Running again off that node and the pods created meanwhile.
The node and its filler pods are put back before the next system. `--yaml DIR` writes the
manifests used (queue objects, one TrainingJob and one JobSet per kind).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml
from kubernetes import client
from scale_runner import OperatorRun, install_crd, make_namespace, remove_namespace
from scale_workload import JobShape
from topotrain.core.manifests import INDEX_LABEL, JOB_LABEL
from versus_bench import Bench
from versus_jobs import (
    COMPLETION_INDEX_LABEL,
    FILLER_NAMESPACE,
    JOBSET_NAME_LABEL,
    jobset_manifest,
)
from versus_placement import run_placement
from versus_report import print_placement, print_report
from versus_results import PlacementResult, SystemResult

from testbed.client import api_client
from testbed.cluster import Testbed
from testbed.kueue import KueueStack


def trainingjob(
    shape: JobShape, topology: str, namespace: str = "versus-topotrain"
) -> dict[str, Any]:
    """The stream's TrainingJob, with no restart backoff: JobSet's Recreate has none (the
    operator's default waits 10 s before the first restart)."""
    body = shape.manifest(namespace, topology)
    body["spec"]["failurePolicy"]["backoffSeconds"] = 0
    return body


def run_topotrain(bench: Bench) -> SystemResult:
    namespace = "versus-topotrain"
    custom = client.CustomObjectsApi(bench.api)
    install_crd(bench.api)
    make_namespace(bench.api, namespace)
    # The filler pods' namespace too: an operator limited to namespaces indexes only their
    # pods, and would not see the GPUs the fillers hold.
    operator = OperatorRun(bench.bed, f"{namespace},{FILLER_NAMESPACE}", None, bench.args.pod_binding)
    operator.start(timeout=300, listed=bench.listed())
    try:

        def create(shape: JobShape) -> None:
            custom.create_namespaced_custom_object(
                "topotrain.io",
                "v1alpha1",
                namespace,
                "trainingjobs",
                trainingjob(shape, bench.name),
            )

        print("[topotrain] applying the stream", file=sys.stderr, flush=True)
        return bench.run("topotrain", namespace, JOB_LABEL, INDEX_LABEL, create)
    finally:
        operator.stop()
        remove_namespace(bench.api, namespace)


def run_kueue(bench: Bench) -> SystemResult:
    namespace = "versus-kueue"
    custom = client.CustomObjectsApi(bench.api)
    stack = KueueStack(bench.bed, jobset=True)
    stack.start()
    try:
        make_namespace(bench.api, namespace)
        queues = bench.queues(namespace)
        stack.apply(queues.manifests())
        for cluster_queue in queues.cluster_queues:
            stack.wait_cluster_queue_active(cluster_queue)

        def create(shape: JobShape) -> None:
            queue = queues.queue_for(shape.gpu_types)
            body = jobset_manifest(shape, namespace, bench.name, queue, queues.levels)
            custom.create_namespaced_custom_object(
                "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", body
            )

        print("[kueue] applying the stream", file=sys.stderr, flush=True)
        result = bench.run("Kueue TAS + JobSet", namespace, JOBSET_NAME_LABEL,
                           COMPLETION_INDEX_LABEL, create)  # fmt: skip
        result.log_tail = stack.log_tail(5)
        result.victim_state = victim_workload(custom, namespace, bench.victim)
        return result
    finally:
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(bench.api).delete_namespace(namespace)
        stack.stop()


def victim_workload(custom: client.CustomObjectsApi, namespace: str, job: str) -> str:
    """The conditions of the Workload Kueue made for JobSet `job`, after the recovery wait."""
    if not job:
        return ""
    try:
        items = custom.list_namespaced_custom_object(
            "kueue.x-k8s.io", "v1beta2", namespace, "workloads"
        )["items"]
    except client.ApiException as err:
        return f"workloads not listed: {err.reason}"
    lines = []
    for workload in items:
        owners = {o.get("name") for o in workload["metadata"].get("ownerReferences") or []}
        if job not in owners:
            continue
        status = workload.get("status") or {}
        lines.append(f"Workload {workload['metadata']['name']}: requeueState "
                     f"{status.get('requeueState')}, admitted "
                     f"{bool(status.get('admission'))}")  # fmt: skip
        for c in status.get("conditions") or []:
            lines.append(f"  {c.get('type')}={c.get('status')} {c.get('reason')} "
                         f"({c.get('lastTransitionTime')}): {c.get('message')}")  # fmt: skip
    return "\n".join(lines)


def write_yaml(bench: Bench, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    queues = bench.queues("versus-kueue")
    (out / "kueue-queues.yaml").write_text(yaml.safe_dump_all(queues.manifests(), sort_keys=False))
    seen: set[str] = set()
    for shape in bench.shapes:
        if shape.kind in seen:
            continue
        seen.add(shape.kind)
        job = trainingjob(shape, bench.name)
        jobset = jobset_manifest(
            shape, "versus-kueue", bench.name, queues.queue_for(shape.gpu_types), queues.levels
        )
        (out / f"{shape.kind}-trainingjob.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
        (out / f"{shape.kind}-jobset.yaml").write_text(yaml.safe_dump(jobset, sort_keys=False))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="40 nodes, 8 jobs (CI)")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--big-pods", type=int)
    parser.add_argument(
        "--used", type=float, default=0.5, help="fraction of GPUs held by filler pods"
    )
    parser.add_argument("--interval", type=float, default=1.0, help="mean seconds between arrivals")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pod-binding", choices=("scheduler", "operator"), default="scheduler",
                        help="who binds topotrain's pods (the operator's --pod-binding); Kueue's are "
                        "bound by kube-scheduler either way")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds without a gang Running")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--recovery-timeout", type=float, default=300.0)
    parser.add_argument(
        "--placement-seeds",
        type=int,
        default=1,
        help="filler seeds of the placement phase (0: no placement phase)",
    )
    parser.add_argument(
        "--instance-timeout",
        type=float,
        default=60.0,
        help="seconds a system has to place one placement-phase job",
    )
    parser.add_argument("--node-lease-seconds", type=int, default=40)
    parser.add_argument("--state", type=Path, help="testbed state folder to keep (logs)")
    parser.add_argument("--yaml", type=Path, help="write the manifests used into this folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.jobs, args.settle, args.used = 40, 8, 10.0, 0.3
        args.recovery_timeout, args.instance_timeout = 60.0, 30.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        state = (
            str(args.state)
            if args.state
            else stack.enter_context(tempfile.TemporaryDirectory(prefix="topotrain-versus-"))
        )
        bed = Testbed(state, node_lease_seconds=args.node_lease_seconds)
        stack.callback(bed.down)
        bed.up()
        api = stack.enter_context(api_client(bed.kubeconfig))
        start = time.monotonic()
        bench = Bench(bed, api, args)
        print(f"fleet of {args.nodes} nodes and {len(bench.fillers)} filler pods in "
              f"{time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)  # fmt: skip
        if args.yaml:
            write_yaml(bench, args.yaml)
        placement = (
            run_placement(bench, args.placement_seeds, args.instance_timeout, trainingjob,
                          args.recovery_timeout)
            if args.placement_seeds > 0
            else PlacementResult()
        )
        results = [run_topotrain(bench), run_kueue(bench)]
    print_placement(placement, results[0].system, results[1].system, args)
    return print_report(results, args)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
