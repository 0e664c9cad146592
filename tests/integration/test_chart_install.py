"""The chart installed with the real `helm` into the testbed's real API server.

The operator image cannot be built here (no Docker), so where a test needs the
operator it runs `topotrain run` as a local process whose kubeconfig holds
nothing but a token of the chart's ServiceAccount (TokenRequest API): what it
manages to do, the chart's RBAC allowed. Worker pods sit on KWOK nodes, which
mark them Running without running anything.

Each test installs its own release (a unique name, so cluster-scoped objects
never collide) into its own namespace, in namespaced mode where an operator
runs, so that it never touches another test's jobs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from topotrain.api.status import Reason

from testbed.binaries import binary
from testbed.kube import Kube
from testbed.s3 import S3Server

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "topotrain"
INSTANCE = "app.kubernetes.io/instance"
# Every kind the chart creates, plus what the Deployment creates in turn.
LABELLED_KINDS = (
    "deployments,replicasets,pods,services,serviceaccounts,configmaps,roles,rolebindings,"
    "clusterroles,clusterrolebindings,leases.coordination.k8s.io"
)


class Release:
    """One Helm release of the chart, for one test."""

    def __init__(self, kube: Kube, namespace: str, workdir: Path) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = "tt-" + namespace.rsplit("-", 1)[-1]  # unique: the namespace's random suffix
        self.fullname = f"{self.name}-topotrain"
        self.workdir = workdir
        self.installed = False

    @property
    def service_account(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.fullname}"

    def helm(self, verb: str, values: dict[str, Any]) -> None:
        path = self.workdir / f"values-{verb}.yaml"
        path.write_text(yaml.safe_dump(values))
        result = self.kube.helm(verb, self.name, str(CHART), "-n", self.namespace, "-f", str(path),
                                check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        self.installed = True

    def uninstall(self) -> None:
        result = self.kube.helm("uninstall", self.name, "-n", self.namespace, "--wait", check=False)
        assert result.returncode == 0, result.stderr
        self.installed = False

    def manifest_objects(self) -> set[tuple[str, str, str]]:
        """(kind, namespace, name) of every object in the release's current manifest."""
        text = self.kube.helm("get", "manifest", self.name, "-n", self.namespace).stdout
        return {
            (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])
            for doc in yaml.safe_load_all(text) if doc
        }

    def live_objects(self, owned: bool = False) -> set[tuple[str, str, str]]:
        """(kind, namespace, name) of the live objects labelled with this release; with
        `owned`, also those another object owns (the Deployment's ReplicaSets and pods)."""
        result = self.kube.kubectl("get", LABELLED_KINDS, "-A", "-l", f"{INSTANCE}={self.name}",
                                   "-o", "json")
        return {
            (item["kind"], item["metadata"].get("namespace", ""), item["metadata"]["name"])
            for item in json.loads(result.stdout)["items"]
            if owned or not item["metadata"].get("ownerReferences")
        }

    def can_i(self, *args: str) -> bool:
        result = self.kube.kubectl("auth", "can-i", *args, f"--as={self.service_account}",
                                   check=False)
        return result.stdout.strip() == "yes"


@pytest.fixture
def release(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Release]:
    rel = Release(kube, namespace, tmp_path)
    yield rel
    if rel.installed:
        rel.uninstall()


def wait_for(what: str, check: Callable[[], Any], timeout: float = 120.0) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.5)


def service_account_kubeconfig(kube: Kube, release: Release) -> Path:
    """A kubeconfig whose only credential is a fresh token of the chart's ServiceAccount."""
    token = kube.kubectl("-n", release.namespace, "create", "token", release.fullname,
                         "--duration=1h").stdout.strip()
    admin = yaml.safe_load(Path(kube.kubeconfig).read_text())
    cluster = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "testbed", "cluster": {
            "server": cluster["server"],
            "certificate-authority-data": cluster["certificate-authority-data"],
        }}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "testbed", "user": "operator"}}],
    }
    path = release.workdir / "operator.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclass
class LocalOperator:
    log: Path
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        """SIGKILL the whole process group: no clean-up, as when its node dies."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def local_operator(kubeconfig: Path, release: Release, name: str = "operator",
                   elect: bool = False) -> Iterator[LocalOperator]:  # fmt: skip
    """`topotrain run` as a local process, as the chart's Deployment configures it."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KUBERNETES_", "AWS_", "TOPOTRAIN_"))}
    env.update(KUBECONFIG=str(kubeconfig), TOPOTRAIN_METRICS_PORT="0", TOPOTRAIN_HEALTH_PORT="0",
               TOPOTRAIN_CHECKPOINT_ENDPOINTS="127.0.0.1")  # the testbed's S3 server, on loopback
    if elect:  # as the chart sets it: the release's Lease in its namespace, owned by the
        # release's Deployment; the pod's name
        env.update(TOPOTRAIN_LEASE_NAMESPACE=release.namespace, TOPOTRAIN_LEASE_OWNER=release.fullname,
                   TOPOTRAIN_IDENTITY=name)
    log = release.workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "topotrain.cli", "run", "--namespace", release.namespace,
           "--lease-name", release.fullname]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield LocalOperator(log, proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def training_job(name: str, bucket: str, endpoint: str, secret: str) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "small.yaml").read_text())
    job["metadata"] = {"name": name}
    job["spec"]["checkpoint"] = {
        "uri": f"s3://{bucket}/checkpoints", "endpoint": endpoint, "credentialsSecret": secret,
    }
    return job


def create_s3_secret(kube: Kube, namespace: str, name: str, access: str, secret: str) -> None:
    kube.kubectl("-n", namespace, "create", "secret", "generic", name,
                 f"--from-literal=AWS_ACCESS_KEY_ID={access}",
                 f"--from-literal=AWS_SECRET_ACCESS_KEY={secret}")


def get_job(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    """The TrainingJob, or {} while it cannot be read (the wait keeps polling)."""
    result = kube.kubectl("-n", namespace, "get", "trainingjob", name, "-o", "json", check=False)
    job: dict[str, Any] = json.loads(result.stdout) if result.returncode == 0 else {}
    return job


def running_pods(kube: Kube, namespace: str, job: str, attempt: int | None = None) -> list[str]:
    selector = f"topotrain.io/job={job}" + ("" if attempt is None else f",topotrain.io/attempt={attempt}")
    pods = json.loads(kube.kubectl("-n", namespace, "get", "pods", "-l", selector,
                                   "-o", "json").stdout)["items"]
    return [p["metadata"]["name"] for p in pods if p.get("status", {}).get("phase") == "Running"]


def test_operator_with_only_the_chart_service_account_runs_a_job(
    kube: Kube, namespace: str, release: Release, s3: S3Server, s3_bucket: str
) -> None:
    kube.require_testbed("KWOK nodes run the job's pods")
    create_s3_secret(kube, namespace, "ckpt-creds", s3.access_key, s3.secret_key)
    create_s3_secret(kube, namespace, "other-creds", s3.access_key, s3.secret_key)
    # replicaCount 0: the chart's Deployment stays empty; the local process is the operator.
    release.helm("install", {
        "replicaCount": 0,
        "watchNamespaces": [namespace],
        "rbac": {"checkpointSecrets": [{"namespace": namespace, "names": ["ckpt-creds"]}]},
    })
    kubeconfig = service_account_kubeconfig(kube, release)
    # The token really is the ServiceAccount: it cannot even list Secrets here.
    denied = subprocess.run(
        [str(binary("kubectl")), "--kubeconfig", str(kubeconfig), "-n", namespace, "get", "secrets"],
        capture_output=True, text=True, check=False,
    )
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr

    allowed = training_job("small", s3_bucket, s3.endpoint, "ckpt-creds")
    forbidden = training_job("forbidden", s3_bucket, s3.endpoint, "other-creds")
    manifests = release.workdir / "jobs.yaml"
    manifests.write_text(yaml.safe_dump_all([allowed, forbidden]))

    with local_operator(kubeconfig, release) as operator:
        kube.kubectl("-n", namespace, "apply", "-f", str(manifests))
        try:
            wait_for("job 'small' Running", lambda: get_job(kube, namespace, "small")
                     .get("status", {}).get("phase") == "Running", timeout=180)
            pods = wait_for("both pods of 'small' Running",
                            lambda: len(running_pods(kube, namespace, "small")) == 2
                            and running_pods(kube, namespace, "small"))
            assert len(pods) == 2

            def forbidden_reason() -> bool:
                conditions = get_job(kube, namespace, "forbidden").get("status", {}).get(
                    "conditions", [])
                return any(c.get("reason") == Reason.SECRET_FORBIDDEN for c in conditions)

            wait_for("a CheckpointSecretForbidden condition on 'forbidden'", forbidden_reason)
            # The operator (holding the finalizers) deletes what it made, with its own RBAC.
            kube.kubectl("-n", namespace, "delete", "trainingjob", "--all", "--timeout=120s")
            wait_for("the jobs' pods to go", lambda: not json.loads(kube.kubectl(
                "-n", namespace, "get", "pods", "-l", "topotrain.io/job", "-o", "json",
            ).stdout)["items"])
        except BaseException:
            print(operator.text()[-6000:])
            raise


def acting(operator: LocalOperator) -> bool:
    """Whether this replica's last leadership line in its log says it holds the Lease."""
    text = operator.text()
    return text.rfind("holds the Lease and acts") > text.rfind("lost the Lease")


def test_standby_replica_takes_over_when_the_active_one_dies(
    kube: Kube, namespace: str, release: Release, s3: S3Server, s3_bucket: str
) -> None:
    """Two replicas with the chart's leader election: one acts, the other waits; the active
    one is SIGKILLed, a gang pod is deleted meanwhile, and the standby takes the Lease (once it
    has seen it unrenewed for the chart's 15 s leaseDurationSeconds) and restarts the gang."""
    kube.require_testbed("KWOK nodes run the job's pods")
    create_s3_secret(kube, namespace, "ckpt-creds", s3.access_key, s3.secret_key)
    release.helm("install", {
        "replicaCount": 0,
        "watchNamespaces": [namespace],
        "rbac": {"checkpointSecrets": [{"namespace": namespace, "names": ["ckpt-creds"]}]},
    })  # fmt: skip
    kubeconfig = service_account_kubeconfig(kube, release)
    manifest = release.workdir / "job.yaml"
    manifest.write_text(yaml.safe_dump(training_job("small", s3_bucket, s3.endpoint, "ckpt-creds")))

    def job_status() -> dict[str, Any]:
        status: dict[str, Any] = get_job(kube, namespace, "small").get("status", {})
        return status

    with contextlib.ExitStack() as replicas:
        # The first replica takes the free Lease; the second, started after, waits.
        active = replicas.enter_context(local_operator(kubeconfig, release, "active", elect=True))
        wait_for("the active replica to act", lambda: acting(active))
        standby = replicas.enter_context(local_operator(kubeconfig, release, "standby", elect=True))
        try:
            kube.kubectl("-n", namespace, "apply", "-f", str(manifest))
            wait_for("job 'small' Running", lambda: job_status().get("phase") == "Running",
                     timeout=180)  # fmt: skip
            pods = wait_for("both pods Running",
                            lambda: len(found := running_pods(kube, namespace, "small")) == 2 and found)  # fmt: skip
            wait_for("the standby up", lambda: "leader election: replica standby" in standby.text())
            assert not acting(standby), "the standby acted too"  # ... and waiting

            active.kill()
            kube.kubectl("-n", namespace, "delete", "pod", pods[0], "--wait=false")
            wait_for("the standby to resume", lambda: acting(standby), timeout=180)
            status = wait_for("the gang restarted by the standby",
                              lambda: (s := job_status()).get("attempt", 0) >= 1
                              and s.get("phase") == "Running" and s, timeout=240)  # fmt: skip
            assert status["restarts"] >= 1
            assert status["lastFailure"]["reason"] == Reason.POD_DELETED
            # The deleted pod's index has a new pod of the new attempt; the other pod is either
            # kept and relabelled (restart in place, the default) or recreated.
            attempt = int(status["attempt"])
            replaced = pods[0].replace("-0-", f"-{attempt}-")
            wait_for(f"attempt {attempt}'s pods Running", lambda: len(
                now := running_pods(kube, namespace, "small", attempt)) == 2 and replaced in now
                and pods[0] not in now)  # fmt: skip
        except BaseException:
            print("active:\n" + active.text()[-4000:] + "\nstandby:\n" + standby.text()[-6000:])
            raise
    # The replicas' Lease (written by them, owned by the release's Deployment) goes with the
    # release: `helm uninstall` leaves no Lease behind.
    lease = ["-n", namespace, "get", f"leases.coordination.k8s.io/{release.fullname}", "-o", "json"]
    owners = json.loads(kube.kubectl(*lease).stdout)["metadata"].get("ownerReferences", [])
    assert [(o["kind"], o["name"]) for o in owners] == [("Deployment", release.fullname)]
    release.uninstall()
    wait_for("the Lease deleted with its owner", lambda: kube.kubectl(*lease, check=False).returncode != 0)


def test_operator_pod_passes_the_restricted_pod_security_standard(
    kube: Kube, namespace: str, release: Release
) -> None:
    # The API server's PodSecurity admission rejects any pod of this namespace
    # that does not meet "restricted".
    kube.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    release.helm("install", {"watchNamespaces": [namespace]})
    selector = f"{INSTANCE}={release.name},app.kubernetes.io/component=operator"

    def created() -> list[Any]:
        pods: list[Any] = json.loads(kube.kubectl("-n", namespace, "get", "pods", "-l", selector,
                                                  "-o", "json").stdout)["items"]
        return pods

    def rejected() -> str:
        events = kube.kubectl("-n", namespace, "get", "events", "-o", "json").stdout
        return " ".join(e.get("message", "") for e in json.loads(events)["items"]
                        if e.get("reason") == "FailedCreate")

    wait_for("the operator pod to be admitted", lambda: created() or rejected())
    assert rejected() == ""
    (pod,) = created()
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_service_account_cannot_do_what_the_operator_does_not_need(
    kube: Kube, namespace: str, release: Release, mode: str
) -> None:
    values: dict[str, Any] = {
        "replicaCount": 0,
        "rbac": {"checkpointSecrets": [{"namespace": namespace, "names": ["s3-ckpt"]}]},
    }
    if mode == "namespaced":
        values["watchNamespaces"] = [namespace]
    release.helm("install", values)
    ns = ["-n", namespace]
    # What it needs.
    for args in (
        ["get", "secret/s3-ckpt", *ns],
        ["create", "pods", *ns],
        ["delete", "pods", *ns],
        ["patch", "trainingjobs.topotrain.io", "--subresource=status", *ns],
        ["delete", "trainingjobs.topotrain.io", *ns],  # spec.ttlSecondsAfterFinished
        ["get", "trainingjobtemplates.topotrain.io"],  # spec.templateRef
        ["watch", "nodes"],
        ["update", f"leases.coordination.k8s.io/{release.fullname}", *ns],
        ["get", f"deployments.apps/{release.fullname}", *ns],  # the Lease's owner, for its UID
    ):
        assert release.can_i(*args), f"cannot {' '.join(args)}"
    # What it does not: other Secrets, granting itself roles, touching nodes,
    # other operators' Leases, creating jobs or templates, exec into pods.
    for args in (
        ["get", "secrets", *ns],
        ["list", "secrets", *ns],
        ["get", "secret/other", *ns],
        ["list", "secrets", "-A"],
        ["create", "rolebindings", *ns],
        ["create", "clusterrolebindings"],
        ["create", "roles", *ns],
        ["bind", "clusterroles"],
        ["escalate", "clusterroles"],
        ["impersonate", "serviceaccounts"],
        ["delete", "nodes"],
        ["patch", "nodes"],
        ["delete", "customresourcedefinitions.apiextensions.k8s.io"],
        ["list", "namespaces"],
        ["update", "leases.coordination.k8s.io/someone-else", *ns],
        ["get", "deployments.apps/someone-else", *ns],
        ["update", f"deployments.apps/{release.fullname}", *ns],
        ["update", "leases.coordination.k8s.io/kube-scheduler", "-n", "kube-system"],
        ["create", "trainingjobs.topotrain.io", *ns],
        ["update", "trainingjobtemplates.topotrain.io"],
        ["create", "pods", "--subresource=exec", *ns],
        ["create", "serviceaccounts", "--subresource=token", *ns],
    ):
        assert not release.can_i(*args), f"can {' '.join(args)}"
    if mode == "namespaced":
        assert not release.can_i("list", "pods", "-n", "default")
    else:
        assert release.can_i("list", "pods", "-A")


def test_upgrade_and_uninstall_leave_no_orphans_and_keep_checkpoints(
    kube: Kube, namespace: str, release: Release, s3: S3Server, s3_bucket: str
) -> None:
    release.helm("install", {
        "replicaCount": 0,
        "rbac": {"checkpointSecrets": [{"namespace": namespace, "names": ["s3-ckpt"]}]},
    })
    installed = release.manifest_objects()
    assert wait_for("the live objects to match the release",
                    lambda: release.live_objects() == installed), release.live_objects()
    assert ("Role", namespace, f"{release.fullname}-leader") in installed  # the Lease's

    # The documented CRD upgrade step works on CRDs that `helm install` created.
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    # Changed values: namespaced mode, no Secret access, the dashboard on.
    release.helm("upgrade", {
        "replicaCount": 0, "watchNamespaces": [namespace], "dashboard": {"enabled": True},
    })
    upgraded = release.manifest_objects()
    gone = installed - upgraded
    assert ("Role", namespace, f"{release.fullname}-leader") in upgraded
    assert ("Role", namespace, f"{release.fullname}-checkpoint-secrets") in gone
    assert ("ConfigMap", namespace, f"{release.fullname}-dashboard") in upgraded
    assert wait_for("the upgrade to remove what the new values no longer need",
                    lambda: release.live_objects() == upgraded), release.live_objects() - upgraded

    # A TrainingJob and its committed checkpoint, seeded where the trainer writes it.
    job = release.workdir / "job.yaml"
    job.write_text(yaml.safe_dump(training_job("small", s3_bucket, s3.endpoint, "s3-ckpt")))
    kube.kubectl("-n", namespace, "apply", "-f", str(job))
    client = s3.client()
    key = f"checkpoints/{namespace}/small/step-0000000042/COMMITTED"
    client.put_object(Bucket=s3_bucket, Key=key, Body=b'{"step": 42}')

    release.uninstall()
    assert wait_for("no object of the release left (garbage collection included)",
                    lambda: not release.live_objects(owned=True))
    helm_storage = kube.kubectl("-n", namespace, "get", "secrets", "-l",
                                f"owner=helm,name={release.name}", "-o", "name").stdout
    assert helm_storage.strip() == ""
    # Helm leaves crds/ alone, so the job stays; nothing deletes its checkpoints.
    assert get_job(kube, namespace, "small")["spec"]["checkpoint"]["uri"].endswith("/checkpoints")
    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix=f"checkpoints/{namespace}/small/")
    assert [obj["Key"] for obj in listed.get("Contents", [])] == [key]
    assert client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == b'{"step": 42}'
    kube.kubectl("-n", namespace, "delete", "trainingjob", "small")  # no operator, no finalizer
