"""Kueue (with topology-aware scheduling) and, optionally, JobSet as local processes beside a
running testbed, for the Kueue tests and bench/versus.py.

Both managers run out of cluster with the testbed's admin kubeconfig (no RBAC is exercised),
leader election off, their own certificate management off and serving certificates for
127.0.0.1 signed by the testbed CA. The API server reaches their webhooks through
`clientConfig.url` with that CA, registered only once the manager answers /readyz and
deleted again by `stop()`, so a stopped stack never leaves webhooks that fail requests. Only
the webhooks of Kueue's own objects and of JobSets are registered: Kueue's pod webhook
serves its plain-pod integration, not TAS (Kueue writes the `kueue.x-k8s.io/topology`
scheduling gate into the pod templates of the JobSet it unsuspends, and its ungater, a
controller, removes it), and JobSet's pod webhooks only serve exclusive placement. Kueue's
JobSet webhooks see only JobSets carrying a queue label, so other JobSets are left alone.

The CRDs come from the module cache, copied by `testbed/build.sh kueue jobset` into
`~/.cache/topotrain/share/{kueue,jobset}-crds-<version>/`. Upstream Kueue reads a metrics
certificate from the fixed path /etc/kueue/metrics/certs even with metrics off; the testbed's
build reads it from metrics-certs/ under its working directory instead (testbed/gogroups.sh), and
`start()` puts the testbed's serving certificate there: nothing is written outside the state
directory.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from testbed.binaries import BUILD_SCRIPT, binary, cache_dir, versions
from testbed.pki import ensure_serving_cert
from testbed.procs import ManagedProcess, file_lock, free_port, wait_until

if TYPE_CHECKING:
    from testbed.cluster import Testbed

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_NAMESPACE = "kueue-system"
# Where testbed/build.sh's Kueue reads its metrics certificate: relative to its working
# directory (upstream's fixed /etc/kueue/metrics/certs would change the host).
METRICS_CERT_SUBDIR = "metrics-certs"
WEBHOOK_PREFIX = "topotrain-testbed-"
CERT_STEM = "local-webhooks"


@dataclass(frozen=True)
class Webhook:
    """One admission webhook a manager serves: kind (mutating/validating), name, path, rule."""

    kind: str
    name: str
    path: str
    group: str
    version: str
    resources: tuple[str, ...]
    operations: tuple[str, ...]
    queued_only: bool = False  # only objects with a queue label (Kueue's JobSet webhooks)


_CU = ("CREATE", "UPDATE")
KUEUE_WEBHOOKS = (
    Webhook("mutating", "mclusterqueue.kb.io", "/mutate-kueue-x-k8s-io-v1beta2-clusterqueue",
            "kueue.x-k8s.io", "v1beta2", ("clusterqueues",), ("CREATE",)),
    Webhook("mutating", "mresourceflavor.kb.io", "/mutate-kueue-x-k8s-io-v1beta2-resourceflavor",
            "kueue.x-k8s.io", "v1beta2", ("resourceflavors",), ("CREATE",)),
    Webhook("mutating", "mworkload.kb.io", "/mutate-kueue-x-k8s-io-v1beta2-workload",
            "kueue.x-k8s.io", "v1beta2", ("workloads",), ("CREATE",)),
    Webhook("validating", "vclusterqueue.kb.io", "/validate-kueue-x-k8s-io-v1beta2-clusterqueue",
            "kueue.x-k8s.io", "v1beta2", ("clusterqueues",), _CU),
    Webhook("validating", "vcohort.kb.io", "/validate-kueue-x-k8s-io-v1beta2-cohort",
            "kueue.x-k8s.io", "v1beta2", ("cohorts",), _CU),
    Webhook("validating", "vresourceflavor.kb.io",
            "/validate-kueue-x-k8s-io-v1beta2-resourceflavor",
            "kueue.x-k8s.io", "v1beta2", ("resourceflavors",), _CU),
    Webhook("validating", "vworkload.kb.io", "/validate-kueue-x-k8s-io-v1beta2-workload",
            "kueue.x-k8s.io", "v1beta2", ("workloads", "workloads/status"), _CU),
)  # fmt: skip
KUEUE_JOBSET_WEBHOOKS = (
    Webhook("mutating", "mjobset.kueue.kb.io", "/mutate-jobset-x-k8s-io-v1alpha2-jobset",
            "jobset.x-k8s.io", "v1alpha2", ("jobsets",), ("CREATE",), queued_only=True),
    Webhook("validating", "vjobset.kueue.kb.io", "/validate-jobset-x-k8s-io-v1alpha2-jobset",
            "jobset.x-k8s.io", "v1alpha2", ("jobsets",), _CU, queued_only=True),
)  # fmt: skip
JOBSET_WEBHOOKS = (
    Webhook("mutating", "mjobset.kb.io", "/mutate-jobset-x-k8s-io-v1alpha2-jobset",
            "jobset.x-k8s.io", "v1alpha2", ("jobsets",), ("CREATE",)),
    Webhook("validating", "vjobset.kb.io", "/validate-jobset-x-k8s-io-v1alpha2-jobset",
            "jobset.x-k8s.io", "v1alpha2", ("jobsets",), _CU),
)  # fmt: skip


@dataclass(frozen=True)
class StackPorts:
    kueue_webhook: int
    kueue_health: int
    jobset_webhook: int
    jobset_health: int


def crd_dir(name: str) -> Path:
    """share/<name>-crds-<version>/, as build.sh leaves it."""
    version = versions()[f"{name.upper()}_VERSION"]
    path = cache_dir() / "share" / f"{name}-crds-{version}"
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is missing: run `{BUILD_SCRIPT} {name}`")
    return path


def kueue_config(
    ports: StackPorts, cert_dir: Path, *, jobset: bool, qps: float, burst: int
) -> dict[str, Any]:
    """Kueue's Configuration: the shipped manager config's client rates and concurrency,
    out-of-cluster serving, TAS on (its default since v0.14), visibility server off (it
    would need its own certificate)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports.kueue_health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": ports.kueue_webhook, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": {"qps": qps, "burst": burst},
        "controller": {"groupKindConcurrency": {
            "Job.batch": 5, "Pod": 5, "Workload.kueue.x-k8s.io": 5,
            "LocalQueue.kueue.x-k8s.io": 1, "Cohort.kueue.x-k8s.io": 1,
            "ClusterQueue.kueue.x-k8s.io": 1, "ResourceFlavor.kueue.x-k8s.io": 1,
        }},
        "integrations": {"frameworks": ["jobset.x-k8s.io/jobset" if jobset else "batch/job"]},
        # ElasticJobsViaWorkloadSlices (alpha, off by default): an elastic TrainingJob's resizes
        # in Kueue's accounting (docs/kueue.md, "Elastic jobs"); it changes nothing for others.
        "featureGates": {"VisibilityOnDemand": False, "TopologyAwareScheduling": True,
                         "ElasticJobsViaWorkloadSlices": True},
    }  # fmt: skip


def jobset_config(ports: StackPorts, cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports.jobset_health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": ports.jobset_webhook, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": {"qps": 500, "burst": 500},
    }  # fmt: skip


def webhook_configurations(
    owner: str, webhooks: Sequence[Webhook], port: int, ca_bundle: str
) -> list[dict[str, Any]]:
    """Mutating and validating configurations `topotrain-testbed-<owner>` for `webhooks`."""
    out = []
    for kind, api_kind in (("mutating", "MutatingWebhookConfiguration"),
                           ("validating", "ValidatingWebhookConfiguration")):  # fmt: skip
        entries = []
        for hook in (w for w in webhooks if w.kind == kind):
            entry: dict[str, Any] = {
                "name": hook.name, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "failurePolicy": "Fail", "timeoutSeconds": 10,
                "clientConfig": {"url": f"https://127.0.0.1:{port}{hook.path}",
                                 "caBundle": ca_bundle},
                "rules": [{"apiGroups": [hook.group], "apiVersions": [hook.version],
                           "operations": list(hook.operations),
                           "resources": list(hook.resources)}],
            }  # fmt: skip
            if hook.queued_only:
                entry["objectSelector"] = {
                    "matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]
                }
            entries.append(entry)
        if entries:
            out.append({
                "apiVersion": "admissionregistration.k8s.io/v1", "kind": api_kind,
                "metadata": {"name": f"{WEBHOOK_PREFIX}{owner}"}, "webhooks": entries,
            })  # fmt: skip
    return out


class KueueStack:
    """Kueue (and JobSet when `jobset`) beside `testbed`; state under `<root>/kueue/`."""

    def __init__(
        self, testbed: Testbed, *, jobset: bool = False, qps: float = 50, burst: int = 100,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.testbed = testbed
        self.jobset = jobset
        # More of Kueue's Configuration (`multiKueue` on a manager, `waitForPodsReady`, ...)
        self.extra = dict(extra or {})
        self.qps, self.burst = qps, burst
        self.dir = testbed.root / "kueue"
        self.kueue = ManagedProcess("kueue", testbed.root)
        self.jobset_process = ManagedProcess("jobset", testbed.root)

    # --- lifecycle ---------------------------------------------------------------

    def running(self) -> bool:
        """Kueue (and JobSet if asked for) run and answer /readyz."""
        try:
            ports = self._saved_ports()
        except (OSError, KeyError, TypeError, ValueError):
            return False
        ready = self.kueue.running() and _ready(ports.kueue_health)
        if self.jobset:
            ready = ready and self.jobset_process.running() and _ready(ports.jobset_health)
        return ready

    def start(self, timeout: float = 180.0) -> None:
        """Start whatever is not running with this configuration, then wait until ready."""
        with self._locked():
            self.dir.mkdir(parents=True, exist_ok=True)
            ports = self._ports()
            configs = self._write_configs(ports)
            if self.running() and not configs:
                return
            self._stop_processes()
            self._apply_crds()
            if self.jobset:
                self._start("jobset", self.jobset_process, ports.jobset_health, timeout)
            self._start("kueue", self.kueue, ports.kueue_health, timeout)
            self._register_webhooks(ports)

    def stop(self) -> bool:
        """Remove the webhooks, then stop the processes; True if one was running."""
        with self._locked():
            self._kubectl("delete", "mutatingwebhookconfiguration,validatingwebhookconfiguration",
                          "-l", "testbed.topotrain.io/kueue-stack", "--ignore-not-found",
                          check=False)  # fmt: skip
            return self._stop_processes()

    @contextlib.contextmanager
    def session(self, timeout: float = 180.0) -> Iterator[KueueStack]:
        """Use the stack for one test session: started if needed, stopped by the last user."""
        users = self.dir / "users"
        users.mkdir(parents=True, exist_ok=True)
        me = users / str(os.getpid())
        me.touch()
        try:
            self.start(timeout)
            yield self
        finally:
            me.unlink(missing_ok=True)
            if not any(_pid_alive(int(p.name)) for p in users.iterdir()):
                self.stop()

    def log_tail(self, lines: int = 40) -> str:
        parts = [f"--- kueue ({self.kueue.log_file})\n{self.kueue.tail(lines)}"]
        if self.jobset:
            process = self.jobset_process
            parts.append(f"--- jobset ({process.log_file})\n{process.tail(lines)}")
        return "\n".join(parts)

    # --- objects -------------------------------------------------------------------

    def apply(self, manifests: Sequence[Mapping[str, Any]]) -> None:
        """Server-side apply of plain-dict manifests, in order."""
        text = yaml.safe_dump_all([dict(m) for m in manifests], sort_keys=False)
        self._kubectl("apply", "--server-side", "--force-conflicts",
                      "--field-manager=topotrain-testbed", "-f", "-", stdin=text)  # fmt: skip

    def wait_cluster_queue_active(self, name: str, timeout: float = 60.0) -> None:
        def active() -> bool:
            out = self._kubectl("get", "clusterqueues.kueue.x-k8s.io", name, "-o", "json",
                                check=False)  # fmt: skip
            if out.returncode:
                return False
            conditions = json.loads(out.stdout).get("status", {}).get("conditions", [])
            return any(c["type"] == "Active" and c["status"] == "True" for c in conditions)

        try:
            wait_until(active, timeout=timeout, what=f"ClusterQueue {name} Active", interval=0.3)
        except TimeoutError as err:
            shown = self._kubectl("get", "clusterqueues.kueue.x-k8s.io", name, "-o", "yaml",
                                  check=False).stdout  # fmt: skip
            raise TimeoutError(f"{err}\n{shown}\n{self.log_tail()}") from None

    # --- internals -------------------------------------------------------------------

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.dir)

    def _saved_ports(self) -> StackPorts:
        return StackPorts(**json.loads((self.dir / "ports.json").read_text()))

    def _ports(self) -> StackPorts:
        with contextlib.suppress(OSError, KeyError, TypeError, ValueError):
            return self._saved_ports()
        chosen: set[int] = set()
        while len(chosen) < len(StackPorts.__dataclass_fields__):
            chosen.add(free_port())
        ports = StackPorts(*sorted(chosen))
        (self.dir / "ports.json").write_text(json.dumps(asdict(ports)) + "\n")
        return ports

    @property
    def _cert_dir(self) -> Path:
        return self.dir / "certs"

    def _write_configs(self, ports: StackPorts) -> bool:
        """Write certificates and configs; True if a config changed (a restart is due)."""
        pki = self.testbed.layout.pki
        ensure_serving_cert(pki, CERT_STEM)
        self._cert_dir.mkdir(parents=True, exist_ok=True)
        for src, dst in ((f"{CERT_STEM}.crt", "tls.crt"), (f"{CERT_STEM}.key", "tls.key")):
            (self._cert_dir / dst).write_bytes((pki / src).read_bytes())
        _ensure_metrics_cert(self._cert_dir, self.dir)
        changed = False
        wanted = {"kueue": kueue_config(ports, self._cert_dir, jobset=self.jobset, qps=self.qps,
                                        burst=self.burst)}  # fmt: skip
        wanted["kueue"].update(self.extra)
        if self.jobset:
            wanted["jobset"] = jobset_config(ports, self._cert_dir)
        for name, config in wanted.items():
            path = self.dir / f"{name}-config.yaml"
            text = yaml.safe_dump(config, sort_keys=False)
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                changed = True
        return changed

    def _apply_crds(self) -> None:
        dirs = [crd_dir("kueue")] + ([crd_dir("jobset")] if self.jobset else [])
        for path in dirs:
            self._kubectl("apply", "--server-side", "--force-conflicts",
                          "--field-manager=topotrain-testbed", "-f", str(path))  # fmt: skip
            wait_until(lambda p=path: self._established(p), timeout=60,  # type: ignore[misc]
                       what=f"the CRDs of {path.name} Established", interval=0.3)  # fmt: skip
        self._kubectl("create", "namespace", KUEUE_NAMESPACE, check=False)

    def _established(self, path: Path) -> bool:
        """Every CRD in `path` has condition Established (a fresh one has no status yet)."""
        out = self._kubectl("get", "-f", str(path), "-o", "json", check=False)
        if out.returncode:
            return False
        items = json.loads(out.stdout).get("items", [])
        return all(
            any(c.get("type") == "Established" and c.get("status") == "True"
                for c in (crd.get("status") or {}).get("conditions") or [])
            for crd in items
        )  # fmt: skip

    def _start(self, name: str, process: ManagedProcess, health: int, timeout: float) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.testbed.kubeconfig)}
        argv = [str(binary(name)), f"--config={self.dir / f'{name}-config.yaml'}"]
        process.start(argv, env=env, cwd=self.dir)

        def ready() -> bool:
            if not process.running():
                raise RuntimeError(f"{name} exited; log {process.log_file}:\n{process.tail(40)}")
            return _ready(health)

        try:
            wait_until(ready, timeout=timeout, what=f"{name} /readyz", interval=0.3)
        except TimeoutError as err:
            raise TimeoutError(f"{err}; log {process.log_file}:\n{process.tail(40)}") from None

    def _register_webhooks(self, ports: StackPorts) -> None:
        ca = base64.b64encode((self.testbed.layout.pki / "ca.crt").read_bytes()).decode()
        kueue_hooks = KUEUE_WEBHOOKS + (KUEUE_JOBSET_WEBHOOKS if self.jobset else ())
        # /readyz only says the webhook server listens: JobSet registers its handlers later,
        # and a configuration pointing at a path not yet served fails requests with a 404.
        served = [(ports.kueue_webhook, h.path) for h in kueue_hooks]
        if self.jobset:
            served += [(ports.jobset_webhook, h.path) for h in JOBSET_WEBHOOKS]
        cafile = str(self.testbed.layout.pki / "ca.crt")
        wait_until(lambda: all(_path_served(port, path, cafile) for port, path in served),
                   timeout=60, what="the webhook handlers", interval=0.3)  # fmt: skip
        objects = webhook_configurations("kueue", kueue_hooks, ports.kueue_webhook, ca)
        if self.jobset:
            objects += webhook_configurations("jobset", JOBSET_WEBHOOKS, ports.jobset_webhook, ca)
        for obj in objects:
            obj["metadata"]["labels"] = {"testbed.topotrain.io/kueue-stack": "1"}
        self.apply(objects)

    def _stop_processes(self) -> bool:
        stopped = self.kueue.stop()
        return self.jobset_process.stop() or stopped

    def _kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.testbed.kubeconfig)}
        result = subprocess.run([str(binary("kubectl")), *args], env=env, input=stdin,
                                capture_output=True, text=True)  # fmt: skip
        if check and result.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result


def _ensure_metrics_cert(cert_dir: Path, state: Path) -> None:
    """Kueue opens <its working directory>/metrics-certs/tls.{crt,key} at start when its own
    certificate management is off (testbed/build.sh's build; see there); any valid pair does
    while metrics are off."""
    target = state / METRICS_CERT_SUBDIR
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tls.crt", "tls.key"):
        (target / name).write_bytes((cert_dir / name).read_bytes())


def _path_served(port: int, path: str, cafile: str) -> bool:
    """A handler answers `path` (an empty review is refused with 400, not 404)."""
    context = ssl.create_default_context(cafile=cafile)
    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}", data=b"{}",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=3, context=context):
            return True
    except urllib.error.HTTPError as err:
        return err.code != 404
    except (urllib.error.URLError, OSError):
        return False


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=3) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
