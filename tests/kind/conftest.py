"""The real-data-plane suite: a kind cluster built by scripts/kind-e2e.sh.

Everything here runs on real kubelets and containers: the operator as the
chart's Deployment, the trainer in its image, S3 (versitygw) as a pod, the
pods' rendezvous over the pod network through the headless Service's DNS
name. scripts/kind-e2e.sh sets TOPOTRAIN_KIND and the TOPOTRAIN_KIND_* values
below; without them (an ordinary `pytest tests`) every test here is skipped,
because no kind cluster was built for this run. Every test is marked `kind`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testbed.kube import Kube

HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kind: needs the kind cluster of scripts/kind-e2e.sh")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="no kind cluster (scripts/kind-e2e.sh runs this suite)")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.kind)
            if not os.environ.get("TOPOTRAIN_KIND"):
                item.add_marker(skip)


@dataclass(frozen=True)
class KindEnv:
    """What scripts/kind-e2e.sh set up."""

    cluster: str
    namespace: str  # where the jobs run; its S3 credentials Secret is granted to the operator
    trainer_image: str
    s3_endpoint: str  # as pods see it
    s3_secret: str
    operator_namespace: str
    host_sysctl_before: Path


@pytest.fixture(scope="session")
def kind_env() -> KindEnv:
    e = os.environ
    return KindEnv(
        cluster=e["TOPOTRAIN_KIND_CLUSTER"],
        namespace=e["TOPOTRAIN_KIND_NAMESPACE"],
        trainer_image=e["TOPOTRAIN_KIND_TRAINER_IMAGE"],
        s3_endpoint=e["TOPOTRAIN_KIND_S3_ENDPOINT"],
        s3_secret=e["TOPOTRAIN_KIND_S3_SECRET"],
        operator_namespace=e["TOPOTRAIN_KIND_OPERATOR_NAMESPACE"],
        host_sysctl_before=Path(e["TOPOTRAIN_KIND_HOST_SYSCTL"]),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortForward:
    """`kubectl port-forward` to a Service, started again on the same local port whenever it has
    died: a port-forward ends with its connection to the API server, and on a loaded machine the
    control plane's API server can restart under a test (seen in a flake hunt with the load
    average at 90: one restart made every later test's S3 calls fail with "connection refused")."""

    def __init__(self, kube: Kube, namespace: str, service: str, remote: int) -> None:
        self._argv = ["kubectl", "--kubeconfig", str(kube.kubeconfig), "-n", namespace,
                      "port-forward", f"service/{service}", f"{_free_port()}:{remote}"]  # fmt: skip
        self.port = int(self._argv[-1].split(":")[0])
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def ensure(self) -> None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen(self._argv, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, text=True)  # fmt: skip

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
                self._proc.wait(10)


@dataclass(frozen=True)
class S3Access:
    """The in-cluster S3 server, reached from this machine through kubectl port-forward."""

    endpoint: str
    access_key: str
    secret_key: str
    forward: PortForward | None = None

    def client(self) -> Any:
        """A client through the port-forward, which is started again first if it died, and
        answers before the client is handed out (up to 60 s: the API server it goes through may
        be restarting)."""
        import boto3

        if self.forward is not None:
            self.forward.ensure()
        client = boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
        )  # fmt: skip
        if self.forward is not None:
            wait_for(
                lambda: _answers(client, self.forward), 60, "kubectl port-forward to the S3 service"
            )
        return client


@pytest.fixture(scope="session")
def s3_access(kube: Kube, kind_env: KindEnv) -> Iterator[S3Access]:
    import base64

    secret = kube.core.read_namespaced_secret(kind_env.s3_secret, kind_env.namespace)
    data = {k: base64.b64decode(v).decode() for k, v in secret.data.items()}
    forward = PortForward(kube, "topotrain-s3", "s3", 7070)
    access = S3Access(f"http://127.0.0.1:{forward.port}", data["AWS_ACCESS_KEY_ID"],
                      data["AWS_SECRET_ACCESS_KEY"], forward)  # fmt: skip
    try:
        access.client()
        yield access
    finally:
        forward.close()


def _answers(client: Any, forward: PortForward | None) -> bool:
    try:
        client.list_buckets()
        return True
    except Exception:
        if forward is not None:
            forward.ensure()
        return False


# The bucket of the tokenized dataset every job trains from (tests/datasets.py, tests/kind/jobs.py).
# A fixed name, never a random one: pytest imports this conftest once as a plugin and jobs.py
# imports it again as tests.kind.conftest, and a name drawn at import differed between the two
# (the jobs named a bucket nobody wrote: "no index.json there"). The cluster is the run's own.
DATA_BUCKET = "kind-data"


@pytest.fixture(scope="session")
def dataset(s3_access: S3Access) -> str:
    """The session's dataset, written once into DATA_BUCKET; its URI."""
    from tests.datasets import dataset_uri, prepare

    client = s3_access.client()
    # a kept cluster (KEEP_CLUSTER=1, --test-up again) has it: written again, the same bytes
    exists = (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists)
    with contextlib.suppress(*exists):
        client.create_bucket(Bucket=DATA_BUCKET)
    prepare(client, DATA_BUCKET)
    return dataset_uri(DATA_BUCKET)


@pytest.fixture
def bucket(s3_access: S3Access, dataset: str) -> str:
    """A fresh bucket for one test (kept for the post-mortem; the cluster goes at the end); the
    session's dataset is written before the first one."""
    name = f"kind-{uuid.uuid4().hex[:10]}"
    s3_access.client().create_bucket(Bucket=name)
    return name


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 1.0) -> Any:
    """`check()`'s first truthy value within `timeout` seconds, else AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


# What kubectl says when the API server is briefly away (restarting, or its etcd slow under load):
# a read is tried again for up to TRANSIENT_SECONDS. Anything else fails at once, with kubectl's
# own words in the error.
TRANSIENT = ("connection refused", "unable to connect to the server", "the server is currently unable",
             "etcdserver: request timed out", "etcdserver: leader changed", "tls handshake timeout",
             "i/o timeout", "connection reset by peer", "http2: client connection lost",
             "context deadline exceeded", "the server was unable to return a response",
             "unexpected eof", ": eof")  # fmt: skip
TRANSIENT_SECONDS = 120.0


def transient(stderr: str) -> bool:
    text = stderr.lower()
    return any(t in text for t in TRANSIENT)


class KubectlError(AssertionError):
    """kubectl failed for a reason other than the API server being away; says kubectl's words."""

    def __init__(self, args: tuple[str, ...], done: subprocess.CompletedProcess[str]) -> None:
        super().__init__(
            f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-800:]}"
        )
        self.stderr = done.stderr


def kubectl(kube: Kube, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """kubectl, tried again while the API server is away (for reads and idempotent writes:
    get, apply, scale, logs)."""
    deadline = time.monotonic() + TRANSIENT_SECONDS
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig)}
    while True:
        done = subprocess.run(
            ["kubectl", *args], input=stdin, env=env, capture_output=True, text=True
        )
        if done.returncode == 0:
            return done
        if not transient(done.stderr) or time.monotonic() > deadline:
            raise KubectlError(args, done)
        time.sleep(2)


def kubectl_json(kube: Kube, *args: str) -> Any:
    """`kubectl ... -o json` (a read), parsed; tried again while the API server is away."""
    return json.loads(kubectl(kube, *args, "-o", "json").stdout)


def service_nodes(kube: Kube, kind_env: KindEnv) -> dict[str, str]:
    """Where the cluster's own services run, pod name -> node: S3, the operator and CoreDNS.
    scripts/kind-e2e.sh puts them all on the control-plane node; a test that stops or pauses a
    worker checks that first, so that it takes only training pods with it."""
    placed = {}
    for namespace, selector in (("topotrain-s3", "app=s3"),
                                (kind_env.operator_namespace, "app.kubernetes.io/name=topotrain"),
                                ("kube-system", "k8s-app=kube-dns")):  # fmt: skip
        for pod in kubectl_json(kube, "-n", namespace, "get", "pods", "-l", selector)["items"]:
            placed[pod["metadata"]["name"]] = pod["spec"].get("nodeName", "")
    return placed


def scrape(kube: Kube, kind_env: KindEnv, url: str, timeout: float = 120) -> str:
    """GET `url` from a pod of its own on the control-plane node, over the pod network (as a
    Prometheus in the cluster would); its body. The pod runs the operator image (Python), which
    scripts/kind-e2e.sh loads onto that node only."""
    image = kubectl_json(kube, "-n", kind_env.operator_namespace, "get", "deployments")["items"][0][
        "spec"
    ]["template"]["spec"]["containers"][0]["image"]
    pod = f"scrape-{uuid.uuid4().hex[:6]}"
    script = (f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10)"
              ".read().decode())")  # fmt: skip
    overrides = {"spec": {
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "containers": [{
            "name": pod, "image": image, "imagePullPolicy": "Never",
            "command": ["python", "-c", script],
            "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False},
        }],
    }}  # fmt: skip
    try:
        kubectl(kube, "-n", kind_env.namespace, "run", pod, "--restart=Never", f"--image={image}",
                f"--overrides={json.dumps(overrides)}")  # fmt: skip
    except KubectlError as err:  # a retried create whose first try had landed
        if "AlreadyExists" not in err.stderr:
            raise
    try:
        wait_for(lambda: kubectl_json(kube, "-n", kind_env.namespace, "get", "pod", pod)["status"].get(
            "phase") in ("Succeeded", "Failed"), timeout, f"pod {pod} to finish")  # fmt: skip
        text = kubectl(kube, "-n", kind_env.namespace, "logs", pod).stdout
        phase = kubectl_json(kube, "-n", kind_env.namespace, "get", "pod", pod)["status"]["phase"]
        assert phase == "Succeeded", f"GET {url} from {pod}: {text[-2000:]}"
        return str(text)
    finally:
        kube.kubectl("-n", kind_env.namespace, "delete", "pod", pod, "--wait=false", check=False)
