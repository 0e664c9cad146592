"""One acting replica, on the testbed's real API server: the Lease and the fenced writes.

Two `topotrain run` processes (leader election on, short Lease times) serve one namespace.
Which replica made a pod is read from the pod's `topotrain.io/created-by` annotation (the
replica's identity) and each replica's own log. A replica is paused with SIGSTOP, as a long
GC pause or a frozen VM would; SIGCONT resumes it with its monotonic clock moved on.

The fenced writes are shown against the same API server through the operator's own client
(controller/kube.py): a write made from a stale read is refused by the server, not by us.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from operator_support import Cluster, OperatorProcess, install_crd, wait_for

from testbed.kube import Kube

pytestmark = pytest.mark.integration
TIMES = {"TOPOTRAIN_LEASE_DURATION": "6", "TOPOTRAIN_RENEW_DEADLINE": "4", "TOPOTRAIN_RETRY_PERIOD": "1"}
CREATED_BY = "topotrain.io/created-by"
ACTION = " phase "  # the loop's log line for a pass that deleted, created or released pods


def holder(kube: Kube, namespace: str) -> str | None:
    try:
        lease = client.CoordinationV1Api(kube.api).read_namespaced_lease("topotrain", namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return str(lease.spec.holder_identity or "") or None


def replica(kube: Kube, namespace: str, tmp_path: Path, name: str) -> OperatorProcess:
    return OperatorProcess(kube.kubeconfig, namespace, tmp_path / f"{name}.log",
                           env={**TIMES, "TOPOTRAIN_IDENTITY": name}, standalone=False)


@pytest.fixture
def replicas(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[tuple[Cluster, OperatorProcess, OperatorProcess]]:
    install_crd(kube)
    a, b = replica(kube, namespace, tmp_path, "replica-a"), replica(kube, namespace, tmp_path, "replica-b")
    cluster = Cluster(kube, namespace, a.start())
    try:
        wait_for("replica-a to hold the Lease", lambda: holder(kube, namespace) == "replica-a", 60)
        b.start()
        wait_for("replica-b up", lambda: "leader election: replica replica-b" in log_text(b), 60)
        yield cluster, a, b
    finally:
        print(f"--- TrainingJobs at the end ---\n{cluster.jobs_summary()}")
        for process in (a, b):
            if process.proc is not None and process.proc.poll() is None:
                process.proc.send_signal(signal.SIGCONT)
            process.stop()
        cluster.cleanup()
        print(f"--- replica-a ---\n{a.tail(60)}\n--- replica-b ---\n{b.tail(60)}")


def creators(cluster: Cluster, job: str) -> dict[str, str]:
    return {p.metadata.name: (p.metadata.annotations or {}).get(CREATED_BY, "")
            for p in cluster.pods(job) if p.metadata.deletion_timestamp is None}


def running(cluster: Cluster, attempt: int) -> None:
    """Wait until the job's status says `attempt` Running and its pod runs."""
    wait_for(f"attempt {attempt} Running", lambda: cluster.running_gang("llm", attempt, 1)
             and (s := cluster.status("llm")).get("phase") == "Running" and s.get("attempt") == attempt)


def kill_gang(cluster: Cluster, job: str) -> None:
    for p in cluster.pods(job):
        cluster.kube.core.delete_namespaced_pod(p.metadata.name, cluster.namespace, grace_period_seconds=0)


def log_text(process: OperatorProcess) -> str:
    return str(process.log.read_text(errors="replace"))


def test_only_the_lease_holder_acts_and_a_paused_one_does_not_act_when_resumed(
    replicas: tuple[Cluster, OperatorProcess, OperatorProcess],
) -> None:
    cluster, a, b = replicas
    cluster.add_nodes(1, 2)
    cluster.apply(cluster.manifest("llm", pipeline=1, data=1))
    running(cluster, 0)
    assert set(creators(cluster, "llm").values()) == {"replica-a"}
    kill_gang(cluster, "llm")  # a fault: the leader restarts the gang, the standby does nothing
    running(cluster, 1)
    assert set(creators(cluster, "llm").values()) == {"replica-a"}
    assert ACTION not in log_text(b), "the standby acted"

    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)  # the leader freezes; its Lease runs out
    paused = time.monotonic()
    kill_gang(cluster, "llm")
    wait_for("replica-b to take the Lease", lambda: holder(cluster.kube, cluster.namespace) == "replica-b", 60)
    # Not before replica-b watched the Lease unrenewed for its whole duration (6 s) after
    # replica-a's last renewal, which was at most a retry period (1 s) before the pause.
    assert time.monotonic() - paused >= 6 - 1.5
    running(cluster, 2)
    assert set(creators(cluster, "llm").values()) == {"replica-b"}

    resumed_at = len(log_text(a))
    a.proc.send_signal(signal.SIGCONT)  # its clock moved on: it must not act on its old term
    kill_gang(cluster, "llm")
    running(cluster, 3)
    time.sleep(3)  # a few of replica-a's retry periods
    assert set(creators(cluster, "llm").values()) == {"replica-b"}
    after = log_text(a)[resumed_at:]
    assert ACTION not in after, f"replica-a acted after it was resumed:\n{after}"
    assert "lost the Lease" in after and holder(cluster.kube, cluster.namespace) == "replica-b"
    # Three faults, three restarts: no replica restarted the gang a second time for one fault.
    assert cluster.status("llm")["restarts"] == 3


def test_a_stopped_leader_gives_the_lease_up_and_the_standby_acts_at_once(
    replicas: tuple[Cluster, OperatorProcess, OperatorProcess],
) -> None:
    cluster, a, _ = replicas
    cluster.add_nodes(1, 1)
    a.stop()  # SIGTERM: the Lease is released on the way out
    wait_for("replica-b to take the released Lease", lambda: holder(cluster.kube, cluster.namespace) == "replica-b",
             5)  # well within the 6 s an expiry would take
    cluster.apply(cluster.manifest("llm", pipeline=1, data=1))
    running(cluster, 0)
    assert set(creators(cluster, "llm").values()) == {"replica-b"}


# --- the fenced writes, through the operator's client --------------------------------------


def job_and_pod(cluster: Cluster) -> tuple[dict[str, Any], Any]:
    """A running one-pod job, then the operator stopped: the test's writes are the only ones."""
    cluster.apply(cluster.manifest("llm", pipeline=1, data=1))
    running(cluster, 0)
    cluster.operator.stop()
    (pod,) = cluster.pods("llm")
    return cluster.job("llm"), pod


@pytest.fixture
def standalone(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    from operator_support import cluster_fixture

    yield from cluster_fixture(kube, namespace, tmp_path)


def test_writes_from_a_stale_read_are_refused_by_the_api_server(standalone: Cluster) -> None:
    """The interleaving of issue 37: a replica decided from a job and pods it read, and another
    writer changed them before its writes landed. Each of its writes is refused (StaleWrite):
    the status write (also one that changes nothing), the pod delete and the relabel."""
    from topotrain.controller.act import relabel_pods
    from topotrain.controller.kube import Kube as OperatorKube
    from topotrain.controller.kube import StaleWrite

    cluster = standalone
    cluster.add_nodes(1, 1)
    job, pod = job_and_pod(cluster)
    operator = OperatorKube(cluster.kube.api)
    read_version, status = job["metadata"]["resourceVersion"], dict(job["status"])
    # Another writer moves the job on between this replica's read and its write.
    theirs = operator.patch_status(cluster.namespace, "llm", status, {**status, "reason": "OtherReplica"},
                                   job["metadata"]["uid"], read_version)
    assert theirs != read_version
    with pytest.raises(StaleWrite) as refused:  # unchanged status: still checked by the server
        operator.patch_status(cluster.namespace, "llm", status, status, job["metadata"]["uid"], read_version)
    assert refused.value.status == 409
    with pytest.raises(StaleWrite):
        operator.patch_status(cluster.namespace, "llm", status, {**status, "restarts": None},
                              job["metadata"]["uid"], read_version)
    assert cluster.status("llm").get("reason") == "OtherReplica"

    # The pod changed since it was read (another replica relabelled it): delete refused.
    name, seen = pod.metadata.name, (pod.metadata.uid, pod.metadata.resource_version)
    cluster.kube.core.patch_namespaced_pod(name, cluster.namespace,
                                           {"metadata": {"labels": {"topotrain.io/attempt": "1"}}})
    with pytest.raises(StaleWrite):
        operator.delete_pods(cluster.namespace, [name], 0, {name: seen})
    # Relabelled from attempt 0 as this replica saw it: refused, the label stays the other's.
    with pytest.raises(StaleWrite):
        relabel_pods(operator, cluster.namespace, {name: "0"},
                     {"labels": {"topotrain.io/attempt": "2"}, "annotations": {"x.io/y": "z"}})
    after = cluster.kube.core.read_namespaced_pod(name, cluster.namespace)
    assert after.metadata.deletion_timestamp is None and after.metadata.labels["topotrain.io/attempt"] == "1"
    assert "x.io/y" not in (after.metadata.annotations or {})
    # From a fresh read both go through.
    relabel_pods(operator, cluster.namespace, {name: "1"},
                 {"labels": {"topotrain.io/attempt": "1"}, "annotations": {"x.io/y": "z"}})
    fresh = cluster.kube.core.read_namespaced_pod(name, cluster.namespace)
    assert fresh.metadata.annotations["x.io/y"] == "z"
    operator.delete_pods(cluster.namespace, [name], 0, {name: (fresh.metadata.uid, fresh.metadata.resource_version)})


def test_a_replica_without_the_lease_writes_nothing(standalone: Cluster) -> None:
    """The fence: every write of the operator's client first asks whether this replica may act."""
    from topotrain.controller.kube import Kube as OperatorKube
    from topotrain.controller.leader import NotLeader

    cluster = standalone
    cluster.add_nodes(1, 1)
    job, pod = job_and_pod(cluster)
    operator = OperatorKube(cluster.kube.api)

    def deposed() -> None:
        raise NotLeader("replica-x does not hold the Lease")

    operator.fence = deposed
    status = dict(job["status"])
    with pytest.raises(NotLeader):
        operator.patch_status(cluster.namespace, "llm", status, {**status, "reason": "Deposed"},
                              job["metadata"]["uid"], job["metadata"]["resourceVersion"])
    with pytest.raises(NotLeader):
        operator.delete_pods(cluster.namespace, [pod.metadata.name], 0)
    assert cluster.status("llm").get("reason") != "Deposed"
    assert cluster.kube.core.read_namespaced_pod(pod.metadata.name, cluster.namespace).metadata.deletion_timestamp is None
