"""`python -m testbed up|down|status|nodes|fault ...`: run the local testbed.

python -m testbed up --topology examples/clusters/two-pool.yaml
KUBECONFIG=.testbed/kubeconfig kubectl get nodes -L nvidia.com/gpu.product
python -m testbed fault fail-pod default/worker-0 --exit-code 137 --reason OOMKilled
python -m testbed down
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from testbed import faults
from testbed.cluster import Testbed
from testbed.nodes import apply_topology, delete_node, wait_nodes_ready


def _up(bed: Testbed, args: argparse.Namespace) -> None:
    with bed.locked():
        bed.up(topology=args.topology, timeout=args.timeout)
        bed.adopt()  # started or not by a test session, it is the user's now
    print(f"testbed up: KUBECONFIG={bed.kubeconfig}")
    print(f"S3: {bed.s3.endpoint} (credentials in {bed.root / 's3.env'})")


def _down(bed: Testbed, args: argparse.Namespace) -> None:
    with bed.locked():
        stopped = bed.down()
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    if args.purge and bed.root.exists():
        shutil.rmtree(bed.root)
        print(f"removed {bed.root}")


def _status(bed: Testbed, _: argparse.Namespace) -> None:
    if not (bed.root / "state.json").exists():
        print(f"no testbed in {bed.root}")
        return
    print(f"{'COMPONENT':<24} {'PID':>8}  {'ENDPOINT':<26} LOG")
    for row in bed.status():
        pid = str(row.pid) if row.pid else "stopped"
        print(f"{row.name:<24} {pid:>8}  {row.endpoint:<26} {row.log}")
    print(f"kubeconfig: {bed.kubeconfig}")


def _nodes(bed: Testbed, args: argparse.Namespace) -> None:
    names = apply_topology(bed.kubeconfig, args.topology)
    wait_nodes_ready(bed.kubeconfig, names, timeout=args.timeout)
    print(f"{len(names)} node(s) Ready from {args.topology}")


def _fault(bed: Testbed, args: argparse.Namespace) -> None:
    kubeconfig = bed.kubeconfig
    match args.fault:
        case "fail-pod":
            namespace, _, name = args.pod.rpartition("/")
            faults.fail_pod(
                kubeconfig, namespace or "default", name,
                exit_code=args.exit_code, reason=args.reason,
            )  # fmt: skip
        case "node-not-ready":
            faults.node_not_ready(kubeconfig, args.node)
        case "node-unreachable":
            faults.node_unreachable(kubeconfig, args.node)
        case "node-ready":
            faults.node_ready(kubeconfig, args.node)
        case "delete-node":
            delete_node(kubeconfig, args.node)
        case "s3-stop":
            bed.s3.stop()
        case "s3-start":
            bed.s3.start()
    print(f"injected {args.fault}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m testbed", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="state directory (default .testbed/)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start (what is not running) and optionally create nodes")
    up.add_argument("--topology", type=Path, help="a file from examples/clusters/")
    up.add_argument("--timeout", type=float, default=300.0)
    up.set_defaults(run=_up)
    down = sub.add_parser("down", help="stop every testbed process")
    down.add_argument("--purge", action="store_true", help="also delete the state directory")
    down.set_defaults(run=_down)
    sub.add_parser("status", help="show what runs").set_defaults(run=_status)
    nodes = sub.add_parser("nodes", help="create the nodes of a topology file")
    nodes.add_argument("topology", type=Path)
    nodes.add_argument("--timeout", type=float, default=180.0)
    nodes.set_defaults(run=_nodes)
    fault = sub.add_parser("fault", help="inject a failure").add_subparsers(
        dest="fault", required=True
    )
    fail = fault.add_parser("fail-pod", help="NAMESPACE/POD terminates with an exit code")
    fail.add_argument("pod")
    fail.add_argument("--exit-code", type=int, default=1)
    fail.add_argument("--reason", default="Error")
    for name in ("node-not-ready", "node-unreachable", "node-ready", "delete-node"):
        fault.add_parser(name).add_argument("node")
    fault.add_parser("s3-stop")
    fault.add_parser("s3-start")
    for choice in fault.choices.values():
        choice.set_defaults(run=_fault)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.run(Testbed(args.dir), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
