"""The nemesis: turns a schedule (testbed.chaos.catalogue) into faults through
real mechanisms, and records each one (start, targets, the jobs it touches,
its end) in the history.

| class | mechanism |
|---|---|
| trainer-crash | SIGUSR1 to one rank's process group: the stand-in exits 1, the harness reports it |
| pod-deleted | DELETE of one Running pod |
| node-not-ready | KWOK's NotReady stage (testbed.faults), Ready again after the duration |
| node-deleted | the Node object deleted (its pods garbage-collected), re-created after the duration |
| node-flap | the node's lease taken by a silent holder, given back to KWOK before the 40 s grace period ends |
| bad-node | every process started on the node crashes 2 s later, for the duration |
| trainer-hang | SIGSTOP to one rank's process group (the harness SIGCONTs it when the pod goes) |
| s3-down | versitygw stopped, started after the duration |
| s3-slow, s3-errors | the chaos proxy adds latency / answers 503 to a share of requests |
| apiserver-restart | kube-apiserver stopped and started again |
| operator-kill | SIGKILL to the operator, started again after the duration |
| operator-failover | SIGKILL to the acting replica of two; a new standby is started |
| capacity-loss | 1-3 nodes of one pool deleted at once, re-created after the duration |
| scale | `kubectl scale` of an elastic job right after one of its ranks crashed |
| quota | a ResourceQuota allowing no new pod, right before a rank crashes |
| job-deleted | a job deleted one second after one of its pods was |

The classes issue 37 added are in testbed.chaos.nemesis_more and, for the other tenant's
tarpit and Kueue's preemption, testbed.chaos.tenant and testbed.chaos.queued (mixins of this
class).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from testbed import faults
from testbed.chaos.catalogue import CALM, GLOBAL, Fault, choose
from testbed.chaos.nemesis_more import MoreFaults
from testbed.chaos.queued import KueueFaults
from testbed.chaos.tenant import TenantFaults
from testbed.procs import signal_group

if TYPE_CHECKING:
    from testbed.chaos.rig import Rig

QUOTA_NAME = "chaos-quota"
BAD_NODE_DELAY = 2.0


class Nemesis(MoreFaults, TenantFaults, KueueFaults):
    def __init__(self, rig: Rig, schedule: list[Fault], calm: float = CALM) -> None:
        self.rig = rig
        self.schedule = schedule
        self.calm = calm
        self._global = threading.Lock()  # one global fault at a time, `calm` after the last healed
        self._global_healed = 0.0
        self.hurt_nodes: set[str] = set()
        self.bad_nodes: set[str] = set()
        self._crashed: set[str] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    # --- driving ------------------------------------------------------------

    def run(self, start: float) -> None:
        """Fire every fault at its offset from `start` (time.time()); returns once all have ended."""
        threading.Thread(target=self._bad_node_loop, daemon=True).start()
        for fault in self.schedule:
            delay = start + fault.at - time.time()
            if delay > 0 and self._stop.wait(delay):
                break
            thread = threading.Thread(target=self._fire, args=(fault,), daemon=True)
            thread.start()
            self._threads.append(thread)
        for thread in self._threads:
            thread.join()
        self._stop.set()

    def _fire(self, fault: Fault) -> None:
        if fault.kind not in GLOBAL:
            self._inject(fault)
            return
        # The schedule spaces global faults by their nominal durations; an operator fault truly
        # ends only when a replica acts again, so a late heal pushes the next global fault back.
        with self._global:
            wait = self._global_healed + self.calm - time.time()
            if wait > 0 and self._stop.wait(wait):
                return
            try:
                self._inject(fault)
            finally:
                self._global_healed = time.time()

    def _inject(self, fault: Fault) -> None:
        handler = getattr(self, "_" + fault.kind.value.replace("-", "_"))
        try:
            handler(fault)
        except Exception as err:  # a fault that could not be injected is recorded, not hidden
            self.rig.history.add("fault-error", index=fault.index, kind=fault.kind.value,
                                 error=f"{type(err).__name__}: {err}"[:300])  # fmt: skip

    def _record(self, fault: Fault, jobs: list[str], **targets: Any) -> None:
        self.rig.history.add("fault", index=fault.index, kind=fault.kind.value, jobs=sorted(set(jobs)),
                             duration=fault.duration, **targets)  # fmt: skip

    def _skip(self, fault: Fault, why: str) -> None:
        self.rig.history.add("fault-skipped", index=fault.index, kind=fault.kind.value, why=why)

    def _heal(self, fault: Fault) -> None:
        self.rig.history.add("heal", index=fault.index, kind=fault.kind.value)

    def _heal_once_acting(self, fault: Fault) -> None:
        """An operator fault ends when a replica acts again, not when one is started: the calm
        before the next global fault starts then, so kills cannot outrun a standby's takeover."""
        if not self.rig.stack.wait_acting(timeout=300):
            self.rig.history.add("fault-error", index=fault.index, kind=fault.kind.value,
                                 error="no operator replica acted within 300 s")  # fmt: skip
        self._heal(fault)

    # --- targets --------------------------------------------------------------

    def _runs(self, job: str | None = None) -> list[Any]:
        assert self.rig.stack.harness is not None
        return [r for r in self.rig.stack.harness.running(self.rig.namespace, job) if not r.frozen]

    def _pods(self) -> list[Any]:
        pods = self.rig.core.list_namespaced_pod(self.rig.namespace, label_selector="topotrain.io/job").items
        return [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]

    def _jobs_on(self, node: str) -> list[str]:
        return [p.metadata.labels["topotrain.io/job"] for p in self._pods() if p.spec.node_name == node]

    def _pick_node(self, fault: Fault, pool: str | None = None) -> str | None:
        """A node not already hurt, preferring nodes that run job pods; at most a third hurt at once."""
        nodes = [n for n in self.rig.core.list_node().items
                 if pool is None or n.metadata.labels.get("nvidia.com/gpu.product") == pool]  # fmt: skip
        with self._lock:
            if len(self.hurt_nodes) * 3 >= len(self.rig.node_names):
                return None
            free = [n.metadata.name for n in nodes if n.metadata.name not in self.hurt_nodes]
            busy = {p.spec.node_name for p in self._pods()} & set(free)
            node = choose(sorted(busy) or free, fault.pick)
            if node is not None:
                self.hurt_nodes.add(node)
            return node

    def _release(self, *nodes: str) -> None:
        with self._lock:
            self.hurt_nodes.difference_update(nodes)

    def _crash(self, run: Any) -> None:
        """The trainer process fails, not the pod: its workers, children of the supervisor."""
        if not faults.signal_trainer(run.process.pid, signal.SIGUSR1):
            signal_group(run.pgid, signal.SIGUSR1)

    # --- the classes ------------------------------------------------------------

    def _trainer_crash(self, fault: Fault) -> None:
        runs = {f"{r.job}/{r.name}": r for r in self._runs()}
        chosen = choose(list(runs), fault.pick)
        if chosen is None:
            return self._skip(fault, "no running rank")
        self._record(fault, [runs[chosen].job], pod=runs[chosen].name)
        self._crash(runs[chosen])

    def _pod_deleted(self, fault: Fault) -> None:
        pods = {p.metadata.name: p for p in self._pods()}
        chosen = choose(list(pods), fault.pick)
        if chosen is None:
            return self._skip(fault, "no running pod")
        self._record(fault, [pods[chosen].metadata.labels["topotrain.io/job"]], pod=chosen)
        self.rig.core.delete_namespaced_pod(chosen, self.rig.namespace)

    def _node_not_ready(self, fault: Fault) -> None:
        node = self._pick_node(fault)
        if node is None:
            return self._skip(fault, "no node to spare")
        try:
            self._record(fault, self._jobs_on(node), node=node)
            faults.node_not_ready(self.rig.kubeconfig, node)
            self._stop.wait(fault.duration)
            faults.node_ready(self.rig.kubeconfig, node)
            self._heal(fault)
        finally:
            self._release(node)

    def _node_flap(self, fault: Fault) -> None:
        node = self._pick_node(fault)
        if node is None:
            return self._skip(fault, "no node to spare")
        try:
            self._record(fault, self._jobs_on(node), node=node)
            faults.node_unreachable(self.rig.kubeconfig, node)
            self._stop.wait(fault.duration)
            # Back before the grace period ends (faults.node_ready expires the lease instead,
            # which the controller manager reads as a dead node).
            faults.node_reachable(self.rig.kubeconfig, node, self.rig.bed.settings().node_lease_seconds)
            self._heal(fault)
        finally:
            self._release(node)

    def _delete_nodes(self, fault: Fault, nodes: list[str]) -> None:
        saved = [self.rig.core.read_node(n, _preload_content=False) for n in nodes]
        jobs = [j for n in nodes for j in self._jobs_on(n)]
        self._record(fault, jobs, nodes=nodes)
        for node in nodes:
            self.rig.core.delete_node(node)
        self._stop.wait(fault.duration)
        for raw in saved:
            self.rig.recreate_node(raw)
        self._heal(fault)

    def _node_deleted(self, fault: Fault) -> None:
        node = self._pick_node(fault)
        if node is None:
            return self._skip(fault, "no node to spare")
        try:
            self._delete_nodes(fault, [node])
        finally:
            self._release(node)

    def _capacity_loss(self, fault: Fault) -> None:
        pool = choose(sorted(self.rig.pools), fault.size)
        nodes = [n for n in (self._pick_node(fault, pool) for _ in range(1 + int(fault.size * 3))) if n]
        if not nodes:
            return self._skip(fault, "no node to spare")
        try:
            self._delete_nodes(fault, nodes)
        finally:
            self._release(*nodes)

    def _bad_node(self, fault: Fault) -> None:
        node = self._pick_node(fault)
        if node is None:
            return self._skip(fault, "no node to spare")
        self._record(fault, self._jobs_on(node), node=node)
        with self._lock:
            self.bad_nodes.add(node)
        self._stop.wait(fault.duration)
        with self._lock:
            self.bad_nodes.discard(node)
        self._release(node)
        self._heal(fault)

    def _bad_node_loop(self) -> None:
        first_seen: dict[str, float] = {}
        while not self._stop.wait(0.5):
            with self._lock:
                bad = set(self.bad_nodes)
            for run in self._runs():
                if run.node in bad and run.uid not in self._crashed:
                    seen = first_seen.setdefault(run.uid, time.monotonic())
                    if time.monotonic() - seen >= BAD_NODE_DELAY:
                        self._crashed.add(run.uid)
                        self.rig.history.add("bad-node-crash", node=run.node, job=run.job, pod=run.name)
                        self._crash(run)

    def _trainer_hang(self, fault: Fault) -> None:
        runs = {f"{r.job}/{r.name}": r for r in self._runs()}
        chosen = choose(list(runs), fault.pick)
        if chosen is None:
            return self._skip(fault, "no running rank")
        run = runs[chosen]
        self._record(fault, [run.job], pod=run.name)
        run.frozen = True  # the harness then SIGCONTs it when it terminates the pod
        # The trainer's ranks hang; the pod's supervisor stays up (it can restart them in place).
        if not faults.signal_trainer(run.process.pid, signal.SIGSTOP):
            signal_group(run.pgid, signal.SIGSTOP)

    def _s3_down(self, fault: Fault) -> None:
        self._record(fault, self.rig.job_names())
        self.rig.bed.s3.stop()
        self._stop.wait(fault.duration)
        self.rig.bed.s3.start()
        self._heal(fault)

    def _s3_slow(self, fault: Fault) -> None:
        latency = round(0.2 + 1.3 * fault.size, 2)
        self._record(fault, self.rig.job_names(), latency=latency)
        self.rig.proxy.set(latency=latency)
        self._stop.wait(fault.duration)
        self.rig.proxy.set(latency=0.0)
        self._heal(fault)

    def _s3_errors(self, fault: Fault) -> None:
        share = round(0.2 + 0.5 * fault.size, 2)
        self._record(fault, self.rig.job_names(), share=share)
        self.rig.proxy.set(error_share=share)
        self._stop.wait(fault.duration)
        self.rig.proxy.set(error_share=0.0)
        self._heal(fault)

    def _apiserver_restart(self, fault: Fault) -> None:
        self._record(fault, self.rig.job_names())
        self.rig.bed.process("kube-apiserver").stop()
        self.rig.bed.start_again("kube-apiserver")
        self._heal(fault)

    def _operator_kill(self, fault: Fault) -> None:
        self._record(fault, self.rig.job_names())
        self.rig.stack.kill_acting()
        self._stop.wait(fault.duration)
        self.rig.stack.start_operator()
        self._heal_once_acting(fault)

    def _operator_failover(self, fault: Fault) -> None:
        if self.rig.stack.replicas < 2:
            return self._skip(fault, "one operator replica")
        self._record(fault, self.rig.job_names())
        self.rig.stack.kill_acting()
        self.rig.stack.start_operator()  # the new replica waits as the standby
        self._heal_once_acting(fault)

    def _scale(self, fault: Fault) -> None:
        elastic = [j for j in self.rig.job_names() if self.rig.workload.shape_of(j).min_data]
        job = choose(elastic, fault.pick)
        if job is None:
            return self._skip(fault, "no elastic job")
        shape = self.rig.workload.shape_of(job)
        degree = shape.min_data + int(fault.size * (shape.data - shape.min_data + 1))
        runs = self._runs(job)
        self._record(fault, [job], replicas=min(degree, shape.data))
        if runs:
            self._crash(choose_run(runs, fault.size))
        time.sleep(1.0)
        self.rig.stack.kubectl("scale", f"trainingjobs/{job}", f"--replicas={min(degree, shape.data)}",
                               "-n", self.rig.namespace)  # fmt: skip

    def _quota(self, fault: Fault) -> None:
        pods = self.rig.core.list_namespaced_pod(self.rig.namespace).items
        live = [p for p in pods if p.status.phase not in ("Succeeded", "Failed")]
        quota = {"metadata": {"name": QUOTA_NAME}, "spec": {"hard": {"pods": str(len(live))}}}
        runs = self._runs()
        victim = choose_run(runs, fault.pick) if runs else None
        self._record(fault, [victim.job] if victim else [], pods=len(live))
        self.rig.core.create_namespaced_resource_quota(self.rig.namespace, quota)
        if victim is not None:
            self._crash(victim)
        self._stop.wait(fault.duration)
        self.rig.core.delete_namespaced_resource_quota(QUOTA_NAME, self.rig.namespace)
        self._heal(fault)

    def _job_deleted(self, fault: Fault) -> None:
        pods = {p.metadata.name: p for p in self._pods()}
        chosen = choose(list(pods), fault.pick)
        if chosen is None:
            return self._skip(fault, "no running pod")
        job = pods[chosen].metadata.labels["topotrain.io/job"]
        self._record(fault, [job], pod=chosen)
        self.rig.core.delete_namespaced_pod(chosen, self.rig.namespace)
        time.sleep(1.0)
        self.rig.workload.delete(job)


def choose_run(runs: list[Any], pick: float) -> Any:
    ordered = sorted(runs, key=lambda r: (r.job, r.name))
    return ordered[min(int(pick * len(ordered)), len(ordered) - 1)]

