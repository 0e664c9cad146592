"""The testbed behaves like the Kubernetes a user deploys to: the real API
server, scheduler, controller manager (GC, node lifecycle), RBAC and Helm,
with KWOK-simulated GPU nodes. Tests that need KWOK nodes or fault injection
skip on other clusters (KUBECONFIG set); the rest run anywhere."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from testbed import faults
from testbed.binaries import versions
from testbed.kube import Kube
from testbed.nodes import add_node, delete_node, wait_nodes_ready
from testbed.topology import (
    BLOCK_LABEL,
    GPU_RESOURCE,
    HOSTNAME_LABEL,
    PRODUCT_LABEL,
    RACK_LABEL,
    TOPOLOGY_LABEL,
)

pytestmark = pytest.mark.integration

CHART = Path(__file__).parent / "charts" / "hello"
T = TypeVar("T")


def eventually(probe: Callable[[], T | None], what: str, timeout: float = 120.0) -> T:
    """Poll until `probe` returns a truthy value; fail naming `what` if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"never happened within {timeout:.0f}s: {what}")
        time.sleep(0.3)


def gpu_pod(name: str, gpus: int, selector: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": selector or {},
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/trainer:0",
                    "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                }
            ],
        },
    }


def read_pod(kube: Kube, namespace: str, name: str) -> Any:
    return kube.core.read_namespaced_pod(name, namespace)


def test_server_reports_pinned_version(kube: Kube) -> None:
    report = json.loads(kube.kubectl("version", "-o", "json").stdout)
    server = report["serverVersion"]["gitVersion"]
    if kube.testbed is not None:
        assert server == versions()["KUBERNETES_VERSION"]
    assert server.startswith("v1.")


def test_topology_nodes_are_ready_with_labels_and_gpus(kube: Kube) -> None:
    kube.require_testbed("KWOK nodes from examples/clusters/tiny.yaml")
    out = kube.kubectl("get", "nodes", "-l", f"{TOPOLOGY_LABEL}=tiny", "-o", "json").stdout
    nodes = {n["metadata"]["name"]: n for n in json.loads(out)["items"]}
    assert sorted(nodes) == [
        "tiny-a100-b0-r0-n0",
        "tiny-h100-b0-r0-n0",
        "tiny-h100-b0-r0-n1",
        "tiny-h100-b0-r1-n0",
        "tiny-h100-b0-r1-n1",
    ]
    node = nodes["tiny-h100-b0-r1-n0"]
    labels = node["metadata"]["labels"]
    assert labels[BLOCK_LABEL] == "tiny-h100-b0"
    assert labels[RACK_LABEL] == "tiny-h100-b0-r1"
    assert labels[PRODUCT_LABEL] == "H100-80GB"
    assert labels[HOSTNAME_LABEL] == "tiny-h100-b0-r1-n0"
    for n in nodes.values():
        ready = [c for c in n["status"]["conditions"] if c["type"] == "Ready"]
        assert ready[0]["status"] == "True", n["metadata"]["name"]
        assert n["status"]["allocatable"][GPU_RESOURCE] == "8"
        assert n["status"]["capacity"][GPU_RESOURCE] == "8"


def test_scheduler_binds_gpu_pod_to_matching_node(kube: Kube, namespace: str) -> None:
    kube.require_testbed("KWOK GPU nodes")
    kube.core.create_namespaced_pod(namespace, gpu_pod("w", 4, {PRODUCT_LABEL: "A100-80GB"}))

    pod = eventually(
        lambda: (p := read_pod(kube, namespace, "w")).status.phase == "Running" and p,
        "the pod becomes Running",
    )
    assert pod.spec.node_name == "tiny-a100-b0-r0-n0"
    node = kube.core.read_node(pod.spec.node_name)
    assert node.metadata.labels[PRODUCT_LABEL] == "A100-80GB"


def test_pod_asking_too_many_gpus_stays_pending_with_scheduler_reason(
    kube: Kube, namespace: str
) -> None:
    kube.require_testbed("KWOK GPU nodes")
    kube.core.create_namespaced_pod(namespace, gpu_pod("greedy", 64))

    def failed_scheduling() -> Any:
        events = kube.core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=greedy,reason=FailedScheduling"
        ).items
        return events[0] if events else None

    event = eventually(failed_scheduling, "a FailedScheduling event")
    assert f"Insufficient {GPU_RESOURCE}" in event.message

    def scheduled_condition() -> Any:
        # The scheduler records the event and patches the pod's condition separately: the
        # event may be listed before the condition is written.
        pod = read_pod(kube, namespace, "greedy")
        found = [c for c in pod.status.conditions or [] if c.type == "PodScheduled"]
        return (pod, found[0]) if found else None

    pod, scheduled = eventually(scheduled_condition, "the PodScheduled condition")
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None
    assert scheduled.status == "False"
    assert scheduled.reason == "Unschedulable"


def test_injected_pod_failure_shows_failed_with_exit_code(kube: Kube, namespace: str) -> None:
    bed = kube.require_testbed("KWOK fault stages")
    kube.core.create_namespaced_pod(namespace, gpu_pod("victim", 1))
    eventually(lambda: read_pod(kube, namespace, "victim").status.phase == "Running", "Running")

    faults.fail_pod(bed.kubeconfig, namespace, "victim", exit_code=137, reason="OOMKilled")

    pod = eventually(
        lambda: (p := read_pod(kube, namespace, "victim")).status.phase == "Failed" and p,
        "phase Failed",
    )
    terminated = pod.status.container_statuses[0].state.terminated
    assert terminated.exit_code == 137
    assert terminated.reason == "OOMKilled"


@pytest.fixture
def spare_node(kube: Kube) -> Iterator[str]:
    """A node of its own, so breaking it disturbs no other test."""
    bed = kube.require_testbed("KWOK nodes")
    name = f"spare-{time.monotonic_ns() % 10**8}"
    add_node(bed.kubeconfig, name, product="H100-80GB", gpus=8)
    wait_nodes_ready(bed.kubeconfig, [name])
    yield name
    delete_node(bed.kubeconfig, name)


def node_taints(kube: Kube, name: str) -> set[str]:
    return {t.key for t in kube.core.read_node(name).spec.taints or []}


def test_not_ready_node_is_tainted_by_controller_manager(kube: Kube, spare_node: str) -> None:
    bed = kube.require_testbed("KWOK fault stages")
    faults.node_not_ready(bed.kubeconfig, spare_node)

    eventually(
        lambda: "node.kubernetes.io/not-ready" in node_taints(kube, spare_node),
        "kube-controller-manager taints the node not-ready",
    )
    faults.node_ready(bed.kubeconfig, spare_node)
    eventually(
        lambda: not node_taints(kube, spare_node) & {"node.kubernetes.io/not-ready"},
        "the taint goes once the node reports Ready again",
    )


@pytest.mark.slow
def test_node_without_heartbeats_becomes_unreachable(kube: Kube, spare_node: str) -> None:
    bed = kube.require_testbed("KWOK-managed leases")
    faults.node_unreachable(bed.kubeconfig, spare_node)

    eventually(
        lambda: "node.kubernetes.io/unreachable" in node_taints(kube, spare_node),
        "kube-controller-manager taints the silent node unreachable",
    )
    ready = [c for c in kube.core.read_node(spare_node).status.conditions if c.type == "Ready"]
    assert ready[0].status == "Unknown"

    faults.node_ready(bed.kubeconfig, spare_node)
    wait_nodes_ready(bed.kubeconfig, [spare_node])
    eventually(
        lambda: "node.kubernetes.io/unreachable" not in node_taints(kube, spare_node),
        "the taint goes once the node's kubelet reports again",
    )


@pytest.mark.slow
def test_a_flapping_nodes_pod_deleted_meanwhile_is_gone_once_the_node_is_back(
    kube: Kube, namespace: str, spare_node: str
) -> None:
    # The chaos soak's node flap: a pod deleted while its node is silent must still go once the
    # node reports again (a kubelet resyncs), or a deleted job's pod is stuck Terminating.
    bed = kube.require_testbed("KWOK-managed leases")
    kube.core.create_namespaced_pod(
        namespace, gpu_pod("flapped", 1, {"kubernetes.io/hostname": spare_node}))
    eventually(lambda: read_pod(kube, namespace, "flapped").status.phase == "Running", "Running")
    faults.node_unreachable(bed.kubeconfig, spare_node)
    time.sleep(2.0)  # KWOK notices it no longer holds the lease
    kube.core.delete_namespaced_pod("flapped", namespace)
    faults.node_reachable(bed.kubeconfig, spare_node, bed.settings().node_lease_seconds)

    eventually(lambda: not kube.core.list_namespaced_pod(
        namespace, field_selector="metadata.name=flapped").items, "the deleted pod is gone", 60)
    kube.core.create_namespaced_pod(
        namespace, gpu_pod("after", 1, {"kubernetes.io/hostname": spare_node}))
    eventually(lambda: read_pod(kube, namespace, "after").status.phase == "Running",
               "a new pod on the node runs", 60)


def test_deleting_owner_deletes_dependents(kube: Kube, namespace: str) -> None:
    owner = kube.core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    kube.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "dependent", "ownerReferences": [ref]}}
    )

    kube.core.delete_namespaced_config_map("owner", namespace)

    eventually(
        lambda: (
            not kube.core.list_namespaced_config_map(
                namespace, field_selector="metadata.name=dependent"
            ).items
        ),
        "the garbage collector deletes the dependent",
    )


def test_rbac_is_enforced(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_service_account(namespace, {"metadata": {"name": "nobody"}})
    subject = f"system:serviceaccount:{namespace}:nobody"

    denied = kube.kubectl(
        "auth", "can-i", "list", "pods", "-n", namespace, "--as", subject, check=False
    )
    assert denied.stdout.strip() == "no"
    allowed = kube.kubectl("auth", "can-i", "list", "pods", "-n", namespace, check=False)
    assert allowed.stdout.strip() == "yes"


def test_helm_installs_and_uninstalls_a_chart(kube: Kube, namespace: str) -> None:
    wait = ["--wait", "--timeout", "120s"] if kube.testbed is not None else []
    kube.helm("install", "demo", str(CHART), "-n", namespace, "--set", "greeting=hi", *wait)

    data = kube.core.read_namespaced_config_map("demo-greeting", namespace).data
    assert data == {"greeting": "hi"}
    listed = json.loads(kube.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in listed] == [("demo", "deployed")]
    if kube.testbed is not None:
        assert read_pod(kube, namespace, "demo-gpu").status.phase == "Running"

    kube.helm("uninstall", "demo", "-n", namespace, "--wait")
    assert not kube.core.list_namespaced_config_map(
        namespace, label_selector="app.kubernetes.io/instance=demo"
    ).items


def test_the_operators_resync_lists_metadata_only_page_by_page_and_finds_a_missed_deletion(
        kube: Kube, namespace: str) -> None:
    """topotrain.controller.kube.Kube.metadata_list (the ghost resyncs' LISTs) against the real API
    server: every pod of the namespace and every node, from the watch cache and from a consistent
    read, across pages, as PartialObjectMetadataList (a fraction of the bytes of a full LIST); and
    the resync (snapshot.Ghosts) on those LISTs finds a pod deleted while the watch was away."""
    from topotrain.controller.kube import METADATA_LIST
    from topotrain.controller.kube import Kube as OperatorKube
    from topotrain.controller.snapshot import Ghosts

    pods = [kube.core.create_namespaced_pod(namespace, gpu_pod(f"p{i}", 1)) for i in range(5)]
    made = {p.metadata.uid for p in pods}
    ops = OperatorKube(kube.api)
    assert ops.pod_uids((namespace,), cached=False, page=2) == made
    deadline = time.monotonic() + 10  # the watch cache may trail the write by a moment
    while ops.pod_uids((namespace,), cached=True, page=2) != made and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ops.pod_uids((namespace,), cached=True, page=2) == made
    assert made <= ops.pod_uids((), cached=False, page=100)  # cluster-wide
    nodes = {n.metadata.uid: n.metadata.name for n in kube.core.list_node().items}
    assert ops.metadata_list("nodes", None, cached=False, page=2) == nodes

    def raw(accept: str | None) -> bytes:
        headers = {"Accept": accept} if accept else None
        resp = kube.core.list_namespaced_pod(namespace, _preload_content=False, _headers=headers)
        return bytes(resp.data)

    slim, full = raw(METADATA_LIST), raw(None)
    items = json.loads(slim)["items"]
    assert {i["metadata"]["uid"] for i in items} == made and not any("spec" in i for i in items)
    assert len(slim) * 2 < len(full), (len(slim), len(full))

    # The index (the watch cache) still shows p0, which the API server deleted meanwhile.
    index = [{"metadata": {"uid": p.metadata.uid, "name": p.metadata.name, "namespace": namespace}}
             for p in pods]  # fmt: skip
    kube.core.delete_namespaced_pod("p0", namespace, grace_period_seconds=0)
    eventually(lambda: pods[0].metadata.uid not in ops.pod_uids((namespace,), cached=False), "p0 gone")
    found = Ghosts().resync(index, lambda cached: ops.pod_uids((namespace,), cached=cached), second_look=1)
    assert [g["metadata"]["name"] for g in found] == ["p0"]


def test_a_tests_namespace_goes_though_its_job_keeps_the_operators_finalizer(kube: Kube) -> None:
    """A test stops its operator before its namespace is deleted, leaving the job's finalizer;
    `Kube.delete_namespace` takes it off, so the namespace goes instead of staying Terminating
    for the rest of the session (swept by kube-controller-manager several times a second)."""
    from kubernetes import client
    from topotrain import GROUP, PLURAL, VERSION
    from topotrain.controller.kopf_finalizer import FINALIZER

    from tests.integration.operator_support import install_crd

    install_crd(kube)
    name = f"t-finalized-{int(time.time() * 1000) % 10**8}"
    kube.core.create_namespace({"metadata": {"name": name, "labels": {"topotrain.io/test": "1"}}})
    custom = client.CustomObjectsApi(kube.api)
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
            "metadata": {"name": "left", "finalizers": [FINALIZER]},
            "spec": {"image": "topotrain/trainer:test", "parallelism": {"tensor": 1, "pipeline": 1, "data": 1},
                     "worker": {"gpusPerPod": 1}}}  # fmt: skip
    custom.create_namespaced_custom_object(GROUP, VERSION, name, PLURAL, body)
    kube.delete_namespace(name)
    eventually(lambda: not kube.core.list_namespace(field_selector=f"metadata.name={name}").items,
               f"namespace {name} deleted")  # fmt: skip


def _inotify_instances(pid: int) -> int:
    fds = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fds.iterdir() if fds.exists() else ():
        with contextlib.suppress(OSError):
            count += os.readlink(fd) == "anon_inode:inotify"
    return count


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts file descriptors in /proc")
def test_a_testbed_takes_few_of_the_hosts_inotify_instances(kube: Kube) -> None:
    """All of root's processes share 128 inotify instances (fs.inotify.max_user_instances): the
    kind nodes take about 70, each testbed its API server's 6 certificate watchers and what the
    controller manager watches. With the CSR signers' files that was 11 a testbed, and the Kueue
    suite's four testbeds beside the kind stage ran out (CI: Kueue exited "too many open files")."""
    bed = kube.require_testbed("counts the testbed's own processes")
    per = {row.name: _inotify_instances(row.pid) for row in bed.status() if row.pid is not None}
    assert per.get("kube-controller-manager", 0) <= 1, per
    assert sum(per.values()) <= 8, per
