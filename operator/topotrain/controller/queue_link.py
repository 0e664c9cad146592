"""Running under Kueue: the job's Workload, read (and created) once per pass, and written back.

A TrainingJob labelled `kueue.x-k8s.io/queue-name` is queued by Kueue before topotrain places
it. topotrain plays the part Kueue's own job integrations play for a batch Job or a JobSet:

- it creates the Workload (kueue.py `workload_for`: one podSet, the GPU requests, the TAS
  request derived from the parallelism), owned by the TrainingJob, so deleting the job releases
  the quota; a Workload of that name left by a deleted namesake is deleted first;
- while Kueue has not admitted it, the job waits (kueue_admission.py `QueueGate`, condition
  Admitted False naming the ClusterQueue); once admitted, the planner sees only the nodes of
  Kueue's topology assignment (each with room for the pods Kueue put there), at the admitted
  size (a partial admission gives a smaller allowed data degree), and the pods it places there
  carry a TAS annotation so Kueue counts them once; the flavor's other nodes are never used (Kueue
  may have promised them to admitted workloads whose pods do not exist yet): when a node of the
  assignment is lost and the gang no longer fits on the rest, the job is handed back to Kueue
  (`hand_back`: the Workload evicted with reason NodeFailures, naming the node), stops and gives
  its quota back as after any eviction, and Kueue admits it again with a new assignment;
- when Kueue evicts it (a preemption, a deactivation), the gang checkpoints and stops as for
  spec.suspend, and once none of its pods is left the quota is given back (`release`), so Kueue
  requeues it and readmits it later; the gang then resumes from the newest commit;
- spec.suspend sets the Workload inactive (Kueue frees the quota) and back;
- a finished job's Workload is deleted (its quota freed at once, the job and its checkpoints kept).

Every call goes through `Kube`; this module only decides which.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from topotrain.api.spec import TrainingJobSpec
from topotrain.controller.indexes import JobKey
from topotrain.controller.kube import ApiException, Kube, api_message
from topotrain.core import kueue, kueue_admission
from topotrain.core.kueue_admission import QueueGate
from topotrain.core.ownership import controller_owner, owned_by
from topotrain.core.status_edits import iso
from topotrain.placement.topology import TopologyLevels

log = logging.getLogger("topotrain.queue")


@dataclass(frozen=True)
class QueueView:
    """One pass's reading of the job's Workload."""

    gate: QueueGate
    node_labels: Mapping[str, str] = field(default_factory=dict)  # the admitted flavor's
    data: int | None = None  # the data degree the admission allows (None: not admitted)
    workload: Mapping[str, Any] | None = None
    # Kueue's topology assignment: pods per node (None: none, or not down to the node)
    hosts: Mapping[str, int] | None = None


def queue_name(body: Mapping[str, Any]) -> str | None:
    """The LocalQueue a job is sent to (its kueue.x-k8s.io/queue-name label), or None."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    name = labels.get(kueue.QUEUE_LABEL)
    return str(name) if name else None


class QueueLink:
    """The Workload of one TrainingJob."""

    def __init__(self, kube: Kube, key: JobKey, uid: str, levels: TopologyLevels) -> None:
        self.kube, self.key, self.uid, self.levels = kube, key, uid, levels
        self.name = kueue.workload_name(key[1])
        self._flavors: dict[str, Mapping[str, Any]] = {}
        self._local_queue: tuple[str, str] | None = None  # (LocalQueue, its ClusterQueue)

    def observe(self, body: Mapping[str, Any], spec: TrainingJobSpec,
                finished: bool = False) -> QueueView | None:
        """The job's Workload as Kueue left it (created when missing, unless the job `finished`);
        None: the job has no queue label."""
        queue = queue_name(body)
        if queue is None:
            return None
        namespace = self.key[0]
        try:
            workload = self.kube.workload(namespace, self.name)
        except ApiException as exc:
            return QueueView(QueueGate(admitted=False, message=(
                f"cannot read Workload {self.name} (is Kueue installed?): {api_message(exc)}")))
        if finished:
            mine = workload is not None and owned_by(workload.get("metadata") or {}, self.uid)
            return QueueView(QueueGate(admitted=True), workload=workload if mine else None)
        if workload is not None and not owned_by(workload.get("metadata") or {}, self.uid):
            return self._foreign(workload)
        if workload is None:
            made = self._create(queue, spec)
            if isinstance(made, QueueView):
                return made
            workload = made
        active = not spec.suspend
        if ((workload.get("spec") or {}).get("active", True) is not False) != active:
            # spec.suspend: Kueue evicts an inactive Workload and frees its quota (and back)
            self.kube.patch_workload(namespace, self.name, {"spec": {"active": active}})
        gate = kueue_admission.gate(workload, self.levels.gpu_resource, self._cluster_queue(queue))
        if not gate.admitted or gate.evicted:
            return QueueView(gate, workload=workload)
        admission = kueue_admission.admission_of(workload, self.levels.gpu_resource)
        assert admission is not None  # an admitted gate has one
        flavors = []
        for name in admission.flavors:
            flavor = self._flavor(name)
            if flavor is None:
                return QueueView(QueueGate(admitted=False, message=(
                    f"{gate.message}, but ResourceFlavor {name} does not exist")), workload=workload)
            flavors.append(flavor)
        data = kueue_admission.admitted_data(spec, admission.count)
        if data is None:
            return QueueView(QueueGate(admitted=False, message=(
                f"{gate.message}, but no allowed data degree fits {admission.count} pods")),
                workload=workload)
        return QueueView(gate, kueue_admission.flavor_node_labels(flavors), data, workload,
                         kueue_admission.assigned_hosts(workload, self.levels.host))

    def release(self, view: QueueView) -> None:
        """Give an evicted Workload's quota back (its gang is gone), so Kueue requeues it. Once
        given back (no admission left) nothing is written: every pass until Kueue admits the job
        again would otherwise patch the Workload, whose event wakes the job for the next pass."""
        if view.workload is None or not (view.workload.get("status") or {}).get("admission"):
            return
        patch = kueue_admission.release_status(view.workload, iso(datetime.now(UTC)))
        self.kube.patch_workload(self.key[0], self.name, patch, status=True)
        log.info("%s/%s: the gang is stopped; gave back Workload %s's quota", *self.key, self.name)

    def hand_back(self, view: QueueView, message: str) -> None:
        """A node of the job's topology assignment is lost and the gang fits nowhere else in it:
        evict the Workload (reason NodeFailures, as Kueue does when it finds no replacement), so
        the gang stops, `release` clears the admission and Kueue assigns the job anew."""
        if view.workload is None or view.gate.evicted or not view.gate.admitted:
            return
        patch = kueue_admission.hand_back_status(view.workload, message, iso(datetime.now(UTC)))
        self.kube.patch_workload(self.key[0], self.name, patch, status=True)
        log.info("%s/%s: handed Workload %s back to Kueue: %s", *self.key, self.name, message)

    def finish(self, view: QueueView) -> None:
        """The job finished: delete its Workload, freeing the quota at once."""
        meta = (view.workload or {}).get("metadata") or {}
        if meta.get("uid"):
            self.kube.delete_workload(self.key[0], self.name, str(meta["uid"]))

    def _create(self, queue: str, spec: TrainingJobSpec) -> dict[str, Any] | QueueView:
        priority = None
        class_name = spec.worker.priority_class_name
        if class_name:
            priority = self.kube.priority_value(class_name)
            if priority is None:
                return QueueView(QueueGate(admitted=False, message=(
                    f"spec.worker.priorityClassName: PriorityClass {class_name} does not exist, so "
                    "the Workload for Kueue cannot be created")))
        manifest = kueue.workload_for(self.key[1], self.key[0], self.uid, spec, queue, self.levels,
                                      priority=priority)
        workload = self.kube.create_workload(manifest)
        log.info("%s/%s: created Workload %s in LocalQueue %s", *self.key, self.name, queue)
        return workload

    def _foreign(self, workload: Mapping[str, Any]) -> QueueView:
        """A Workload of our name that is not this job's: a deleted namesake's is deleted (the
        garbage collector would, later), anyone else's is left alone and the job waits."""
        meta = workload.get("metadata") or {}
        owner = controller_owner(meta)
        if owner is not None and owner.kind == "TrainingJob" and owner.name == self.key[1]:
            self.kube.delete_workload(self.key[0], self.name, str(meta.get("uid") or ""))
            return QueueView(QueueGate(admitted=False, message=(
                f"deleting Workload {self.name} of an earlier TrainingJob of this name")))
        whose = f"{owner.kind} {owner.name}" if owner is not None else "no controller"
        return QueueView(QueueGate(admitted=False, message=(
            f"Workload {self.name} exists and belongs to {whose}, not this TrainingJob: delete it "
            "or rename the job")))

    def _cluster_queue(self, local_queue: str) -> str | None:
        """The ClusterQueue the job's LocalQueue points at (read once; None while it is missing)."""
        if self._local_queue is None or self._local_queue[0] != local_queue:
            found = self.kube.local_queue(self.key[0], local_queue)
            target = ((found or {}).get("spec") or {}).get("clusterQueue")
            if not target:
                return None
            self._local_queue = (local_queue, str(target))
        return self._local_queue[1]

    def _flavor(self, name: str) -> Mapping[str, Any] | None:
        if name not in self._flavors:
            flavor = self.kube.resource_flavor(name)
            if flavor is None:
                return None
            self._flavors[name] = flavor
        return self._flavors[name]
