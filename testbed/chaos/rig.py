"""Everything one soak runs on, set up and torn down in one place:

- a private testbed (its own directory, ports, etcd, kube-apiserver,
  controller manager, scheduler, KWOK and versitygw), so restarting its API
  server or stopping its S3 server never disturbs anyone else's tests;
- a GPU fleet of two pools sized to the number of concurrent jobs;
- the chaos proxy in front of versitygw: the operator and every trainer talk
  to S3 through it, the observer talks to versitygw directly;
- the chart, the operator as local processes (one, or two replicas electing a leader)
  and the pod process harness (testbed.harness_stack; the harness stands in
  for a kubelet's process execution, it is not a kubelet).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

from testbed import faketime
from testbed.binaries import REPO_ROOT
from testbed.chaos import slow_watch
from testbed.chaos.audit import policy, replica_address
from testbed.chaos.history import History, Observer
from testbed.chaos.queued import POOL as QUEUED_POOL
from testbed.chaos.queued import priority_class, queues
from testbed.chaos.s3proxy import S3Proxy
from testbed.chaos.tenant import tenant_namespace
from testbed.chaos.workload import Workload
from testbed.client import api_client, core_v1
from testbed.cluster import Testbed
from testbed.components import AUDIT_POLICY, KWOK_NODE_ANNOTATION, KWOK_NODE_VALUE
from testbed.harness_stack import CREDENTIALS_SECRET, S3Target, Stack
from testbed.kueue import KueueStack
from testbed.nodes import apply_topology, wait_nodes_ready
from testbed.procs import free_port, signal_group, wait_until
from testbed.tcpproxy import TcpProxy

# A test-boundary fake of a skewed wall clock: libfaketime (Debian's libfaketime, testbed/faketime.py)
# offsets CLOCK_REALTIME for one replica's process (time.time, datetime.now), never its monotonic clock.


class ChaosStack(Stack):
    """The Stack with operator replicas the nemesis can kill: one standalone, or two that elect
    a leader with the chart's Lease."""

    def __init__(self, *args: Any, replicas: int = 1, record: Any = None, **kwargs: Any) -> None:
        self.replicas = replicas
        self.record = record  # History.add, for the replicas started
        self.processes: list[tuple[int, subprocess.Popen[bytes]]] = []  # (replica number, process)
        self.relays: dict[int, TcpProxy] = {}  # each replica's own way to the API server
        self._next_priority = 1000
        super().__init__(*args, **kwargs)
        if replicas > 1:
            self.chart_values = {**self.chart_values, "leaderElection": {"enabled": True}}

    def start_operator(self, skew: float = 0.0, watch_delay: float = 0.0) -> None:
        """Start replicas until `replicas` run, each through a relay of its own (a source address
        the audit log names it by); the first one started with its wall clock `skew` s ahead, or
        with its TrainingJob watch `watch_delay` s late (testbed/chaos/slow_watch.py)."""
        self._reap()
        while len(self.processes) < self.replicas:
            argv, env = self.operator_command()
            priority, self._next_priority = self._next_priority, self._next_priority - 1
            original = Path(env["KUBECONFIG"])
            port = int(re.search(r"server:\s*https?://[^:/\s]+:(\d+)", original.read_text()).group(1))  # type: ignore[union-attr]
            relay = self.relays[priority] = TcpProxy(port, source=replica_address(priority)).start()
            env.update(KUBECONFIG=str(relay.kubeconfig(original, self.workdir / f"operator-{priority}.kubeconfig")),
                       TOPOTRAIN_IDENTITY=replica_identity(priority), TOPOTRAIN_METRICS_PORT=str(free_port()),
                       TOPOTRAIN_HEALTH_PORT=str(free_port()))  # fmt: skip
            if skew and (library := faketime.library()) is not None:
                env.update(LD_PRELOAD=str(library), FAKETIME=f"{skew:+.0f}", FAKETIME_DONT_FAKE_MONOTONIC="1")
            if watch_delay:
                argv = [sys.executable, "-m", "testbed.chaos.slow_watch", *argv]
                env.update(PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]),
                           **{slow_watch.DELAY: str(watch_delay)})  # fmt: skip
            with (self.workdir / f"operator-{priority}.log").open("ab") as log:
                proc = subprocess.Popen(argv, env=env, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            self.processes.append((priority, proc))
            if self.record is not None:
                self.record("replica", number=priority, identity=replica_identity(priority), pid=proc.pid,
                            address=replica_address(priority), skew=skew, watch_delay=watch_delay,
                            lease=env.get("TOPOTRAIN_LEASE_NAME"))  # fmt: skip
            skew = watch_delay = 0.0

    def _reap(self) -> None:
        """Forget dead replicas; close their relays."""
        for number, proc in self.processes:
            if proc.poll() is not None and number in self.relays:
                self.relays.pop(number).cut()
        self.processes = [(p, proc) for p, proc in self.processes if proc.poll() is None]

    def alive(self) -> list[int]:
        return sorted(p for p, proc in self.processes if proc.poll() is None)

    def kill(self, number: int) -> None:
        for p, proc in self.processes:
            if p == number and proc.poll() is None:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        self._reap()

    def kill_acting(self) -> None:
        """SIGKILL the replica that acts (the Lease's holder; else the newest alive), as a node
        death would."""
        alive = [(p, proc) for p, proc in self.processes if proc.poll() is None]
        if alive:
            holder = self._lease_holder() if self.replicas > 1 else None
            _, proc = next(((p, proc) for p, proc in alive if replica_identity(p) == holder),
                           max(alive, key=lambda item: item[0]))
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()

    def kill_all(self) -> None:
        """SIGKILL every replica (none acts until start_operator)."""
        for _, proc in self.processes:
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()

    def holder(self) -> int | None:
        """The live replica holding the Lease (None: none, or one replica without a Lease)."""
        alive = set(self.alive())
        return acting_replica(self._lease_holder(), alive) if self.replicas > 1 else None

    def acting(self) -> bool:
        """True once a live replica acts: the Lease's holder is a live replica (a SIGKILLed
        replica stays the holder until the standby has seen its Lease unrenewed for the
        Lease's duration, and until then nobody acts)."""
        alive = {p for p, proc in self.processes if proc.poll() is None}
        if self.replicas < 2:
            return bool(alive)
        return acting_replica(self._lease_holder(), alive) is not None

    def _lease_holder(self) -> str | None:
        _, env = self.operator_command()
        try:
            lease = self.custom.get_namespaced_custom_object(
                "coordination.k8s.io", "v1", env["TOPOTRAIN_LEASE_NAMESPACE"], "leases",
                env["TOPOTRAIN_LEASE_NAME"])
        except Exception:  # absent, or the API server is down (another fault): no known holder
            return None
        return str((lease.get("spec") or {}).get("holderIdentity") or "") or None

    def wait_acting(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.acting():
                return True
            time.sleep(1.0)
        return False

    def stop_operator(self) -> None:
        for _, proc in self.processes:
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGTERM)
        for _, proc in self.processes:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        self.processes = []
        for relay in self.relays.values():
            relay.cut()
        self.relays = {}

    def operator_alive(self) -> bool:
        return any(proc.poll() is None for _, proc in self.processes)

    def operator_pids(self) -> list[int]:
        return [proc.pid for _, proc in self.processes if proc.poll() is None]

    def operator_log(self, lines: int = 40) -> str:
        logs = sorted(self.workdir.glob("operator-*.log"))
        text = logs[0].read_text(errors="replace") if logs else ""
        return "\n".join(text.splitlines()[-lines:])


def replica_identity(number: int) -> str:
    """The Lease identity of the soak's operator replica `number` (TOPOTRAIN_IDENTITY)."""
    return f"operator-{number}"


def acting_replica(holder: str | None, alive: set[int]) -> int | None:
    """The replica that acts: the Lease's holder, if it is a live replica of this soak."""
    return next((n for n in alive if replica_identity(n) == holder), None)


def fleet(jobs: int, kueue: bool = False) -> dict[str, Any]:
    """Two pools with room for `jobs` concurrent jobs of the workload's shapes and some to spare;
    with `kueue`, the queued jobs' pool too (testbed/chaos/queued.py)."""
    racks = max(2, (jobs + 3) // 4)
    queued = [dict(QUEUED_POOL)] if kueue else []
    return {"name": "chaos", "pools": [
        {"name": "chaos-h100", "product": "H100-80GB", "gpusPerNode": 8, "blocks": 1,
         "racksPerBlock": racks, "nodesPerRack": 2, "nvlinkDomainNodes": 1},
        {"name": "chaos-a100", "product": "A100-80GB", "gpusPerNode": 8, "blocks": 1,
         "racksPerBlock": max(1, racks // 2), "nodesPerRack": 2, "nvlinkDomainNodes": 1},
        *queued,
    ]}  # fmt: skip


class Rig:
    def __init__(self, workdir: Path, seed: int, jobs: int, replicas: int = 1, kueue: bool = False) -> None:
        self.workdir = workdir.resolve()
        self.seed = seed
        self.jobs = jobs
        self.replicas = replicas
        self.bed = Testbed(self.workdir / "testbed")
        self.namespace = f"chaos-{uuid.uuid4().hex[:6]}"
        self.tenant = tenant_namespace(self.namespace)  # the other tenant (testbed/chaos/tenant.py)
        self.history = History(self.workdir / "history.jsonl")
        self.node_names: list[str] = []
        self.pools = ("H100-80GB", "A100-80GB")
        self.kueue_on = kueue  # the real Kueue beside the operator, queued jobs and kueue-preempt
        # the chart's bound on a checkpoint-first stop (an eviction's, invariant 14)
        chart = yaml.safe_load((REPO_ROOT / "charts" / "topotrain" / "values.yaml").read_text())
        self.checkpoint_request_timeout = float(chart["operator"]["checkpointRequestTimeoutSeconds"])
        self._api: Any = None
        self.workload: Workload

    @property
    def kubeconfig(self) -> Path:
        return self.bed.kubeconfig

    @property
    def core(self) -> Any:
        return core_v1(self._api)

    def __enter__(self) -> Rig:
        try:
            return self._set_up()
        except BaseException:
            self.__exit__()  # a half-made rig leaves no process behind
            raise

    def _set_up(self) -> Rig:
        started = time.monotonic()
        self.bed.root.mkdir(parents=True, exist_ok=True)
        (self.bed.root / AUDIT_POLICY).write_text(policy(self.namespace))  # read as kube-apiserver starts
        self.bed.up()
        self.node_names = apply_topology(self.kubeconfig, fleet(self.jobs, self.kueue_on))
        wait_nodes_ready(self.kubeconfig, self.node_names, timeout=300)
        self._api = api_client(self.kubeconfig)
        for namespace in (self.namespace, self.tenant):  # both before the chart makes their Roles
            self.core.create_namespace({"metadata": {"name": namespace}})
        wait_until(lambda: bool(self.core.list_namespaced_service_account(
            self.namespace, field_selector="metadata.name=default").items), timeout=120,
            what="the namespace's default ServiceAccount")  # fmt: skip
        if self.kueue_on:  # before the operator starts: it watches Workloads if their CRD exists then
            self.kueue = KueueStack(self.bed)
            self.kueue.start()
        server = self.bed.s3
        self.bucket = server.create_bucket(f"chaos-{self.seed % 100000}-{uuid.uuid4().hex[:4]}")
        host, port = server.endpoint.removeprefix("http://").split(":")
        self.proxy = S3Proxy(host, int(port), seed=self.seed).start()
        target = S3Target(self.proxy.endpoint, server.access_key, server.secret_key, self.bucket)
        both = [self.namespace, self.tenant]  # one operator watches the soak and the other tenant
        values = {"watchNamespaces": both,
                  "rbac": {"checkpointSecrets": [{"namespace": n, "names": [CREDENTIALS_SECRET]} for n in both]}}
        self.stack = ChaosStack(self.kubeconfig, self.namespace, self.workdir / "stack", target,
                                chart_values=values, replicas=self.replicas,
                                record=self.history.add).__enter__()  # fmt: skip
        if self.kueue_on:
            self.kueue.apply([priority_class(), *queues(self.namespace).manifests()])
            self.kueue.wait_cluster_queue_active(queues(self.namespace).cluster_queue)
        secret = self.core.read_namespaced_secret(CREDENTIALS_SECRET, self.namespace)
        self.core.create_namespaced_secret(self.tenant, {"metadata": {"name": CREDENTIALS_SECRET},
                                                         "data": secret.data})  # fmt: skip
        self.observer = Observer(
            self.history, self.core, self.stack.custom, self.namespace, server.client(),
            self.bucket, f"jobs/{self.namespace}/", self.stack.operator_pids,
            interval=1.0 if self.jobs <= 8 else 2.0, workloads=self.kueue_on,
        ).start()
        self.setup_seconds = time.monotonic() - started
        return self

    def __exit__(self, *_: object) -> None:
        for owner, step in (("observer", "stop"), ("stack", "__exit__"), ("kueue", "stop"), ("proxy", "stop")):
            if not hasattr(self, owner):
                continue
            try:
                getattr(getattr(self, owner), step)()
            except Exception as err:  # tear down the rest regardless
                print(f"chaos rig teardown: {type(err).__name__}: {err}")
        if self._api is not None:
            self._api.close()
        self.bed.down()

    # --- helpers the nemesis uses --------------------------------------------------

    def job_names(self) -> list[str]:
        return self.workload.job_names()

    def recreate_node(self, raw: Any) -> None:
        """Create a deleted node again from its saved object: same labels and GPUs, KWOK's again."""
        node = json.loads(raw.data)
        labels = {k: v for k, v in (node["metadata"].get("labels") or {}).items() if "stage.kwok" not in k}
        resources = {k: node["status"][k] for k in ("allocatable", "capacity")}
        annotations = {KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE, "node.alpha.kubernetes.io/ttl": "0"}
        body = {"apiVersion": "v1", "kind": "Node", "spec": {}, "status": resources,
                "metadata": {"name": node["metadata"]["name"], "labels": labels, "annotations": annotations}}  # fmt: skip
        for _ in range(60):
            try:
                self.core.create_node(body)
                return
            except ApiException as err:  # the old object may still be finishing its deletion
                if err.status != 409:
                    raise
                time.sleep(1)

    def machine_load(self) -> tuple[float, float, float]:
        return os.getloadavg()
