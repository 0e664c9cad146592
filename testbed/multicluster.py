"""Three clusters for Kueue's MultiKueue: a manager and two workers, each its own testbed control
plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, KWOK) with the real Kueue
beside it, and one S3 server (the manager testbed's) that every cluster's jobs checkpoint to.

- The manager's Kueue runs with `multiKueue.externalFrameworks: [TrainingJob.v1alpha1.topotrain.io]`
  and a short `workerLostTimeout`; it has a `MultiKueueCluster` per worker (its admin kubeconfig
  in a Secret of Kueue's namespace), a `MultiKueueConfig` of both, an `AdmissionCheck` of
  controller `kueue.x-k8s.io/multikueue`, and a ClusterQueue using it over a TAS flavor with
  both workers' GPUs (a topology of no nodes: MultiKueue delays topology to the worker).
- Each worker has one 4-GPU node, the same queue names and a ClusterQueue with its 4 GPUs, and
  its Kueue runs with `waitForPodsReady` (a Workload whose pods are not ready in time is evicted).
- Every cluster runs the topotrain stack (testbed/harness_stack.py: the chart, the operator as a
  local process, the pod process harness; on the manager it only creates Workloads) in a
  namespace of the same name; the workers' pods run the stand-in trainer (testbed/standin.py).

`lose(worker)` takes a worker away as a lost cluster: its pods' processes are killed and its API
server stopped, so MultiKueue loses its connection and dispatches the job again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topotrain.core.kueue import KUEUE_API_VERSION

from testbed.client import api_client, core_v1
from testbed.cluster import Testbed
from testbed.harness_stack import CHART, S3Target, Stack
from testbed.kueue import KUEUE_NAMESPACE, KueueStack
from testbed.kueue_queues import Flavor, KueueQueues, pool_flavor, topology_levels
from testbed.nodes import apply_topology, wait_nodes_ready
from testbed.procs import wait_until
from testbed.topology import GPU_RESOURCE, parse_topology

WORKERS = ("worker-1", "worker-2")
EXTERNAL_FRAMEWORK = "TrainingJob.v1alpha1.topotrain.io"
CHECK = "multikueue"
WORKER_LOST_SECONDS = 10
# The workers' waitForPodsReady timeout (and recovery timeout): from admission to the gang
# running, long enough for a loaded CI machine (the operator's pod creates, KWOK's binding and
# the stand-in's start run beside the kind stage); at 20 s a CI run failed the first test.
PODS_READY_SECONDS = 60
FLEET: dict[str, Any] = {"name": "mk", "pools": [
    {"name": "mk-h100", "product": "H100-80GB", "gpusPerNode": 4, "blocks": 1, "racksPerBlock": 1,
     "nodesPerRack": 1, "nvlinkDomainNodes": 1}]}  # fmt: skip


@dataclass
class Member:
    """One cluster of the three."""

    name: str
    bed: Testbed
    kueue: KueueStack
    stack: Stack | None = None

    def kubectl(self, *args: str, check: bool = True) -> Any:
        assert self.stack is not None
        return self.stack.kubectl(*args, check=check)


@dataclass
class MultiCluster:
    """The manager and its workers under `root` (use as a context manager)."""

    root: Path
    namespace: str = field(default_factory=lambda: f"mk-{uuid.uuid4().hex[:6]}")
    members: dict[str, Member] = field(default_factory=dict)
    s3: S3Target | None = None

    def __post_init__(self) -> None:
        for name in ("manager", *WORKERS):
            bed = Testbed(self.root / name)
            extra = ({"multiKueue": {"externalFrameworks": [{"name": EXTERNAL_FRAMEWORK}],
                                     "workerLostTimeout": f"{WORKER_LOST_SECONDS}s"}}
                     if name == "manager" else {"waitForPodsReady": {"timeout": f"{PODS_READY_SECONDS}s"}})
            self.members[name] = Member(name, bed, KueueStack(bed, extra=extra))

    @property
    def manager(self) -> Member:
        return self.members["manager"]

    def worker(self, name: str) -> Member:
        return self.members[name]

    def __enter__(self) -> MultiCluster:
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for member in self.members.values():
            for stop in (lambda m=member: m.stack and m.stack.__exit__(),  # type: ignore[misc]
                         member.kueue.stop, member.bed.down):
                try:
                    stop()
                except Exception as err:  # tear the rest down regardless
                    print(f"multicluster teardown of {member.name}: {type(err).__name__}: {err}")

    def lose(self, worker: str) -> None:
        """The worker cluster is lost: its pods' processes die and its API server stops."""
        member = self.worker(worker)
        if member.stack is not None:
            if member.stack.harness is not None:
                member.stack.harness.stop()
            member.stack.stop_operator()
        member.bed.process("kube-apiserver").stop()

    # --- set-up ------------------------------------------------------------------

    def _up(self) -> None:
        for member in self.members.values():
            member.bed.up()
        for name in WORKERS:
            bed = self.worker(name).bed
            wait_nodes_ready(bed.kubeconfig, apply_topology(bed.kubeconfig, FLEET), timeout=180)
        server = self.manager.bed.s3
        bucket = server.create_bucket(f"mk-{uuid.uuid4().hex[:8]}")
        self.s3 = S3Target(server.endpoint, server.access_key, server.secret_key, bucket)
        for member in self.members.values():
            # topotrain's CRD first: the operators watch Workloads only when Kueue's CRDs exist
            # as they start, and MultiKueue watches TrainingJobs on the workers.
            member.kueue._kubectl("apply", "--server-side", "--force-conflicts", "--validate=false",
                                  "-f", str(CHART / "crds" / "topotrain.io_trainingjobs.yaml"))
            member.kueue.start()
            self._namespace(member.bed)
        for name in WORKERS:
            self._queues(self.worker(name), quota=4)
        self._multikueue()
        self._queues(self.manager, quota=4 * len(WORKERS), check=CHECK)
        for member in self.members.values():
            member.stack = Stack(member.bed.kubeconfig, self.namespace, self.root / "stacks" / member.name,
                                 self.s3).__enter__()

    def _namespace(self, bed: Testbed) -> None:
        with api_client(bed.kubeconfig) as api:
            core = core_v1(api)
            core.create_namespace({"metadata": {"name": self.namespace}})
            wait_until(lambda: bool(core.list_namespaced_service_account(
                self.namespace, field_selector="metadata.name=default").items), timeout=120,
                what=f"the default ServiceAccount of {self.namespace} on {bed.root.name}")  # fmt: skip

    def queues(self, quota: int) -> KueueQueues:
        """The same queue names on every cluster (MultiKueue's Workload clone keeps queueName)."""
        pool = parse_topology(FLEET).pools[0]
        flavor = pool_flavor(pool)
        return KueueQueues("mk", self.namespace, topology_levels(parse_topology(FLEET)),
                           (Flavor(flavor.name, flavor.node_labels, {GPU_RESOURCE: str(quota)}),))

    def _queues(self, member: Member, quota: int, check: str | None = None) -> None:
        made = self.queues(quota)
        objects = made.manifests()
        if check is not None:
            for obj in objects:
                if obj["kind"] == "ClusterQueue":
                    obj["spec"]["admissionChecksStrategy"] = {"admissionChecks": [{"name": check}]}
        member.kueue.apply(objects)
        member.kueue.wait_cluster_queue_active(made.cluster_queue, timeout=120)

    def _multikueue(self) -> None:
        """Secrets with the workers' kubeconfigs, MultiKueueClusters, the MultiKueueConfig and the
        AdmissionCheck, on the manager; waits until both clusters are connected."""
        objects: list[Mapping[str, Any]] = []
        for name in WORKERS:
            kubeconfig = self.worker(name).bed.kubeconfig.read_text()
            objects.append({"apiVersion": "v1", "kind": "Secret",
                            "metadata": {"name": f"{name}-kubeconfig", "namespace": KUEUE_NAMESPACE},
                            "stringData": {"kubeconfig": kubeconfig}})  # fmt: skip
            objects.append({"apiVersion": KUEUE_API_VERSION, "kind": "MultiKueueCluster",
                            "metadata": {"name": name}, "spec": {"clusterSource": {"kubeConfig": {
                                "locationType": "Secret", "location": f"{name}-kubeconfig"}}}})  # fmt: skip
        objects.append({"apiVersion": KUEUE_API_VERSION, "kind": "MultiKueueConfig",
                        "metadata": {"name": "mk"}, "spec": {"clusters": list(WORKERS)}})
        objects.append({"apiVersion": KUEUE_API_VERSION, "kind": "AdmissionCheck", "metadata": {"name": CHECK},
                        "spec": {"controllerName": "kueue.x-k8s.io/multikueue", "parameters": {
                            "apiGroup": "kueue.x-k8s.io", "kind": "MultiKueueConfig", "name": "mk"}}})  # fmt: skip
        self.manager.kueue.apply(objects)
        for name in WORKERS:
            wait_until(lambda n=name: self.active("multikueueclusters", n), timeout=120,  # type: ignore[misc]
                       what=f"MultiKueueCluster {name} connected", interval=0.5)
        wait_until(lambda: self.active("admissionchecks", CHECK), timeout=60,
                   what="the MultiKueue AdmissionCheck Active", interval=0.5)

    def active(self, kind: str, name: str) -> bool:
        out = self.manager.kueue._kubectl("get", f"{kind}.kueue.x-k8s.io", name, "-o", "json", check=False)
        if out.returncode:
            return False
        conditions = json.loads(out.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Active" and c["status"] == "True" for c in conditions)


def copies(member: Member, namespace: str) -> Iterator[dict[str, Any]]:
    """The TrainingJobs on a cluster (none when its API server is gone)."""
    out = member.kubectl("-n", namespace, "get", "trainingjobs", "-o", "json", check=False)
    if out.returncode == 0:
        yield from json.loads(out.stdout).get("items", [])
