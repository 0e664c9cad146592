"""How the testbed copes with a 1,000-node GPU fleet on this machine.

Starts a private testbed (its own state directory, so a running `.testbed/`
is untouched), then for a baseline fleet and the 1,000-node fleet measures:
the time to create the nodes and until all are Ready, the time until one
8-GPU pod per node is scheduled and Running, and the resident memory of
each component. Prints a table with the scale/baseline ratio per column.

    python bench/testbed_scale.py [--nodes 1000] [--baseline 200] [--no-pods]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from urllib3.exceptions import ProtocolError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.client import api_client, core_v1
from testbed.cluster import CONTROL_PLANE, Testbed
from testbed.nodes import apply_topology, delete_topology, wait_nodes_ready
from testbed.procs import ManagedProcess
from testbed.topology import GPU_RESOURCE, generate_scale_topology

COMPONENTS = [name for name, _ in CONTROL_PLANE]


@dataclass
class Phase:
    name: str
    nodes: int
    create_s: float = 0.0
    ready_s: float = 0.0
    pods_running_s: float | None = None
    rss_mib: dict[str, float] = field(default_factory=dict)


def group_rss_mib(process: ManagedProcess) -> float:
    """Resident memory of a component's whole process group, in MiB."""
    pgid = process.pid()
    if pgid is None:
        return float("nan")
    total_kib = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total_kib / 1024


def run_pods(bed: Testbed, namespace: str, nodes: int) -> float:
    """Create one 8-GPU pod per node (a full fleet); seconds until all are Running."""
    with api_client(bed.kubeconfig) as api:
        core = core_v1(api)
        core.create_namespace({"metadata": {"name": namespace}})
        while not core.list_namespaced_service_account(namespace).items:
            time.sleep(0.2)
        pod = {
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.invalid/bench:0",
                        "resources": {"limits": {GPU_RESOURCE: "8"}},
                    }
                ],
                "automountServiceAccountToken": False,
            }
        }
        start = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda i: core.create_namespaced_pod(
                        namespace, {**pod, "metadata": {"name": f"p{i}"}}
                    ),
                    range(nodes),
                )
            )
        while True:
            try:
                raw = core.list_namespaced_pod(namespace, _preload_content=False).data
            except ProtocolError:  # a list cut short on an overloaded machine: ask again
                continue
            phases = [p["status"].get("phase") for p in json.loads(raw)["items"]]
            if phases.count("Running") == nodes:
                elapsed = time.monotonic() - start
                break
            time.sleep(1.0)
        core.delete_namespace(namespace)
    return elapsed


def measure(bed: Testbed, name: str, nodes: int, pods: bool) -> Phase:
    phase = Phase(name, nodes)
    topology = generate_scale_topology(nodes, prefix=f"{name}-")
    start = time.monotonic()
    names = apply_topology(bed.kubeconfig, topology)
    phase.create_s = time.monotonic() - start
    wait_nodes_ready(bed.kubeconfig, names, timeout=900)
    phase.ready_s = time.monotonic() - start
    if pods:
        phase.pods_running_s = run_pods(bed, f"bench-{name}", nodes)
    time.sleep(5)  # let watch caches and informers settle before reading memory
    phase.rss_mib = {c: group_rss_mib(bed.process(c)) for c in COMPONENTS}
    delete_topology(bed.kubeconfig, str(topology["name"]))
    return phase


SHORT = {
    "etcd": "etcd",
    "kube-apiserver": "apiserver",
    "kube-controller-manager": "ctrl-mgr",
    "kube-scheduler": "scheduler",
    "kwok": "kwok",
}


def print_table(phases: list[Phase]) -> None:
    columns = ["nodes", "create s", "Ready s", "pods Run s"] + [
        f"{SHORT[c]} MiB" for c in COMPONENTS
    ]

    def values(p: Phase) -> list[float]:
        pods = p.pods_running_s if p.pods_running_s is not None else float("nan")
        return [p.nodes, p.create_s, p.ready_s, pods] + [p.rss_mib[c] for c in COMPONENTS]

    rows = [(p.name, values(p)) for p in phases]
    base, scale = rows[0][1], rows[-1][1]
    rows.append(("ratio", [s / b if b else float("nan") for s, b in zip(scale, base, strict=True)]))
    widths = [max(len(c), 7) + 2 for c in columns]
    print("phase".ljust(10) + "".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for label, vals in rows:
        cells = [
            f"{v:>{w - 1}.2f}x" if label == "ratio" else f"{v:>{w}.1f}"
            for v, w in zip(vals, widths, strict=True)
        ]
        print(label.ljust(10) + "".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--baseline", type=int, default=200)
    parser.add_argument("--no-pods", action="store_true", help="skip the pod phase")
    parser.add_argument(
        "--node-lease-seconds",
        type=int,
        default=200,
        help="node lease duration = node-monitor grace (kwokctl's 200 suits large fleets)",
    )
    args = parser.parse_args()
    # A TERM (or timeout) still stops the private testbed through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="topotrain-bench-") as state:
        bed = Testbed(state, node_lease_seconds=args.node_lease_seconds)
        start = time.monotonic()
        bed.up()
        print(f"control plane up in {time.monotonic() - start:.1f}s (state {state})")
        try:
            idle = {c: group_rss_mib(bed.process(c)) for c in COMPONENTS}
            print("idle RSS MiB: " + ", ".join(f"{c} {v:.0f}" for c, v in idle.items()))
            phases = [
                measure(bed, "baseline", args.baseline, not args.no_pods),
                measure(bed, "scale", args.nodes, not args.no_pods),
            ]
        finally:
            bed.down()
    print_table(phases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
