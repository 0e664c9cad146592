"""bench/versus.py's private testbed as every phase uses it: the fleet, its filler pods, the
job stream, and one system's run of the stream (`Bench.run`) with its node loss.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client
from scale_runner import make_namespace
from scale_workload import big_gang_pods, fleet, job_stream
from versus_jobs import FILLER_NAMESPACE, filler_pods, fleet_pools
from versus_results import SystemResult
from versus_watch import GangWatch, time_recovery

from testbed.cluster import Testbed
from testbed.kueue_queues import KueueQueues, queue_manifests
from testbed.nodes import apply_topology, wait_nodes_ready
from testbed.topology import node_manifest, parse_topology, plan_nodes


class Bench:
    """The private testbed, its fleet and fillers, and what each system run needs of them."""

    def __init__(self, bed: Testbed, api: client.ApiClient, args: argparse.Namespace) -> None:
        self.bed, self.api, self.args = bed, api, args
        self.core = client.CoreV1Api(api)
        self.topology = fleet(args.nodes, "v-")
        self.name = str(self.topology["name"])
        names = apply_topology(bed.kubeconfig, self.topology)
        self.node_count = len(names)
        wait_nodes_ready(bed.kubeconfig, names, timeout=900)
        nodes = [api.sanitize_for_serialization(n) for n in self.core.list_node().items]
        self.pools = fleet_pools(nodes)
        gpus = [(n.name, n.allocatable) for pool in self.pools.values() for n in pool]
        self.fillers = filler_pods(gpus, args.used, args.seed)
        make_namespace(api, FILLER_NAMESPACE)
        self.create_pods(self.fillers)
        self.shapes = job_stream(args.jobs, args.big_pods or big_gang_pods(args.nodes),
                                 args.interval, args.seed)  # fmt: skip
        self.least = {s.name: s.pods if s.min_data is None else s.pods * s.min_data // s.data
                      for s in self.shapes}  # fmt: skip
        self.victim = ""  # the job whose node is lost: set by the first system's run

    def create_pods(self, pods: Sequence[dict[str, Any]]) -> None:
        def create(pod: dict[str, Any]) -> None:
            with contextlib.suppress(client.ApiException):
                self.core.create_namespaced_pod(pod["metadata"]["namespace"], pod)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(create, pods))

    def listed(self) -> dict[str, int]:
        """What an operator watching the filler namespace lists at its start (nodes, GPU pods)."""
        fillers = self.core.list_namespaced_pod(FILLER_NAMESPACE).items
        return {"nodes": self.node_count, "pods": len(fillers)}

    def kill_node(self, node: str) -> None:
        self.core.delete_node(node)

    def restore_node(self, node: str) -> None:
        """The deleted node again, with its filler pods, so the next system starts the same."""
        plan = next(p for p in plan_nodes(parse_topology(self.topology)) if p.name == node)
        with contextlib.suppress(client.ApiException):
            self.core.create_node(node_manifest(plan, self.name))
        wait_nodes_ready(self.bed.kubeconfig, [node], timeout=120)
        self.create_pods([p for p in self.fillers if p["spec"]["nodeName"] == node])

    def queues(self, namespace: str) -> KueueQueues:
        return queue_manifests(parse_topology(self.topology), namespace, prefix="versus",
                               preference_orders=True)  # fmt: skip

    def run(self, system: str, namespace: str, job_label: str, index_label: str,
            create: Any) -> SystemResult:  # fmt: skip
        """Apply the stream with `create(shape)`, wait, measure, kill a node, time recovery."""
        watch = GangWatch(self.api, namespace, job_label, index_label, self.least)
        try:
            origin = time.monotonic()
            for shape in self.shapes:
                delay = origin + shape.at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                watch.applied(shape.name, time.time())
                create(shape)
            self._settle(watch)
            result = SystemResult(system, self.shapes, watch.snapshot(), self.pools)
            if not self.victim:  # the largest gang that ran, the same job for both systems
                ran = [s for s in self.shapes if s.name in result.placed]
                self.victim = (
                    max(ran, key=lambda s: len(result.placed[s.name].nodes)).name if ran else ""
                )
            gang = result.gangs.get(self.victim)
            if gang is not None and gang.running is not None:
                node = gang.nodes[min(gang.nodes)]
                result.recovery = time_recovery(
                    watch,
                    self.victim,
                    self.least[self.victim],
                    self.kill_node,
                    node,
                    self.args.recovery_timeout,
                )
                self.restore_node(node)
            return result
        finally:
            watch.close()

    def _settle(self, watch: GangWatch) -> None:
        deadline = time.monotonic() + self.args.timeout
        while time.monotonic() < deadline:
            gangs = watch.snapshot()
            if all(g.running is not None for g in gangs.values()):
                return
            if time.time() - watch.last_change > self.args.settle:
                return
            time.sleep(0.5)
