"""The soak under Kueue (issue 37: "a Kueue eviction releases its quota within the bound").

With `--kueue` the rig runs the real Kueue (testbed/kueue.py: v0.17, topology-aware scheduling
on) beside the operator, adds a pool of its own to the fleet (`chaos-queued`, GPUs of a product
no other shape asks for, so Kueue's view of its nodes is only the queued jobs) and a
ClusterQueue over it with less quota than the pool has GPUs; every fourth job of the stream is
a `queued` job (two 1-GPU pods) labelled for its LocalQueue. The `kueue-preempt` fault makes
Kueue evict some of them the way a platform's higher-priority work does: a Workload of a
higher WorkloadPriorityClass asking for more GPUs than the queue has free, in the same
ClusterQueue (preemption `withinClusterQueue: LowerPriority`). Kueue evicts the lowest-priority
admitted Workloads; the operator stops their gangs (checkpoint first, within
`checkpointRequestTimeoutSeconds` whatever the store's state) and gives their quota back; Kueue
admits the preemptor. After the fault's duration the preemptor is deleted and the evicted jobs
are admitted again and resume. The preemptor has no pods: Kueue holds quota for it, nothing
runs. Invariant 14 (checkers_kueue.py) judges the time from each eviction to its quota given back.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Any

from topotrain.core.kueue import KUEUE_API_VERSION, QUEUE_LABEL
from topotrain.placement.topology import TopologyLevels, pod_gpus

from testbed.chaos.catalogue import Fault
from testbed.chaos.tenant import delete_until_gone
from testbed.kueue_queues import Flavor, KueueQueues, pool_flavor
from testbed.topology import GPU_RESOURCE, HOSTNAME_LABEL, PRODUCT_LABEL, parse_topology

PRODUCT = "L40S-48GB"  # the queued pool's GPUs: no other shape of the soak accepts them
POOL: dict[str, Any] = {"name": "chaos-queued", "product": PRODUCT, "gpusPerNode": 8, "blocks": 1,
                        "racksPerBlock": 1, "nodesPerRack": 2, "nvlinkDomainNodes": 1}  # fmt: skip
QUOTA = 8  # GPUs of the ClusterQueue: four queued jobs at once, of the pool's 16
PREFIX = "chaos"
PREEMPTOR_CLASS = "chaos-preemptor"
PREEMPTOR_PRIORITY = 1000
GROUP, VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta2", "workloads"


def queues(namespace: str) -> KueueQueues:
    """Topology, ResourceFlavor (the queued pool), ClusterQueue of QUOTA GPUs, LocalQueue."""
    (pool,) = parse_topology({"name": POOL["name"], "pools": [POOL]}).pools  # as a fleet file says it
    flavor = pool_flavor(pool)
    flavor = Flavor(flavor.name, flavor.node_labels, {GPU_RESOURCE: str(QUOTA)})
    return KueueQueues(PREFIX, namespace, TopologyLevels(nvlink=HOSTNAME_LABEL), (flavor,))


def priority_class() -> dict[str, Any]:
    return {"apiVersion": KUEUE_API_VERSION, "kind": "WorkloadPriorityClass",
            "metadata": {"name": PREEMPTOR_CLASS}, "value": PREEMPTOR_PRIORITY}  # fmt: skip


def queue_labels(namespace: str) -> dict[str, str]:
    """The labels of a queued job: its LocalQueue."""
    return {QUEUE_LABEL: queues(namespace).local_queue}


def preemptor(name: str, namespace: str, gpus: int) -> dict[str, Any]:
    """A Workload of a higher priority asking for `gpus` 1-GPU pods on the queued pool; no
    object owns it and no pod is ever made for it."""
    template = {"spec": {"restartPolicy": "Never", "nodeSelector": {PRODUCT_LABEL: PRODUCT},
                         "containers": [{"name": "main", "image": "preemptor",
                                         "resources": {"requests": {GPU_RESOURCE: "1"}}}]}}  # fmt: skip
    return {
        "apiVersion": KUEUE_API_VERSION, "kind": "Workload",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"queueName": queues(namespace).local_queue, "priority": PREEMPTOR_PRIORITY,
                 "priorityClassRef": {"group": GROUP, "kind": "WorkloadPriorityClass", "name": PREEMPTOR_CLASS},
                 "podSets": [{"name": "main", "count": gpus, "template": template,
                              "topologyRequest": {"unconstrained": True}}]},
    }  # fmt: skip


def workload_record(workload: dict[str, Any]) -> dict[str, Any]:
    """What the observer keeps of a Workload: its owner job, conditions (with their times) and
    whether it holds an admission."""
    meta, status = workload["metadata"], workload.get("status") or {}
    owner = next((o["name"] for o in meta.get("ownerReferences") or [] if o.get("kind") == "TrainingJob"), None)
    return {
        "name": meta["name"], "job": owner, "admitted": bool(status.get("admission")),
        "conditions": [(c.get("type"), c.get("status"), c.get("reason"), c.get("lastTransitionTime"))
                       for c in status.get("conditions") or []],
        "gpus": workload_gpus(workload),
    }  # fmt: skip


def workload_gpus(workload: dict[str, Any]) -> int:
    """The GPUs a Workload asks for: each pod set's count times its pods' GPU requests."""
    return sum(int(pod_set.get("count") or 0) * pod_gpus((pod_set.get("template") or {}).get("spec") or {}, GPU_RESOURCE)
               for pod_set in (workload.get("spec") or {}).get("podSets") or [])  # fmt: skip


def reserved(record: dict[str, Any]) -> bool:
    return any(c[0] == "QuotaReserved" and c[1] == "True" for c in record["conditions"])


class KueueFaults:
    """The `kueue-preempt` class, a mixin of the Nemesis (needs its rig, stop event, `_record`)."""

    rig: Any  # the Nemesis's testbed.chaos.rig.Rig (rig imports this module)
    _stop: threading.Event

    def _workloads(self) -> list[dict[str, Any]]:
        raw = self.rig.stack.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.rig.namespace, WORKLOADS, _preload_content=False)
        return [workload_record(w) for w in json.loads(raw.data)["items"]]

    def _kueue_preempt(self, fault: Fault) -> None:
        nemesis: Any = self
        if not self.rig.kueue_on:
            return nemesis._skip(fault, "the soak runs without Kueue (--kueue)")
        holding = [w for w in self._workloads() if w["job"] and reserved(w)]
        if not holding:
            return nemesis._skip(fault, "no queued job holds quota")
        used = sum(w["gpus"] for w in holding)  # (each queued job: two 1-GPU pods)
        # more than the queue has free: Kueue evicts one to all of the holders to make room
        want = min(QUOTA, QUOTA - used + 1 + int(fault.size * (used - 1)))
        name = f"preemptor-{fault.index:04d}"
        nemesis._record(fault, [w["job"] for w in holding], preemptor=name, gpus=want)
        custom = self.rig.stack.custom
        custom.create_namespaced_custom_object(GROUP, VERSION, self.rig.namespace, WORKLOADS,
                                               preemptor(name, self.rig.namespace, want))  # fmt: skip
        evicted: set[str] = set()
        deadline = time.monotonic() + fault.duration
        try:
            while not self._stop.wait(2.0) and time.monotonic() < deadline:
                try:
                    evicted |= {w["job"] for w in self._workloads() if w["job"] and any(
                        c[0] == "Evicted" and c[1] == "True" for c in w["conditions"])}
                except Exception:  # the API server away (another fault): look again next time
                    continue
        finally:
            delete_until_gone(functools.partial(custom.delete_namespaced_custom_object, GROUP, VERSION,
                                                self.rig.namespace, WORKLOADS, name))  # fmt: skip
        # the evidence that Kueue really preempted (a preemptor that evicted nobody proves nothing)
        self.rig.history.add("heal", index=fault.index, kind=fault.kind.value, evicted=sorted(evicted))
