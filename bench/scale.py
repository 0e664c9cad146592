"""The topotrain operator at scale: a job stream on a private testbed of N GPU nodes.

    python bench/scale.py --nodes 500 1000 --jobs 40            # one row per fleet size
    python bench/scale.py --plan-only --plan-nodes 10000 --plan-pods 1024

Starts a private testbed (its own state directory under a temporary
directory; a running `.testbed/` is untouched): the real kube-apiserver, etcd,
kube-controller-manager and kube-scheduler, with KWOK playing the kubelets.
For each `--nodes` value it creates that fleet (bench/scale_workload.py: two
pools, blocks, racks, NVLink domains), installs the CRD, starts the operator
as users run it (`topotrain run --standalone`, a subprocess with its defaults),
and applies the same seeded stream of `--jobs` TrainingJobs (small, dense 3D,
elastic and one big gang). No trainer runs: KWOK moves bound pods to Running,
so a job is Running once the operator placed, created and released its gang
and the scheduler bound it. Measured per fleet:

- apply -> gang Running, p50/p95/p99 over the jobs that got there: from the
  benchmark's own clock just before the create call (creationTimestamp is
  whole seconds; the create comes a few milliseconds after) to the watch event
  that first showed `status.phase: Running`; the big gang's alone as well;
- admissions per minute: jobs reaching Running over first apply -> last Running;
- reconcile pass p50/p99: `topotrain_reconcile_seconds` from the operator's
  metrics endpoint, interpolated within its buckets (5 ms ... 60 s);
- operator CPU seconds over the run and peak RSS (VmHWM), from /proc;
- API requests per job: the operator reaches the API server through a counting
  proxy (bench/scale_probes.py), since `apiserver_request_total` cannot tell
  its requests from the other clients'; `--no-proxy` connects it directly;
- jobs that did not reach Running, each with the condition that says why (the
  run fails when a job has none).

Each size after the first gets a ratio row against the first. Times on a busy
machine are noisy: compare sizes within one run. `--plan-nodes/--plan-pods`
also times the planner alone (`planning.PlacementPlanner`, as the operator
calls it) on a generated cluster, repeats and p99; the target is p99 < 1 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from scale_plan import plan_rows, print_plan_table
from scale_plot import growth_svg
from scale_probes import HealthProbe, JobRecord, JobRecorder, RequestCounter, server_writes
from scale_runner import OperatorRun, install_crd, make_namespace, remove_namespace
from scale_workload import JobShape, big_gang_pods, fleet, job_stream
from topotrain.controller.metrics import RECONCILE_BUCKETS

from testbed.client import api_client
from testbed.cluster import Testbed
from testbed.nodes import apply_topology, delete_topology, wait_nodes_ready

WHY_TYPES = ("ConfigValid", "PodsCreated", "Schedulable", "Ready")
PLOTTED = ("jobs", "p99 s", "admissions/min", "reconcile p99 ms", "events/s", "operator CPU s",
           "operator peak RSS MiB", "API requests/job", "healthz max ms")  # fmt: skip
COLUMNS = ("nodes", "jobs", "pods", "Running", "p50 s", "p95 s", "p99 s", "p99 s, gangs <= 128 pods", "big gang s", "admissions/min",
           "reconcile p50 ms", "reconcile p99 ms", "passes", "events/s", "operator CPU s", "operator peak RSS MiB",
           "API requests/job", "healthz max ms", "healthz misses")  # fmt: skip


@dataclass
class SizeResult:
    nodes: int
    shapes: list[JobShape]
    records: list[JobRecord]
    reconcile_p50: float = float("nan")
    reconcile_p99: float = float("nan")
    passes: float = 0.0
    cpu_s: float = float("nan")
    rss_mib: float = float("nan")
    requests: Counter[tuple[str, str]] | None = None
    nodes_ready_s: float = 0.0
    operator_up_s: float = float("nan")
    events: float = float("nan")  # watch events the operator handled, first apply -> settled
    window_s: float = float("nan")  # first apply -> settled
    health: HealthProbe | None = None
    waiting: list[tuple[str, str, str]] = field(default_factory=list)  # name, phase, why ("" = none)
    pass_phases: dict[str, list[float]] = field(default_factory=dict)  # of passes that changed pods
    slow_passes: dict[str, list[float]] = field(default_factory=dict)  # of the others over a second
    big_gang: str = ""  # where the big gang's time went (gang_timeline)
    server_writes: Counter[tuple[str, str]] = field(default_factory=Counter)  # every client's

    def latencies(self, kind: str | None = None, most_pods: int | None = None) -> list[float]:
        shapes = {s.name: s for s in self.shapes}
        return sorted(r.running - r.applied for r in self.records
                      if r.running is not None and (kind is None or shapes[r.name].kind == kind)
                      and (most_pods is None or shapes[r.name].pods <= most_pods))

    def admissions_per_minute(self) -> float:
        done = [r.running for r in self.records if r.running is not None]
        if not done:
            return 0.0
        span = max(done) - min(r.applied for r in self.records)
        return len(done) * 60 / span if span > 0 else float("nan")

    def row(self) -> list[float]:
        lat, big = self.latencies(), self.latencies("big")
        per_job = sum(self.requests.values()) / len(self.shapes) if self.requests is not None else float("nan")
        health = self.health
        health_max = max(health.latencies) * 1000 if health and health.latencies else float("nan")
        return [self.nodes, len(self.shapes), sum(s.pods for s in self.shapes), len(lat),
                percentile(lat, 0.5), percentile(lat, 0.95), percentile(lat, 0.99),
                percentile(self.latencies(most_pods=128), 0.99), big[0] if big else float("nan"), self.admissions_per_minute(),
                self.reconcile_p50 * 1000, self.reconcile_p99 * 1000, self.passes,
                self.events / self.window_s, self.cpu_s, self.rss_mib, per_job,
                health_max, len(health.misses) if health else float("nan")]  # fmt: skip


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def why_not_running(record: JobRecord) -> str:
    """The condition that says why a job is not Running ("" when none does)."""
    by_type = {c.get("type"): c for c in record.conditions}
    for kind in WHY_TYPES:
        cond = by_type.get(kind)
        if cond and cond.get("status") != "True" and cond.get("reason"):
            return f"{kind}={cond['status']} {cond['reason']}: {cond.get('message', '')}"
    return ""


def run_size(bed: Testbed, proxy: RequestCounter | None, run: int, nodes: int, shapes: list[JobShape],
             args: argparse.Namespace, clean_up: bool = True) -> SizeResult:
    """One fleet: nodes, operator, the job stream, the measurements; then stop the operator and
    (unless the testbed goes down next: `clean_up` False) remove the namespace and the nodes."""
    namespace, prefix = f"bench-{run}-{nodes}", f"r{run}-"
    with ExitStack() as stack, api_client(bed.kubeconfig) as api:
        topology = fleet(nodes, prefix)
        start = time.monotonic()
        names = apply_topology(bed.kubeconfig, topology)
        if clean_up:
            stack.callback(delete_topology, bed.kubeconfig, str(topology["name"]))
        wait_nodes_ready(bed.kubeconfig, names, timeout=900)
        ready_s = time.monotonic() - start
        make_namespace(api, namespace)
        if clean_up:
            stack.callback(remove_namespace, api, namespace)
        operator = OperatorRun(bed, namespace, proxy, args.pod_binding)
        stack.callback(operator.stop)
        operator.start(timeout=args.start_timeout or max(180.0, nodes * 0.3))
        health = operator.health
        recorder = JobRecorder(api, namespace)
        stack.callback(recorder.close)
        print(f"[{nodes} nodes] Ready in {ready_s:.0f}s; operator up in {operator.started_s:.0f}s; "
              f"applying {len(shapes)} jobs", file=sys.stderr, flush=True)
        before_requests = proxy.snapshot() if proxy else None
        writes_before = server_writes(api)
        cpu_before, events_before, first_apply = operator.usage()[0], operator.watch_events(), time.monotonic()
        apply_stream(api, namespace, str(topology["name"]), shapes, recorder)
        wait_settled(recorder, len(shapes), args.settle, args.timeout)
        result = SizeResult(nodes, shapes, recorder.records(), nodes_ready_s=ready_s,
                            operator_up_s=operator.started_s, health=health)
        result.events = operator.watch_events() - events_before
        result.window_s = time.monotonic() - first_apply
        result.reconcile_p50, result.reconcile_p99, result.passes = operator.reconcile_quantiles()
        cpu_after, result.rss_mib = operator.usage()
        result.pass_phases = operator.pass_phases()
        result.slow_passes = operator.slow_passes()
        result.big_gang = gang_timeline(api, namespace, shapes, recorder.records())
        result.cpu_s = cpu_after - cpu_before
        result.server_writes = server_writes(api) - writes_before
        if proxy is not None and before_requests is not None:
            result.requests = proxy.snapshot() - before_requests
        result.waiting = [(r.name, r.phase or "-", why_not_running(r))
                          for r in result.records if r.running is None]
        if any(not why for _, _, why in result.waiting):
            print(f"--- operator log ---\n{operator.tail(30)}", file=sys.stderr)
    return result


def gang_timeline(api: client.ApiClient, namespace: str, shapes: list[JobShape],
                  records: list[JobRecord]) -> str:
    """Where the time of the big gang and of the three slowest other jobs went: each job's
    apply -> Running split by its pods' own timestamps (whole seconds, from the API server):
    first and last pod created, first and last bound (PodScheduled), first and last started
    (KWOK's status.startTime), each from the apply. A job whose pods all started well before it
    was seen Running waited on the operator's watch or status write, not on the cluster."""
    kinds = {s.name: s.kind for s in shapes}
    done = sorted((r for r in records if r.running is not None), key=lambda r: r.applied - r.running)
    chosen = [r for r in records if kinds.get(r.name) == "big"][:1]
    chosen += [r for r in done if kinds.get(r.name) != "big"][:3]
    return "; ".join(job_timeline(api, namespace, r) for r in chosen)


def job_timeline(api: client.ApiClient, namespace: str, record: JobRecord) -> str:
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"topotrain.io/job={record.name}",
                                                     _preload_content=False)  # fmt: skip
    items = json.loads(pods.data)["items"]

    def at(stamps: list[str]) -> str:
        times = sorted(datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp() - record.applied for s in stamps)
        # (stamps are whole seconds, truncated: one just after the apply may read as before it)
        return f"{max(times[0], 0.0):.0f}-{max(times[-1], 0.0):.0f}" if times else "-"

    created = at([p["metadata"]["creationTimestamp"] for p in items])
    bound = at([c["lastTransitionTime"] for p in items for c in (p.get("status") or {}).get("conditions") or []
                if c.get("type") == "PodScheduled" and c.get("status") == "True"])  # fmt: skip
    started = at([p["status"]["startTime"] for p in items if (p.get("status") or {}).get("startTime")])
    running = f"{record.running - record.applied:.1f}" if record.running is not None else "-"
    return (f"{record.name} ({len(items)} pods), seconds from its apply: created {created}, bound {bound}, "
            f"started {started}, seen Running {running}")


def slowest(result: SizeResult, count: int = 8) -> str:
    """The `count` slowest jobs, each with when it came relative to the big gang (its tail's cause)."""
    kinds = {s.name: s.kind for s in result.shapes}
    big = next((r.applied for r in result.records if kinds.get(r.name) == "big"), None)
    waits = sorted(((r.running - r.applied, r) for r in result.records if r.running is not None),
                   key=lambda pair: -pair[0])[:count]  # fmt: skip
    return ", ".join(f"{r.name} {wait:.1f}" + (f" (at {r.applied - big:+.0f})" if big is not None else "")
                     for wait, r in waits)


def apply_stream(api: client.ApiClient, namespace: str, topology: str, shapes: list[JobShape],
                 recorder: JobRecorder) -> None:
    custom = client.CustomObjectsApi(api)
    origin = time.monotonic()
    for shape in shapes:
        delay = origin + shape.at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        recorder.applied(shape.name, time.time())
        try:
            custom.create_namespaced_custom_object("topotrain.io", "v1alpha1", namespace, "trainingjobs",
                                                   shape.manifest(namespace, topology))
        except ApiException as exc:
            raise RuntimeError(f"the API server refused {shape.name}: {exc.body}") from None


def wait_settled(recorder: JobRecorder, jobs: int, settle: float, timeout: float) -> None:
    """Until every job is Running, or those that are not have said why and nothing changed for
    `settle` seconds, or `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = recorder.records()
        waiting = [r for r in records if r.running is None]
        if len(records) == jobs and not waiting:
            return
        quiet = time.time() - recorder.last_change > settle
        if len(records) == jobs and quiet and all(why_not_running(r) for r in waiting):
            return
        time.sleep(0.25)


def per_size(values: list[int], sizes: list[int], flag: str) -> list[int]:
    if len(values) == 1:
        return values * len(sizes)
    if len(values) != len(sizes):
        raise SystemExit(f"{flag}: one value, or one per --nodes value ({len(sizes)})")
    return values


def fmt(value: float) -> str:
    if value != value:  # NaN
        return "-"
    if value == math.inf:  # only a histogram quantile past its top bucket
        return f">{RECONCILE_BUCKETS[-1] * 1000:.0f}"
    digits = 0 if float(value).is_integer() or abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:.{digits}f}"


def print_table(results: list[SizeResult]) -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "|".join("---:" for _ in COLUMNS) + "|")
    rows = [r.row() for r in results]
    for row in rows:
        print("| " + " | ".join(fmt(v) for v in row) + " |")
    base = rows[0]
    for row in rows[1:]:
        cells = [f"{v / b:.2f}x" if b and math.isfinite(b) and math.isfinite(v) else "-"
                 for v, b in zip(row, base, strict=True)]
        print(f"| ratio {fmt(row[0])}/{fmt(base[0])} | " + " | ".join(cells[1:]) + " |")
    for result in results:
        if result.health is not None:
            probe = result.health
            print(f"operator at {result.nodes} nodes: up in {result.operator_up_s:.0f} s; "
                  f"{result.events:.0f} watch events in {result.window_s:.0f} s; /healthz polled "
                  f"{len(probe.latencies)} times, p99 {percentile(probe.latencies, 0.99) * 1000:.0f} ms, "
                  f"{len(probe.misses)} misses {dict(probe.why) or ''} (no answer within the chart's {probe.probe.timeout_s:g} s), "
                  f"longest miss streak {probe.longest_miss_streak():.0f} s (the kubelet restarts it after "
                  f"{probe.probe.failure_threshold} misses {probe.probe.period_s:g} s apart); event loop "
                  f"heartbeat age max {max(probe.loop_ages, default=float('nan')):.1f} s")
        for name, phase, why in result.waiting:
            print(f"not Running at {result.nodes} nodes: {name} ({phase}): {why or 'NO CONDITION SAYS WHY'}")
        if result.big_gang:
            print(f"big gang and slowest jobs at {result.nodes} nodes: {result.big_gang}")
        if slow := slowest(result):
            print(f"slowest at {result.nodes} nodes (apply -> Running s, applied at s from the big gang's apply): {slow}")
        for what, phases in (("passes that changed pods", result.pass_phases),
                             ("passes over 1 s that changed no pods", result.slow_passes)):
            counts = {len(v) for v in phases.values()}
            if counts and max(counts):
                parts = ", ".join(f"{name} p50 {percentile(v, 0.5):.2f} s max {max(v):.2f} s"
                                  for name, v in phases.items())
                print(f"{what} at {result.nodes} nodes ({max(counts)}): {parts}")
        if result.server_writes:
            top = ", ".join(f"{verb} {res} {n}" for (verb, res), n in result.server_writes.most_common(10))
            print(f"API server writes at {result.nodes} nodes, every client ({sum(result.server_writes.values())}): {top}")
        if result.requests:
            top = ", ".join(f"{verb} {res} {n}" for (verb, res), n in result.requests.most_common(8))
            print(f"operator API requests at {result.nodes} nodes ({sum(result.requests.values())}): {top}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[500, 1000], help="fleet sizes, in order")
    parser.add_argument("--jobs", type=int, nargs="+", default=[40],
                        help="jobs in the stream: one number for every size, or one per --nodes value")
    parser.add_argument("--big-pods", type=int, nargs="+",
                        help="pods of the big gang, one for all or one per size (default 128; 1/4 of small fleets)")
    parser.add_argument("--start-timeout", type=float, help="seconds the operator may take to list the "
                        "fleet and start its watches (default 0.3 s a node, at least 180)")
    parser.add_argument("--plot", type=Path, help="write an SVG of each column's growth with the fleet here")
    parser.add_argument("--interval", type=float, default=1.0, help="mean seconds between arrivals")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pod-binding", choices=("scheduler", "operator"), default="scheduler",
                        help="who binds the gangs' pods (the operator's --pod-binding)")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds without a status change after which waiting jobs count as settled")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait after the last arrival")
    parser.add_argument("--no-proxy", action="store_true", help="operator straight to the API server")
    parser.add_argument("--node-lease-seconds", type=int, default=200)
    parser.add_argument("--keep-logs", type=Path, help="copy the testbed's logs (the operator's too) here at the end")
    parser.add_argument("--plan-nodes", type=int, nargs="*", default=[10000])
    parser.add_argument("--plan-pods", type=int, default=1024)
    parser.add_argument("--plan-repeats", type=int, default=20)
    parser.add_argument("--plan-used", type=float, nargs="+", default=[0.0, 0.5],
                        help="fractions of the planner cluster's GPUs held by other pods")
    parser.add_argument("--plan-only", action="store_true", help="only the planner measurement")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[SizeResult] = []
    if not args.plan_only:
        jobs = per_size(args.jobs, args.nodes, "--jobs")
        bigs = per_size(args.big_pods or [big_gang_pods(min(args.nodes))], args.nodes, "--big-pods")
        with ExitStack() as stack:
            state = stack.enter_context(tempfile.TemporaryDirectory(prefix="topotrain-scale-"))
            bed = Testbed(state, node_lease_seconds=args.node_lease_seconds)
            stack.callback(bed.down)
            if args.keep_logs:  # copied before the testbed goes (callbacks run last first)
                stack.callback(shutil.copytree, Path(state) / "logs", args.keep_logs, dirs_exist_ok=True)
            start = time.monotonic()
            bed.up()
            print(f"control plane up in {time.monotonic() - start:.0f}s (state {state})", file=sys.stderr)
            with api_client(bed.kubeconfig) as api:
                install_crd(api)
            proxy = None
            if not args.no_proxy:
                proxy = RequestCounter(("127.0.0.1", bed.ports().apiserver), bed.layout.pki)
                stack.callback(proxy.close)
            for run, nodes in enumerate(args.nodes):
                last = run == len(args.nodes) - 1
                shapes = job_stream(jobs[run], bigs[run], args.interval, args.seed)
                results.append(run_size(bed, proxy, run, nodes, shapes, args, clean_up=not last))
        streams = ", ".join(f"{n} nodes: {j} jobs, big gang {b} pods" for n, j, b in zip(args.nodes, jobs, bigs, strict=True))
        print(f"\n### Operator at scale ({streams}; seed {args.seed}, mean arrival gap {args.interval:g} s; "
              f"pods bound by the {args.pod_binding})\n")
        print_table(results)
        if args.plot and len(results) > 1:
            args.plot.write_text(growth_svg(COLUMNS, [r.row() for r in results], PLOTTED))
            print(f"\nplot: {args.plot}")
    if args.plan_nodes:
        print(f"\n### Planner alone: a {args.plan_pods}-pod gang (tensor 8, pipeline 8, 8 GPUs a pod)\n")
        print_plan_table(plan_rows(args.plan_nodes, args.plan_pods, args.plan_used, args.plan_repeats, args.seed))
    unexplained = [name for r in results for name, _, why in r.waiting if not why]
    return 1 if unexplained else 0


if __name__ == "__main__":
    # A TERM (or timeout) still stops the operator and the private testbed through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
