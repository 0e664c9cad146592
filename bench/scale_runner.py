"""The operator under test in bench/scale.py, and the CRD and namespace it serves.

The operator runs as users run it: `topotrain run --standalone --namespace NS`
in a subprocess of its own session (so stopping its group leaves nothing
behind), with the settings' defaults (no TOPOTRAIN_* variable is passed on),
its metrics on a free port and its log in the testbed's logs/ folder.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any, cast

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from scale_probes import (
    GROUP,
    PLURAL,
    VERSION,
    HealthProbe,
    ProbeSettings,
    RequestCounter,
    histogram_quantile,
    metrics_ready,
    proc_usage,
    scrape_counter,
    scrape_counter_by,
    scrape_histogram,
)

from testbed.cluster import Testbed
from testbed.procs import ManagedProcess, free_port

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "topotrain.io_trainingjobs.yaml"
RECONCILE = "topotrain_reconcile_seconds"
WATCH_EVENTS = "topotrain_watch_events_total"
CHART_VALUES = REPO / "charts" / "topotrain" / "values.yaml"
PASS_LINE = re.compile(r"\(observe\+decide ([\d.]+)s, status ([\d.]+)s, act ([\d.]+)s\)")
# A pass over the operator's SLOW_PASS_SECONDS that changed no pods (controller/loop.py).
SLOW_LINE = re.compile(r"slow pass, phase \w*: ([\d.]+)s \(observe\+decide ([\d.]+)s, status ([\d.]+)s, "
                       r"act ([\d.]+)s\) observe ([\d.]+)s, plan lock wait ([\d.]+)s")
# What kopf watches once its initial lists are in: the indexes are filled, jobs are served.
WATCHES = (("watch", "nodes"), ("watch", "pods"), ("watch", "trainingjobs"))


def install_crd(api: client.ApiClient) -> None:
    """Create the generated CRD (or keep the one there) and wait until it is Established."""
    ext = client.ApiextensionsV1Api(api)
    body = yaml.safe_load(CRD.read_text())
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as exc:
        if exc.status != 409:
            raise
    name = body["metadata"]["name"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = ext.read_custom_resource_definition(name).status
        conditions = (status.conditions if status else None) or []
        if any(c.type == "Established" and c.status == "True" for c in conditions):
            return
        time.sleep(0.2)
    raise TimeoutError(f"CRD {name} not Established after 60s")


def make_namespace(api: client.ApiClient, name: str) -> None:
    """A namespace, once its default ServiceAccount exists (pods are admitted only then)."""
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    deadline = time.monotonic() + 60
    while not core.list_namespaced_service_account(name, field_selector="metadata.name=default").items:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no default ServiceAccount in {name}: is kube-controller-manager running?")
        time.sleep(0.2)


def remove_namespace(api: client.ApiClient, name: str, timeout: float = 180.0) -> None:
    """Delete the namespace and wait until it is gone, so the next fleet starts clean.

    The operator is stopped by now, so the jobs' kopf finalizers are taken off here.
    """
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    jobs = cast(dict[str, Any], custom.list_namespaced_custom_object(GROUP, VERSION, name, PLURAL))
    for job in jobs["items"]:
        try:
            custom.patch_namespaced_custom_object(GROUP, VERSION, name, PLURAL, job["metadata"]["name"],
                                                  {"metadata": {"finalizers": None}})
        except ApiException as exc:
            if exc.status != 404:
                raise
    core.delete_namespace(name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(name)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        time.sleep(1.0)
    print(f"namespace {name} still terminating after {timeout:.0f}s", file=sys.stderr)


class OperatorRun:
    """`topotrain run` for one namespace, reached through the counting proxy when there is one."""

    def __init__(self, bed: Testbed, namespace: str, proxy: RequestCounter | None,
                 pod_binding: str = "scheduler") -> None:
        self.bed, self.namespace, self.proxy = bed, namespace, proxy
        self.pod_binding = pod_binding
        self.process = ManagedProcess(f"operator-{namespace}", bed.root)
        self.metrics_port, self.health_port = free_port(), free_port()
        self.health: HealthProbe | None = None
        self.started_s = float("nan")  # start -> serving every watch

    def start(self, timeout: float, listed: dict[str, int] | None = None) -> None:
        """Start it and wait until it serves. `listed` (resource -> objects it will list, as
        `topotrain_watch_events_total` labels them: nodes, pods) also waits until it has handled
        that many events of each, its start-up listing: a deployed operator has long done that
        when jobs arrive, as Kueue has synced its caches once its ClusterQueues are active."""
        kubeconfig = self.bed.kubeconfig
        if self.proxy is not None:
            kubeconfig = self.proxy.kubeconfig(self.bed.root / f"operator-{self.namespace}.kubeconfig")
        path = os.pathsep.join(filter(None, [str(REPO / "operator"), os.environ.get("PYTHONPATH")]))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOPOTRAIN_")}
        env.update(KUBECONFIG=str(kubeconfig), PYTHONPATH=path)
        self.process.start(
            [sys.executable, "-m", "topotrain.cli", "run", "--standalone", "--namespace", self.namespace,
             "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port),
             "--pod-binding", self.pod_binding],
            env=env, cwd=REPO,
        )
        began = time.monotonic()
        self.health = HealthProbe(self.health_port, ProbeSettings.from_chart(CHART_VALUES))
        deadline = began + timeout
        while not self._serving():
            if not self.process.running():
                raise RuntimeError(f"the operator exited; log {self.process.log_file}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the operator did not start in {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.25)
        self.started_s = time.monotonic() - began
        if listed:
            while not self._listed(listed):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the operator did not list {listed} in {timeout:.0f}s")
                time.sleep(0.5)
        elif self.proxy is None:
            time.sleep(5.0)  # no view of its watches: give its initial lists time

    def _listed(self, listed: dict[str, int]) -> bool:
        try:
            seen = scrape_counter_by(self.metrics_port, WATCH_EVENTS)
        except OSError:
            return False
        return all(seen.get(f'resource="{resource}"', 0.0) >= count for resource, count in listed.items())


    def watch_events(self) -> float:
        """Watch events the operator has handled so far."""
        try:
            return scrape_counter(self.metrics_port, WATCH_EVENTS)
        except OSError:
            return float("nan")

    def _serving(self) -> bool:
        if not metrics_ready(self.metrics_port):
            return False
        if self.proxy is None:
            return True
        counts = self.proxy.snapshot()
        return all(counts[key] for key in WATCHES)

    def usage(self) -> tuple[float, float]:
        """(CPU seconds so far, peak RSS MiB) of the operator process."""
        pid = self.process.pid()
        if pid is None:
            return float("nan"), float("nan")
        return proc_usage(pid)

    def reconcile_quantiles(self) -> tuple[float, float, float]:
        """(p50, p99, count) of the operator's reconcile passes, in seconds."""
        try:
            buckets, count, _ = scrape_histogram(self.metrics_port, RECONCILE)
        except OSError:  # the operator died: its log says why
            return float("nan"), float("nan"), float("nan")
        return histogram_quantile(0.5, buckets), histogram_quantile(0.99, buckets), count

    def pass_phases(self) -> dict[str, list[float]]:
        """Seconds of the passes that changed pods, by phase, from the operator's INFO log lines."""
        return self._logged(PASS_LINE, ("observe+decide", "status", "act"))

    def slow_passes(self) -> dict[str, list[float]]:
        """Seconds of the passes over a second that changed no pods, by phase (the operator's log)."""
        return self._logged(SLOW_LINE, ("pass", "observe+decide", "status", "act", "observe", "plan lock wait"))

    def _logged(self, line: re.Pattern[str], names: tuple[str, ...]) -> dict[str, list[float]]:
        """The figures of every `line` in the operator's log, by name (in the line's group order)."""
        phases: dict[str, list[float]] = {name: [] for name in names}
        try:
            text = self.process.log_file.read_text(errors="replace")
        except OSError:
            return phases
        for match in line.finditer(text):
            for name, value in zip(names, match.groups(), strict=True):
                phases[name].append(float(value))
        return phases

    def stop(self) -> None:
        if self.health is not None:
            self.health.close()
        self.process.stop()

    def tail(self, lines: int = 20) -> str:
        return self.process.tail(lines)
