"""Helpers for the operator's integration tests: the operator as a subprocess, private GPU nodes.

Each test gets its own KWOK GPU nodes, labelled with the test's namespace, and
its jobs select them with `spec.worker.nodeSelector`, so tests sharing the
session cluster never compete for GPUs. The operator runs as the user runs
it, `topotrain run --standalone --namespace <test namespace>`, in a
subprocess that a test may kill (SIGKILL) and start again. Pods on KWOK nodes
run no processes: no trainer runs here; tests seed committed checkpoints and
heartbeats in S3 themselves, through topotrain.checkpoints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from topotrain.checkpoints import CheckpointStore, job_prefix

from testbed.kube import Kube
from testbed.nodes import add_node, delete_node, wait_nodes_ready
from testbed.s3 import S3Server

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "topotrain.io_trainingjobs.yaml"  # and, beside it, TrainingJobTemplate's
TEST_NODES_LABEL = "test.topotrain.io/nodes"
SECRET = "s3creds"
WAIT = 90.0  # seconds before a wait counts as "never happened"
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = WAIT) -> T:
    """Poll until `probe` returns something truthy; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


_INSTALLED: set[Path] = set()


def install_crd(kube: Kube) -> None:
    """Apply the generated CRD once per session (no client-side OpenAPI download)."""
    if kube.kubeconfig in _INSTALLED:
        return
    kube.kubectl("apply", "--server-side", "--force-conflicts", "--validate=false", "-f", str(CRD.parent))
    _INSTALLED.add(kube.kubeconfig)
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                 "crd/trainingjobs.topotrain.io", "crd/trainingjobtemplates.topotrain.io")


@dataclass
class OperatorProcess:
    """`topotrain run` in a subprocess, logging to a file."""

    kubeconfig: Path
    namespace: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    standalone: bool = True  # False: it acts only while it holds the Lease (leader election)

    def start(self) -> OperatorProcess:
        # PYTHONPATH: this checkout's operator, whatever checkout the shared venv was installed from
        path = os.pathsep.join(filter(None, [str(REPO / "operator"), str(REPO / "sdk"), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "TOPOTRAIN_RECONCILE_INTERVAL": "1",
               "TOPOTRAIN_CHECKPOINT_POLL": "1", "PYTHONPATH": path,
               "TOPOTRAIN_CHECKPOINT_ENDPOINTS": "127.0.0.1",  # the testbed's S3 server, on loopback
               **self.env}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "topotrain.cli", "run", *(["--standalone"] if self.standalone else []),
                 "--namespace", self.namespace, "--metrics-port", "0", "--health-port", "0"],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            )
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when the node running the operator dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Cluster:
    """One test's view: its namespace, its nodes, its operator, and API shortcuts."""

    kube: Kube
    namespace: str
    operator: OperatorProcess
    nodes: list[str] = field(default_factory=list)

    @property
    def custom(self) -> Any:
        return client.CustomObjectsApi(self.kube.api)

    def add_nodes(self, racks: int, per_rack: int, *, gpus: int = 8, product: str = "H100-80GB",
                  prefix: str = "", wait: bool = True) -> list[str]:
        """GPU nodes private to this test: rack r holds nodes <ns>-<prefix>r<r>-n<n>."""
        stem = f"{self.namespace[:30]}-{prefix}"
        names = []
        for r in range(racks):
            for n in range(per_rack):
                name = f"{stem}r{r}-n{n}"
                add_node(self.kube.kubeconfig, name, product=product, gpus=gpus,
                         block=f"{stem}b0", rack=f"{stem}r{r}",
                         labels={TEST_NODES_LABEL: self.namespace})
                names.append(name)
        self.nodes += names
        if wait:
            wait_nodes_ready(self.kube.kubeconfig, names, 120)
        return names

    def cleanup(self) -> None:
        for name in self.nodes:
            delete_node(self.kube.kubeconfig, name)

    # --- jobs -----------------------------------------------------------------

    def manifest(self, name: str, *, tensor: int = 8, pipeline: int = 2, data: int = 2,
                 min_data: int | None = None, gpus_per_pod: int = 8, bucket: str | None = None,
                 s3: S3Server | None = None, **spec: Any) -> dict[str, Any]:
        par: dict[str, Any] = {"tensor": tensor, "pipeline": pipeline, "data": data}
        if min_data is not None:
            par["minData"] = min_data
        body: dict[str, Any] = {
            "image": "topotrain/trainer:test", "command": ["python", "-m", "topotrain_trainer"],
            "parallelism": par,
            "worker": {"gpusPerPod": gpus_per_pod, "nodeSelector": {TEST_NODES_LABEL: self.namespace}},
            # These tests' pods run no processes (KWOK only) and hold the recreate path; restart
            # in place needs the pod's supervisor and is tested end to end (tests/e2e/test_inplace.py).
            "failurePolicy": {"backoffSeconds": 0, "restartInPlace": False},
        }
        if bucket is not None and s3 is not None:
            body["checkpoint"] = {"uri": f"s3://{bucket}/runs", "endpoint": s3.endpoint,
                                  "credentialsSecret": SECRET}
        for key, value in spec.items():
            if isinstance(value, dict) and isinstance(body.get(key), dict):
                body[key] = {**body[key], **value}
            else:
                body[key] = value
        return {"apiVersion": "topotrain.io/v1alpha1", "kind": "TrainingJob",
                "metadata": {"name": name, "namespace": self.namespace}, "spec": body}

    def apply(self, manifest: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(
            "topotrain.io", "v1alpha1", self.namespace, "trainingjobs", manifest)

    def job(self, name: str) -> dict[str, Any]:
        job: dict[str, Any] = self.custom.get_namespaced_custom_object(
            "topotrain.io", "v1alpha1", self.namespace, "trainingjobs", name)
        return job

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.job(name).get("status") or {})

    def jobs_summary(self) -> str:
        """Every job's uid, generation and status (printed when a test ends: on a failure, what
        the operator had written by then)."""
        try:
            items = self.custom.list_namespaced_custom_object(
                "topotrain.io", "v1alpha1", self.namespace, "trainingjobs")["items"]
        except Exception as exc:  # the summary must never hide the test's own failure
            return f"(not listed: {exc})"
        return "\n".join(
            f"{j['metadata']['name']} uid={j['metadata'].get('uid')} generation="
            f"{j['metadata'].get('generation')} spec.checkpoint={(j.get('spec') or {}).get('checkpoint')} "
            f"status={j.get('status')}" for j in items) or "(none)"

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == type_), None)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            "topotrain.io", "v1alpha1", self.namespace, "trainingjobs", name, {"spec": spec})

    def delete_job(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(
            "topotrain.io", "v1alpha1", self.namespace, "trainingjobs", name)

    def pods(self, job: str | None = None) -> list[Any]:
        selector = f"topotrain.io/job={job}" if job else "topotrain.io/job"
        items = self.kube.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return sorted(items, key=lambda p: p.metadata.name)

    def running_gang(self, job: str, attempt: int, pods: int) -> list[Any] | None:
        """The gang's pods of `attempt` when all `pods` are Running (else None)."""
        mine = [p for p in self.pods(job) if p.metadata.labels.get("topotrain.io/attempt") == str(attempt)
                and p.metadata.deletion_timestamp is None]
        if len(mine) == pods and all(p.status.phase == "Running" for p in mine):
            return mine
        return None

    def wait_phase(self, job: str, phase: str, timeout: float = WAIT) -> dict[str, Any]:
        return wait_for(f"{job} phase {phase}",
                        lambda: (s := self.status(job)).get("phase") == phase and s, timeout)

    def create_secret(self, s3: S3Server) -> None:
        try:
            self.kube.core.create_namespaced_secret(self.namespace, {
                "metadata": {"name": SECRET},
                "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
            })
        except ApiException as exc:
            if exc.status != 409:
                raise

    def store(self, s3: S3Server, bucket: str, job: str) -> CheckpointStore:
        prefix = job_prefix(f"s3://{bucket}/runs", self.namespace, job)
        return CheckpointStore(prefix, client=s3.client())


def cluster_fixture(kube: Kube, namespace: str, tmp_path: Path, **env: str) -> Iterator[Cluster]:
    """The body of the `cluster` fixtures: CRD, operator subprocess, cleanup."""
    install_crd(kube)
    operator = OperatorProcess(kube.kubeconfig, namespace, tmp_path / "operator.log", env=dict(env))
    cluster = Cluster(kube, namespace, operator.start())
    try:
        yield cluster
    finally:
        print(f"--- TrainingJobs at the end ---\n{cluster.jobs_summary()}")
        operator.stop()
        cluster.cleanup()
        print(f"--- operator log ({operator.log}) ---\n{operator.tail()}")
