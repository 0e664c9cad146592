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
- a finished job's Workload is deleted (its quota freed at once, the job and its checkpoints kept);
- the Workload's PodsReady condition follows the gang (`pods_ready`, core/kueue_pods.py), and the
  admission checks' podSetUpdates are handed on to the pods (`QueueView.updates`);
- a job annotated `kueue.x-k8s.io/elastic-job: "true"` has its resizes accounted by Kueue
  (core/kueue_slices.py): a shrink lowers its Workload's count, a grow waits for a slice;
- with Kueue's MultiKueue (core/multikueue.py): on the manager cluster a job managed by MultiKueue
  only gets its Workload (`dispatched`); on a worker the copy MultiKueue made adopts the prebuilt
  Workload its label names instead of creating one, reads the run's identity off it, and marks it
  Finished at the end rather than deleting it (the manager would take that for a lost worker).

Every call goes through `Kube`; this module only decides which.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from topotrain.api.spec import TrainingJobSpec
from topotrain.controller.apicalls import api_message
from topotrain.controller.indexes import JobKey
from topotrain.controller.kube import ApiException, Kube
from topotrain.core import kueue, kueue_admission, kueue_pods, kueue_slices, multikueue
from topotrain.core.kueue_admission import QueueGate
from topotrain.core.kueue_pods import PodSetUpdate
from topotrain.core.manifests import JobMeta, owner_reference
from topotrain.core.ownership import controller_owner, owned_by
from topotrain.core.status_edits import iso
from topotrain.placement.request import GangRequest
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
    run_uid: str | None = None  # the run's identity (multikueue.py); "": not known yet
    updates: PodSetUpdate = field(default_factory=PodSetUpdate)  # the admission checks' podSetUpdates


def queue_name(body: Mapping[str, Any]) -> str | None:
    """The LocalQueue a job is sent to (its kueue.x-k8s.io/queue-name label), or None."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    name = labels.get(kueue.QUEUE_LABEL)
    return str(name) if name else None


def admitted_spec(spec: TrainingJobSpec, view: QueueView | None) -> TrainingJobSpec:
    """The spec the gang is built from under Kueue: at the data degree Kueue admitted (a partial
    admission admits fewer pods), with the admission checks' podSetUpdates on its pods."""
    if view is None:
        return spec
    if view.data is not None and view.data != spec.parallelism.data:
        spec = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"data": view.data})})
    return kueue_pods.with_pod_set_updates(spec, view.updates)


class QueueLink:
    """The Workload of one TrainingJob."""

    def __init__(self, kube: Kube, key: JobKey, uid: str, levels: TopologyLevels) -> None:
        self.kube, self.key, self.uid, self.levels = kube, key, uid, levels
        self.name = kueue.workload_name(key[1])
        self.prebuilt = False  # the Workload is MultiKueue's prebuilt one (the job's label says)
        self.run = ""  # a prebuilt Workload's run identity, once read ("": not yet)
        self.sliced = False  # Kueue accounts the job's resizes (kueue_slices.py)
        self.pending: Mapping[str, Any] | None = None  # a slice Kueue has not admitted yet
        self._flavors: dict[str, Mapping[str, Any]] = {}
        self._local_queue: tuple[str, str] | None = None  # (LocalQueue, its ClusterQueue)

    def observe(self, body: Mapping[str, Any], spec: TrainingJobSpec,
                finished: bool = False) -> QueueView | None:
        """The job's Workload as Kueue left it (created when missing, unless the job `finished` or
        MultiKueue prebuilt it); None: the job has no queue label. The view names the run the
        job's checkpoints belong to (`run_uid`): the job's own UID, or for a copy MultiKueue
        dispatched here the one its prebuilt Workload carries ("" while that is not known yet)."""
        queue = queue_name(body)
        if queue is None:
            return None
        prebuilt = multikueue.prebuilt_workload(body)
        self.name, self.prebuilt = prebuilt or kueue.workload_name(self.key[1]), prebuilt is not None
        self.sliced = prebuilt is None and kueue_slices.elastic(body)
        try:
            workload = self._slices() if self.sliced else self.kube.workload(self.key[0], self.name)
        except ApiException as exc:
            return QueueView(QueueGate(admitted=False, message=(
                f"cannot read Workload {self.name} (is Kueue installed?): {api_message(exc)}")),
                run_uid=self.run if self.prebuilt else self.uid)
        if self.prebuilt and workload is not None:
            self.run = multikueue.run_uid(self.uid, workload, prebuilt=True)
        view = self._observe(queue, workload, spec, finished)
        return replace(view, run_uid=(self.run if self.prebuilt else self.uid))

    def _observe(self, queue: str, workload: Mapping[str, Any] | None, spec: TrainingJobSpec,
                 finished: bool) -> QueueView:
        if finished:
            mine = workload is not None and owned_by(workload.get("metadata") or {}, self.uid)
            return QueueView(QueueGate(admitted=True), workload=workload if mine else None)
        if self.prebuilt:
            adopted = self._adopt(workload)
            if isinstance(adopted, QueueView):
                return adopted
            workload = adopted
        elif workload is not None and not owned_by(workload.get("metadata") or {}, self.uid):
            return self._foreign(workload)
        if workload is None:
            made = self._create(queue, spec)
            if isinstance(made, QueueView):
                return made
            workload = made
        self._activate(workload, spec)
        view = self._admitted(workload, spec, queue)
        if self.sliced and not view.gate.evicted:
            view = self._resize(view, workload, spec, queue)
        return replace(view, updates=kueue_pods.pod_set_updates(workload))

    def _slices(self) -> dict[str, Any] | None:
        """An elastic job's Workload under Kueue's accounting (kueue_slices.py): both names read,
        the Finished one (replaced by an admitted slice) deleted, the pending slice kept aside."""
        first, second = (self.kube.workload(self.key[0], n) for n in kueue_slices.slice_names(self.key[1]))
        mine = [w if w is not None and owned_by(w.get("metadata") or {}, self.uid) else None
                for w in (first, second)]  # fmt: skip
        if first is not None and mine[0] is None:
            return first  # a namesake's: _foreign says what to do
        found = kueue_slices.read(*mine)
        for old in found.stale:
            log.info("%s/%s: deleting Workload %s, replaced by a slice", *self.key, self._delete(old))
        self.pending = found.pending
        if found.current is not None:
            self.name = str((found.current.get("metadata") or {}).get("name"))
        return dict(found.current) if found.current is not None else None

    def _delete(self, workload: Mapping[str, Any]) -> str:
        """Delete that Workload of the job (that uid only); its name."""
        meta = workload.get("metadata") or {}
        self.kube.delete_workload(self.key[0], str(meta.get("name")), str(meta.get("uid") or ""))
        return str(meta.get("name"))

    def _drop_pending(self) -> None:
        if self.pending is not None:
            self._delete(self.pending)
            self.pending = None

    def _resize(self, view: QueueView, workload: Mapping[str, Any], spec: TrainingJobSpec,
                queue: str) -> QueueView:
        """Bring Kueue's accounting to the job's desired size: a lower count in place, or a slice
        for a larger one (the job keeps its admitted size until Kueue admits the slice)."""
        desired = GangRequest.from_spec(spec).pods()
        plan = kueue_slices.resize(kueue_slices.Slices(workload, self.pending), desired)
        if plan.drop_pending:
            self._drop_pending()
        pending = self.pending
        try:
            for count in (plan.shrink, plan.requeue):
                if count is not None:
                    self.kube.patch_workload(self.key[0], self.name, kueue_slices.with_count(workload, count))
                    log.info("%s/%s: Workload %s counts %d pods now", *self.key, self.name, count)
            if plan.recount is not None and pending is not None:
                name = str((pending.get("metadata") or {}).get("name"))
                self.kube.patch_workload(self.key[0], name, kueue_slices.with_count(pending, plan.recount))
            if plan.grow is not None:
                pending = self.kube.create_workload(kueue.workload_for(
                    self.key[1], self.key[0], self.uid, spec, queue, self.levels, sliced=True,
                    priority=(workload.get("spec") or {}).get("priority"),
                    name=kueue_slices.other(self.key[1], self.name), replaces=f"{self.key[0]}/{self.name}"))
        except ApiException as exc:  # without Kueue's gate a lower count is refused; stale: next pass
            log.warning("%s/%s: Kueue's accounting not resized: %s", *self.key, api_message(exc))
        self.pending = pending
        if pending is None:
            return view
        waiting = (pending.get("metadata") or {}).get("name")
        return replace(view, gate=replace(view.gate, message=(
            f"{view.gate.message}; growing to {desired} pods waits for Kueue to admit slice Workload {waiting}")))

    def dispatched(self, body: Mapping[str, Any]) -> None:
        """A job MultiKueue dispatches (on the manager cluster): its Workload, created when missing
        (unless the job finished, as the status MultiKueue copies from the worker says) and kept
        active as spec.suspend says; nothing else, and nothing for a spec that does not parse."""
        queue = queue_name(body)
        try:
            spec = TrainingJobSpec.model_validate(dict(body.get("spec") or {}))
        except ValidationError:
            return
        if queue is None:
            return
        finished = (body.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        self.name = kueue.workload_name(self.key[1])
        workload = self.kube.workload(self.key[0], self.name)
        if workload is not None and not owned_by(workload.get("metadata") or {}, self.uid):
            self._foreign(workload)  # a deleted namesake's goes; anyone else's stays
            return
        if workload is None and not finished:
            made = self._create(queue, spec)
            workload = None if isinstance(made, QueueView) else made
        if workload is None:
            return
        self._activate(workload, spec)
        phase = (body.get("status") or {}).get("phase")
        if multikueue.release_dispatched(workload, phase):
            # Kueue's job framework does this for its own jobs: an evicted Workload's quota is
            # given back once the job no longer runs, so Kueue requeues it and MultiKueue
            # dispatches it again (to another worker, when its own was lost).
            patch = kueue_admission.release_status(workload, iso(datetime.now(UTC)))
            self.kube.patch_workload(self.key[0], self.name, patch, status=True)
            log.info("%s/%s: Workload %s evicted on the manager; gave its quota back", *self.key, self.name)

    def _activate(self, workload: Mapping[str, Any], spec: TrainingJobSpec) -> None:
        active = not spec.suspend
        if ((workload.get("spec") or {}).get("active", True) is not False) != active:
            # spec.suspend: Kueue evicts an inactive Workload and frees its quota (and back)
            self.kube.patch_workload(self.key[0], self.name, {"spec": {"active": active}})

    def _admitted(self, workload: Mapping[str, Any], spec: TrainingJobSpec, queue: str) -> QueueView:
        """What Kueue's admission lets the gang do: wait, stop, or run where and how large."""
        gate = kueue_admission.gate(workload, self.levels.gpu_resource, self._cluster_queue(queue))
        if not gate.admitted or gate.evicted:
            return QueueView(gate, workload=workload)
        admission = kueue_admission.admission_of(workload, self.levels.gpu_resource)
        assert admission is not None  # an admitted gate has one
        counted = kueue_slices.pod_count(workload)
        if self.sliced and admission.count is not None and counted:  # growing back needs a slice
            admission = replace(admission, count=min(admission.count, counted))
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

    def _adopt(self, workload: Mapping[str, Any] | None) -> dict[str, Any] | QueueView:
        """The Workload MultiKueue prebuilt for this copy of a dispatched job, made this job's (an
        owner reference, as Kueue's own integrations adopt one); a view that waits when it is
        missing or another object's."""
        if workload is None:
            return QueueView(QueueGate(admitted=False, message=(
                f"waiting for Workload {self.name}, which MultiKueue builds for this job "
                f"(label {multikueue.PREBUILT_LABEL})")))
        meta = workload.get("metadata") or {}
        owner = controller_owner(meta)
        if owner is not None and owner.uid != self.uid:
            return QueueView(QueueGate(admitted=False, message=(
                f"prebuilt Workload {self.name} belongs to {owner.kind} {owner.name}, not this "
                "TrainingJob: delete it or the job")))
        reference = owner_reference(JobMeta(self.key[1], self.key[0], self.uid))
        patch = multikueue.adoption_patch(workload, reference, self.uid)
        if patch is None:
            return dict(workload)
        self.kube.patch_workload(self.key[0], self.name, patch)
        log.info("%s/%s: adopted Workload %s prebuilt by MultiKueue", *self.key, self.name)
        adopted = dict(workload)
        adopted["metadata"] = {**meta, "ownerReferences": patch["metadata"]["ownerReferences"]}
        return adopted

    def release(self, view: QueueView) -> None:
        """Give an evicted Workload's quota back (its gang is gone), so Kueue requeues it. Once
        given back (no admission left) nothing is written: every pass until Kueue admits the job
        again would otherwise patch the Workload, whose event wakes the job for the next pass."""
        self._drop_pending()  # requeued whole, at the count it holds; a grow asks again
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

    def finish(self, view: QueueView, succeeded: bool, message: str) -> None:
        """The job finished: delete its Workload, freeing the quota at once; a Workload MultiKueue
        prebuilt is marked Finished instead (the manager finishes its own from it)."""
        workload = view.workload or {}
        meta = workload.get("metadata") or {}
        self._drop_pending()
        if not meta.get("uid"):
            return
        if self.prebuilt:
            patch = multikueue.finished_status(workload, succeeded, message, iso(datetime.now(UTC)))
            if patch is not None:
                self.kube.patch_workload(self.key[0], self.name, patch, status=True)
            return
        self.kube.delete_workload(self.key[0], self.name, str(meta["uid"]))

    def pods_ready(self, view: QueueView, running: bool) -> None:
        """Keep the Workload's PodsReady condition as Kueue's integrations do (a cluster with
        waitForPodsReady evicts a Workload whose pods are not ready in time). A Workload Kueue
        changed since this pass read it is left for the next pass."""
        if view.workload is None:
            return
        patch = kueue_pods.pods_ready_status(view.workload, running, iso(datetime.now(UTC)))
        if patch is None:
            return
        try:
            self.kube.patch_workload(self.key[0], self.name, patch, status=True)
        except ApiException as exc:
            if exc.status != 409:
                raise

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
                                      priority=priority, sliced=self.sliced, name=self.name)
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
