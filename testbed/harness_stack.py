"""The whole topotrain stack on one cluster, for the end-to-end tests, the
goodput benchmark and the demo:

- the Helm chart, installed with `helm` into the jobs' namespace (watching
  only it, with the operator Deployment at zero replicas, since its pod
  would land on a KWOK node that runs nothing);
- the operator, run as a local process exactly as the chart's Deployment
  describes it (image entrypoint, args, environment), with a token of the
  chart's ServiceAccount as its only credential;
- the pod process harness (testbed.harness, a stand-in for a kubelet's
  process execution) running the trainer pods as local processes;
- an S3 bucket and a credentials Secret for the jobs' checkpoints.

The same code runs against the testbed or any cluster KUBECONFIG names
(kind with KWOK nodes, see docs/kind.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import urllib3
import yaml
from kubernetes.client.exceptions import ApiException
from topotrain.contract import HOLD_RELEASE, hold_release_of

from testbed.binaries import REPO_ROOT, bin_dir, code_path, wait_built
from testbed.client import api_client, core_v1
from testbed.harness import PodProcessHarness
from testbed.harness_env import container_argv, container_env, read_env_source
from testbed.harness_proc import json_lines
from testbed.procs import free_port, signal_group, wait_until

if TYPE_CHECKING:
    from testbed.kube import Kube

CHART = REPO_ROOT / "charts" / "topotrain"
GROUP, VERSION, PLURAL = "topotrain.io", "v1alpha1", "trainingjobs"
CREDENTIALS_SECRET = "checkpoint-credentials"
TRAINER_IMAGE = "ghcr.io/topotrain/trainer:0.1.0"


@dataclass(frozen=True)
class S3Target:
    """Where the jobs' checkpoints go, as seen from this machine."""

    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
        )  # fmt: skip


@dataclass
class Stack:
    """Chart + local operator + harness for the jobs of `namespace` (use as a context manager)."""

    kubeconfig: Path
    namespace: str
    workdir: Path
    s3: S3Target
    operator_values: dict[str, Any] = field(default_factory=dict)
    chart_values: dict[str, Any] = field(default_factory=dict)  # top-level values that win
    release: str = ""
    harness: PodProcessHarness | None = None
    _operator: subprocess.Popen[bytes] | None = None
    _api: Any = None

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.release = self.release or f"tt-{self.namespace}"[:40].rstrip("-")

    def __enter__(self) -> Stack:
        self._api = api_client(self.kubeconfig)
        try:
            self.install_chart()
            self.create_credentials()
            self.start_operator()
            self.harness = PodProcessHarness(
                self.kubeconfig, self.workdir / "harness", namespace=self.namespace
            ).start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        if self._api is not None:
            self.delete_jobs()
        if self.harness is not None:
            self.harness.stop()
        self.stop_operator()
        self.helm("uninstall", self.release, "-n", self.namespace, "--wait=false", check=False)
        if self._api is not None:
            self._api.close()

    def delete_jobs(self, timeout: float = 60.0) -> None:
        """Delete the namespace's TrainingJobs while the operator still runs (it owns their
        finalizer); whatever is left after `timeout` loses the finalizer, so the namespace can go."""
        self.kubectl("delete", "trainingjobs", "--all", "-n", self.namespace, "--wait=false", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.operator_alive():
            listed = self.kubectl("get", "trainingjobs", "-n", self.namespace, "-o", "name", check=False)
            if listed.returncode == 0 and not listed.stdout.strip():
                return
            time.sleep(1)
        for name in self.kubectl("get", "trainingjobs", "-n", self.namespace, "-o", "name", check=False).stdout.split():
            self.kubectl("patch", name, "-n", self.namespace, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)

    # --- tools -------------------------------------------------------------

    def _tool(
        self, name: str, args: tuple[str, ...], check: bool
    ) -> subprocess.CompletedProcess[str]:
        wait_built(name)
        built = bin_dir() / name
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        argv = [str(built) if built.exists() else name, *args]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if check and done.returncode:
            raise RuntimeError(
                f"{name} {' '.join(args)} failed ({done.returncode}):\n{done.stderr}"
            )
        return done

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._tool("helm", args, check)

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._tool("kubectl", args, check)

    @property
    def core(self) -> Any:
        return core_v1(self._api)

    @property
    def custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._api)

    # --- chart and operator --------------------------------------------------

    def install_chart(self) -> None:
        values = {
            "replicaCount": 0,
            "watchNamespaces": [self.namespace],
            "rbac": {
                "checkpointSecrets": [{"namespace": self.namespace, "names": [CREDENTIALS_SECRET]}]
            },
            "leaderElection": {"enabled": False},
            "metrics": {"port": free_port()},
            "healthPort": free_port(),
            # The testbed's S3 server (and the soak's proxy in front of it) listens on loopback,
            # which the operator's endpoint allowlist refuses by default (controller/endpoints.py).
            "s3": {"allowedEndpoints": ["127.0.0.1"]},
            "operator": {
                "reconcileIntervalSeconds": 2,
                "checkpointPollSeconds": 1,
                "podGraceSeconds": 3,
                **self.operator_values,
            },
            **self.chart_values,
        }
        values_file = self.workdir / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        # helm installs a chart's crds/ only when the CRD is absent and never upgrades it: a
        # testbed whose etcd outlived a schema change would prune the new spec fields (say
        # failurePolicy.restartInPlace) from every job. Apply this checkout's CRD first.
        self.kubectl(
            "apply", "--server-side", "--force-conflicts", "--validate=false",
            "-f", str(CHART / "crds" / "topotrain.io_trainingjobs.yaml"),
        )  # fmt: skip
        self.helm(
            "install",
            self.release,
            str(CHART),
            "-n",
            self.namespace,
            "-f",
            str(values_file),
            "--wait=false",
        )

    def create_credentials(self) -> None:
        secret = {
            "metadata": {"name": CREDENTIALS_SECRET},
            "stringData": {
                "AWS_ACCESS_KEY_ID": self.s3.access_key,
                "AWS_SECRET_ACCESS_KEY": self.s3.secret_key,
            },
        }
        try:
            self.core.create_namespaced_secret(self.namespace, secret)
        except ApiException as err:
            if err.status != 409:
                raise

    def _deployment(self) -> dict[str, Any]:
        from kubernetes import client

        apps: Any = client.AppsV1Api(self._api)
        selector = f"app.kubernetes.io/instance={self.release}"
        items = json.loads(
            apps.list_namespaced_deployment(
                self.namespace, label_selector=selector, _preload_content=False
            ).data
        )["items"]
        if len(items) != 1:
            raise RuntimeError(
                f"expected one operator Deployment of release {self.release}, found {len(items)}"
            )
        deployment: dict[str, Any] = items[0]
        return deployment

    def service_account_kubeconfig(self, service_account: str) -> Path:
        """A kubeconfig whose only credential is a fresh token of `service_account`."""
        request = {"spec": {"expirationSeconds": 24 * 3600}}
        raw = self.core.create_namespaced_service_account_token(
            service_account, self.namespace, request, _preload_content=False
        )
        token = json.loads(raw.data)["status"]["token"]
        admin = yaml.safe_load(self.kubeconfig.read_text())
        context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])[
            "context"
        ]
        cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "operator",
            "clusters": [cluster],
            "users": [{"name": service_account, "user": {"token": token}}],
            "contexts": [{"name": "operator", "context": {"cluster": cluster["name"], "user": service_account, "namespace": self.namespace}}],
        }  # fmt: skip
        path = self.workdir / "operator.kubeconfig"
        path.touch(mode=0o600)
        path.write_text(yaml.safe_dump(config))
        return path

    def start_operator(self) -> None:
        """Run the chart's operator container as a local process (the chart's args and env)."""
        argv, env = self.operator_command()
        log = (self.workdir / "operator.log").open("ab")
        self._operator = subprocess.Popen(
            argv,
            env=env,
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def operator_command(self) -> tuple[list[str], dict[str, str]]:
        """argv and environment of the chart's operator container, as a local process."""
        pod = self._deployment()["spec"]["template"]
        pod = {
            "metadata": {"name": "topotrain-operator-local", "namespace": self.namespace},
            "spec": pod["spec"],
        }
        container = pod["spec"]["containers"][0]
        env = container_env(pod, container, self._read_object)
        kubeconfig = self.service_account_kubeconfig(pod["spec"]["serviceAccountName"])
        basics = {k: os.environ[k] for k in ("LANG", "TMPDIR") if k in os.environ}
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        env = {
            **basics,
            "PATH": path,
            "PYTHONPATH": code_path(),
            **env,
            "HOME": str(self.workdir),
            "KUBECONFIG": str(kubeconfig),
        }
        return container_argv(container, env), env

    def stop_operator(self) -> None:
        if self._operator is None:
            return
        signal_group(self._operator.pid, signal.SIGTERM)
        try:
            self._operator.wait(timeout=15)
        except subprocess.TimeoutExpired:
            signal_group(self._operator.pid, signal.SIGKILL)
            self._operator.wait()
        self._operator = None

    def operator_alive(self) -> bool:
        return self._operator is not None and self._operator.poll() is None

    def operator_log(self, lines: int = 40) -> str:
        text = (
            (self.workdir / "operator.log").read_text(errors="replace")
            if (self.workdir / "operator.log").exists()
            else ""
        )
        return "\n".join(text.splitlines()[-lines:])

    def _read_object(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        return read_env_source(self.core, kind, namespace, name)

    # --- jobs ----------------------------------------------------------------

    def job_manifest(self, name: str, spec: Mapping[str, Any],
                     labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        """A TrainingJob with this stack's checkpoint store filled in (keys in `spec` win)."""
        checkpoint = {
            "uri": f"s3://{self.s3.bucket}/jobs", "endpoint": self.s3.endpoint,
            "credentialsSecret": CREDENTIALS_SECRET, **spec.get("checkpoint", {}),
        }  # fmt: skip
        body = {"image": TRAINER_IMAGE, **spec, "checkpoint": checkpoint}
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": self.namespace, "labels": dict(labels or {})},
            "spec": body,
        }

    def apply_job(self, name: str, spec: Mapping[str, Any],
                  labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        manifest = self.job_manifest(name, spec, labels)
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, manifest
        )
        return created

    def job(self, name: str) -> dict[str, Any]:
        raw = _retrying(lambda: self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, _preload_content=False
        ).data)  # fmt: skip
        job: dict[str, Any] = json.loads(raw)
        return job

    def wait_job(
        self, name: str, check: Callable[[dict[str, Any]], bool], *, timeout: float, what: str
    ) -> dict[str, Any]:
        """Poll the job until `check(job)`; on timeout the error shows its status and the operator's log."""
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = {}
        while True:
            try:
                job = self.job(name)
            except (ApiException, OSError, urllib3.exceptions.HTTPError) as err:
                if (isinstance(err, ApiException) and 0 < err.status < 500) or time.monotonic() > deadline:
                    raise
                time.sleep(1)  # an overloaded API server answers 5xx or times out: ask again
                continue
            if check(job):
                return job
            if time.monotonic() > deadline or not self.operator_alive():
                status = json.dumps(job.get("status", {}), indent=1)
                raise TimeoutError(
                    f"job {name}: {what} not reached in {timeout:.0f}s (operator alive: {self.operator_alive()})\nstatus: {status}\noperator log:\n{self.operator_log()}"
                )
            time.sleep(0.5)

    def disruption_budget(self, job: str, min_available: int) -> None:
        """A PodDisruptionBudget named after the job over its pods, `minAvailable` as a pod count
        (the disruption controller scales any other form by the job's data degree)."""
        budget = self.workdir / f"pdb-{job}.yaml"
        budget.write_text(
            "apiVersion: policy/v1\nkind: PodDisruptionBudget\n"
            f"metadata: {{name: {job}}}\n"
            f"spec: {{minAvailable: {min_available}, selector: {{matchLabels: {{topotrain.io/job: {job}}}}}}}\n"
        )
        self.kubectl("-n", self.namespace, "apply", "-f", str(budget))

    def release_hold(self, job: str, attempt: int | None = None) -> None:
        """Let a gang held by `training.holdAtStep` (a test aid) go on: annotates the job's pods
        that exist now (the harness rewrites their control files at once, as a kubelet does).
        `attempt`: only that attempt's gang; a later attempt of the same pods holds again."""
        value = "released" if attempt is None else hold_release_of(attempt)
        self.kubectl("-n", self.namespace, "annotate", "pods", "-l", f"topotrain.io/job={job}",
                     f"{HOLD_RELEASE}={value}", "--overwrite")  # fmt: skip

    def pods(self, job: str) -> list[dict[str, Any]]:
        raw = _retrying(lambda: self.core.list_namespaced_pod(
            self.namespace, label_selector=f"topotrain.io/job={job}", _preload_content=False
        ).data)  # fmt: skip
        pods: list[dict[str, Any]] = json.loads(raw)["items"]
        return pods

    def events(self, job: str) -> list[dict[str, Any]]:
        """The trainer's JSON log lines of every run of the job's pods (global rank 0 writes them)."""
        assert self.harness is not None
        return list(json_lines(self.harness.job_logs(self.namespace, job)))


def _retrying(call: Callable[[], bytes], attempts: int = 30) -> bytes:
    """`call()`, asked again while an overloaded API server times out (5xx, broken reads)."""
    for attempt in range(attempts):
        try:
            return call()
        except (ApiException, OSError, urllib3.exceptions.HTTPError) as err:
            if (isinstance(err, ApiException) and 0 < err.status < 500) or attempt == attempts - 1:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


def step_losses(events: list[dict[str, Any]]) -> dict[int, float]:
    """Loss per step; a step run again after a restart keeps its last value (the one that counted)."""
    return {int(e["step"]): float(e["loss"]) for e in events if e.get("event") == "step"}


def checkpoint_store(stack: Stack, job: str) -> Any:
    """The job's CheckpointStore (the shared layout module), seen from this machine."""
    from topotrain.checkpoints import CheckpointStore, job_prefix

    prefix = job_prefix(f"s3://{stack.s3.bucket}/jobs", stack.namespace, job)
    return CheckpointStore(prefix, stack.s3.endpoint, stack.s3.access_key, stack.s3.secret_key)


@contextlib.contextmanager
def stack_in_new_namespace(
    kube: Kube, s3: S3Target, workdir: Path, stem: str, **operator_values: object
) -> Iterator[Stack]:
    """A namespace of its own with the whole stack in it; the namespace is deleted afterwards."""
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    kube.core.create_namespace({"metadata": {"name": name, "labels": {"topotrain.io/test": "e2e"}}})
    try:
        wait_until(
            lambda: bool(
                kube.core.list_namespaced_service_account(
                    name, field_selector="metadata.name=default"
                ).items
            ),
            timeout=60,
            what=f"the default ServiceAccount of {name}",
        )
        with Stack(
            kube.kubeconfig, name, workdir / name, s3, operator_values=dict(operator_values)
        ) as stack:
            yield stack
    finally:
        kube.core.delete_namespace(name)
