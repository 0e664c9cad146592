"""The fault classes issue 37 added to the nemesis (testbed.chaos.nemesis), as a mixin of it:

| class | mechanism |
|---|---|
| nodes-gone-operator-down | every operator replica SIGKILLed, 1-3 nodes deleted while none runs, the replicas started again after 3-10 s; the nodes re-created after the duration |
| roll-crash | a merge patch of one running job's `spec.training.rev` (the stand-in ignores it; the pods' spec changes, so the job rolls), then SIGUSR1 to the new gang's trainer as soon as it runs, before its first commit |
| credentials-deleted | the jobs' checkpoint Secret deleted and one running pod deleted (its replacement needs the Secret); the Secret re-created after the duration |
| checkpoint-tarpit | the S3 proxy relays every request for one job's keys to a `testbed.tarpit.Tarpit` (a 200 that trickles a byte every 0.5 s) for the duration |
| replica-slow-api | one replica's relay to the API server (testbed.tcpproxy) holds every chunk 0.3-3 s, both ways, for the duration: its Lease renewals and watch events arrive late |
| replica-clock-skew | one replica SIGKILLed and started again with its wall clock 30-600 s ahead (libfaketime, a test-boundary fake); with two replicas the true-clock holder is then SIGKILLed so the skewed one takes over; after the duration the skewed one is SIGKILLed and replaced by one on the true clock, which takes over what it wrote |
| replica-slow-job-watch | as replica-clock-skew, but the replica started again has its TrainingJob watch 1-8 s late (testbed/chaos/slow_watch.py, a test-boundary fake around kopf's watch stream) and its pod, node and Workload watches on time: it sees pods change before the status that changed with them (issue 37 item 1) |
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from testbed import faketime, faults
from testbed.chaos.catalogue import Fault, choose
from testbed.chaos.rig import replica_identity
from testbed.harness_stack import CREDENTIALS_SECRET
from testbed.tarpit import Tarpit

if TYPE_CHECKING:
    from testbed.chaos.rig import Rig

TEMPLATE = "topotrain.io/template"  # the pods' spec hash (topotrain.core.manifests)
ROLL_WAIT = 120.0  # seconds to wait for the rolled gang's trainer before giving up on the crash


class MoreFaults:
    """Needs the Nemesis's rig, stop event and helpers (`_record`, `_heal`, `_pick_node`, ...)."""

    rig: Rig
    _stop: threading.Event

    def _nodes_gone_operator_down(self, fault: Fault) -> None:
        nemesis: Any = self
        nodes = [n for n in (nemesis._pick_node(fault) for _ in range(1 + int(fault.size * 3))) if n]
        if not nodes:
            return nemesis._skip(fault, "no node to spare")
        try:
            began = time.monotonic()
            saved = [self.rig.core.read_node(n, _preload_content=False) for n in nodes]
            down = round(3 + 7 * fault.size, 1)
            # every job: no replica acts meanwhile (as operator-kill); `nodes` for the node's pods
            nemesis._record(fault, self.rig.job_names(), nodes=nodes, down=down)
            self.rig.stack.kill_all()
            try:
                for node in nodes:
                    self.rig.core.delete_node(node)
                self._stop.wait(down)
            finally:
                self.rig.stack.start_operator()
            if not self.rig.stack.wait_acting(timeout=300):
                self.rig.history.add("fault-error", index=fault.index, kind=fault.kind.value,
                                     error="no operator replica acted within 300 s")  # fmt: skip
            self._stop.wait(max(0.0, fault.duration - (time.monotonic() - began)))
            for raw in saved:
                self.rig.recreate_node(raw)
            nemesis._heal(fault)
        finally:
            nemesis._release(*nodes)

    def _roll_crash(self, fault: Fault) -> None:
        nemesis: Any = self
        running = [j for j in self.rig.job_names() if nemesis._runs(j)]
        job = choose(running, fault.pick)
        if job is None:
            return nemesis._skip(fault, "no running job")
        runs = nemesis._runs(job)
        before, old = {r.uid for r in runs}, self._template(runs[0].name)
        patched = self.rig.stack.custom.patch_namespaced_custom_object(
            "topotrain.io", "v1alpha1", self.rig.namespace, "trainingjobs", job,
            {"spec": {"training": {"rev": fault.index}}})  # fmt: skip
        nemesis._record(fault, [job], generation=patched["metadata"]["generation"])
        deadline = time.monotonic() + ROLL_WAIT
        while not self._stop.is_set() and time.monotonic() < deadline:
            # the first pod of the rolled gang whose trainer runs (the supervisor ignores SIGUSR1)
            rolled = [r for r in nemesis._runs(job) if r.uid not in before
                      and self._template(r.name) not in (None, old)]  # fmt: skip
            crashed = next((r for r in rolled if faults.signal_trainer(r.process.pid, signal.SIGUSR1)), None)
            if crashed is not None:
                self.rig.history.add("roll-crashed", index=fault.index, job=job, pod=crashed.name,
                                     attempt=crashed.attempt)  # fmt: skip
                break
            time.sleep(0.3)
        else:
            self.rig.history.add("roll-not-crashed", index=fault.index, job=job)  # the edit still counts
        nemesis._heal(fault)

    def _template(self, pod: str) -> str | None:
        try:
            meta = self.rig.core.read_namespaced_pod(pod, self.rig.namespace).metadata
        except Exception:  # gone already
            return None
        return str((meta.annotations or {}).get(TEMPLATE) or "") or None

    def _credentials_deleted(self, fault: Fault) -> None:
        nemesis: Any = self
        raw = self.rig.core.read_namespaced_secret(CREDENTIALS_SECRET, self.rig.namespace,
                                                   _preload_content=False)  # fmt: skip
        saved = json.loads(raw.data)
        pods = {p.metadata.name: p for p in nemesis._pods()}
        victim = choose(list(pods), fault.pick)
        nemesis._record(fault, self.rig.job_names(), secret=CREDENTIALS_SECRET, pod=victim)
        self.rig.core.delete_namespaced_secret(CREDENTIALS_SECRET, self.rig.namespace)
        try:
            if victim is not None:  # its replacement needs the Secret to start
                self.rig.core.delete_namespaced_pod(victim, self.rig.namespace)
            self._stop.wait(fault.duration)
        finally:
            body = {"metadata": {"name": CREDENTIALS_SECRET}, "type": saved.get("type", "Opaque"),
                    "data": saved.get("data") or {}}  # fmt: skip
            self.rig.core.create_namespaced_secret(self.rig.namespace, body)
        nemesis._heal(fault)

    def _checkpoint_tarpit(self, fault: Fault) -> None:
        nemesis: Any = self
        job = choose(self.rig.job_names(), fault.pick)
        if job is None:
            return nemesis._skip(fault, "no job")
        with Tarpit(interval=0.5) as tarpit:
            port = int(tarpit.url.rsplit(":", 1)[1])
            # the job's namespace shares the operator's store slots (storecalls.PER_NAMESPACE), and
            # the soak's jobs share one namespace: every job may wait on the tarpit's reads
            nemesis._record(fault, self.rig.job_names(), job=job)
            self.rig.proxy.set_tarpit(f"jobs/{self.rig.namespace}/{job}/", port)
            try:
                self._stop.wait(fault.duration)
            finally:
                self.rig.proxy.set_tarpit(None)
        nemesis._heal(fault)

    def _replica_slow_api(self, fault: Fault) -> None:
        nemesis: Any = self
        number = choose([str(n) for n in self.rig.stack.alive()], fault.pick)
        if number is None:
            return nemesis._skip(fault, "no replica")
        relay = self.rig.stack.relays[int(number)]
        delay = round(0.3 + 2.7 * fault.size, 2)
        nemesis._record(fault, self.rig.job_names(), replica=replica_identity(int(number)), delay=delay)
        relay.delay = delay
        try:
            self._stop.wait(fault.duration)
        finally:
            relay.delay = 0.0
        nemesis._heal_once_acting(fault)

    def _replica_clock_skew(self, fault: Fault) -> None:
        nemesis: Any = self
        if faketime.library() is None:
            return nemesis._skip(fault, "libfaketime not found (apt-get download libfaketime failed)")
        number = choose([str(n) for n in self.rig.stack.alive()], fault.pick)
        if number is None:
            return nemesis._skip(fault, "no replica")
        skew = round(30 + 570 * fault.size)
        nemesis._record(fault, self.rig.job_names(), replica=replica_identity(int(number)), skew=skew)
        self._acting_while(fault, int(number), "skewed-replica", skew=skew)

    def _replica_slow_job_watch(self, fault: Fault) -> None:
        nemesis: Any = self
        number = choose([str(n) for n in self.rig.stack.alive()], fault.pick)
        if number is None:
            return nemesis._skip(fault, "no replica")
        delay = round(1 + 7 * fault.size, 1)
        nemesis._record(fault, self.rig.job_names(), replica=replica_identity(int(number)), delay=delay)
        self._acting_while(fault, int(number), "slow-watch-replica", watch_delay=delay)

    def _acting_while(self, fault: Fault, number: int, what: str, **started: float) -> None:
        """Replace replica `number` by one started with `started` (start_operator's skew or
        watch_delay); with two replicas, the unchanged holder is then SIGKILLed so the changed one
        takes over, reading what the other wrote; after the duration the changed one is
        SIGKILLed and replaced by an unchanged one, which takes over what it wrote."""
        nemesis: Any = self
        stack = self.rig.stack
        stack.kill(number)
        stack.start_operator(**started)
        changed = min(stack.alive())  # the newest replica has the lowest number
        stack.wait_acting(timeout=300)
        holder = stack.holder()
        if holder is not None and holder != changed:
            self._stop.wait(3.0)  # its watches listed first
            stack.kill(holder)
            stack.start_operator()
            deadline = time.monotonic() + 120
            while stack.holder() != changed and time.monotonic() < deadline and not self._stop.wait(1.0):
                pass
        self.rig.history.add(what, index=fault.index, identity=replica_identity(changed),
                             acting=stack.holder() == changed)  # fmt: skip
        self._stop.wait(fault.duration)
        stack.kill(changed)
        stack.start_operator()
        nemesis._heal_once_acting(fault)
