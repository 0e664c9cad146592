"""Carrying out a reconcile decision against the API server, in a safe order.

Order within a pass: delete what must go; apply the Service and the rank
table; record the new pods in the ledger, create them all behind the gang
gate, and only when every one exists release the gate on all of them, so a
gang never half-starts and never holds GPUs while waiting for the rest.
Nothing here touches an object of a child's name that another owner holds
(see ownership.py): such a Service or ConfigMap stops the launch, such a pod
is refused, and neither is deleted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from topotrain.api.spec import TrainingJobSpec
from topotrain.contract import CHECKPOINT_REQUEST
from topotrain.controller.apicalls import drain
from topotrain.controller.indexes import JobKey
from topotrain.controller.kube import ApiException, Kube, StaleWrite
from topotrain.controller.settings import Settings
from topotrain.controller.snapshot import Ledger
from topotrain.controller.status_patch import tested_patch
from topotrain.core.decision import Decision, Launch
from topotrain.core.kueue_admission import TAS_POD_ANNOTATION
from topotrain.core.manifests import (
    ATTEMPT_LABEL,
    FIELD_OWNER,
    JobMeta,
    PodPlan,
    bind,
    network_policy,
    pod,
    pod_name,
    restart_in_place_patch,
    service,
)
from topotrain.core.ownership import ForeignObject
from topotrain.core.rank_table import rank_table

log = logging.getLogger("topotrain.act")
RELEASED_MEMORY = 60.0  # seconds a released pod is not released again (a repeat would be a 422)
# The operator replica (Settings.identity, the Lease's holder) that created a pod.
CREATED_BY_ANNOTATION = "topotrain.io/created-by"


class Actuator:
    """Applies decisions for one job."""

    def __init__(self, kube: Kube, settings: Settings, ledger: Ledger) -> None:
        self.kube = kube
        self.settings = settings
        self.ledger = ledger
        # (reason, message) when the last pass met an object of ours that someone else owns
        self.problem: tuple[str, str] | None = None
        # pods the last apply found gone (404) though the pass's snapshot showed them
        self.gone: list[str] = []
        # nodes of Kueue's topology assignment: a pod placed on one is marked as a TAS pod, so
        # Kueue counts its GPUs through the Workload only (kueue.TAS_POD_ANNOTATION)
        self.tas_hosts: frozenset[str] = frozenset()
        # the job runs under Kueue (its pods may carry Kueue's own gates: every pod is released)
        self.queued = False
        self._released: dict[str, float] = {}  # pod name -> when this process released it
        self._acting = 0  # applies in flight (apply_in_thread)
        self._ended: tuple[str, str] | None = None  # (namespace, uid) of a loop that ended meanwhile
        self._created: frozenset[str] = frozenset()  # the pods the apply in flight has created
        self._mutex = threading.Lock()
        # The job's pods as the pass's decision saw them (name -> slim pod, from the watch): a
        # delete or relabel applies only to that version of the pod (kube.py's preconditions).
        self.seen: Mapping[str, Mapping[str, Any]] = {}

    async def apply_in_thread(self, key: JobKey, body: Mapping[str, Any], spec: TrainingJobSpec,
                              decision: Decision) -> dict[str, str]:
        """`apply` in a worker thread, carried to its end even when the caller is cancelled (the
        job's loop stopping while a gang's pods are created: they take their GPUs all the same,
        and `job_ended` keeps their holds in the ledger until the creates have returned)."""
        with self._mutex:
            self._acting += 1
        done = asyncio.get_running_loop().run_in_executor(None, self._apply_counted, key, body, spec, decision)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # a cancelled caller's, read
        return await asyncio.shield(done)

    def _apply_counted(self, key: JobKey, body: Mapping[str, Any], spec: TrainingJobSpec,
                       decision: Decision) -> dict[str, str]:
        try:
            return self.apply(key, body, spec, decision)
        finally:
            with self._mutex:
                self._acting -= 1
                ended = self._ended if not self._acting else None
            if ended is not None:
                self.ledger.forget_owned(*ended, keep=self._created)

    def job_ended(self, namespace: str, uid: str) -> None:
        """The job's loop ended (the job was deleted, the operator stops): its pods the watch has
        not shown hold no GPUs any more, except those an apply still in flight creates: those
        exist (or are about to), and keep their holds until the watch shows them."""
        with self._mutex:
            if self._acting:
                self._ended = (namespace, uid)
                return
        self.ledger.forget_owned(namespace, uid)

    def apply(
        self, key: JobKey, body: Mapping[str, Any], spec: TrainingJobSpec, decision: Decision,
    ) -> dict[str, str]:
        """Carry out `decision`; returns the pods the API server refused (name -> its message)."""
        namespace = key[0]
        refused: dict[str, str] = {}
        self.problem, self.gone, self._created = None, [], frozenset()
        if decision.delete:
            versions = {name: (str(meta["uid"]), str(meta.get("resourceVersion") or ""))
                        for name in decision.delete
                        if (meta := (self.seen.get(name) or {}).get("metadata") or {}).get("uid")}
            # (1 s, not 0: a grace of 0 is a force delete, which frees the pods' GPUs in the
            # scheduler's view while their containers still run)
            grace = 1 if decision.delete_now else self.settings.pod_grace_seconds
            self.gone += self.kube.delete_pods(namespace, decision.delete, grace,
                                               versions)
            for name in decision.delete:
                self.ledger.forget(namespace, name)
        if decision.relabel is not None:
            # Kept pods move to the in-place attempt before its replacement pods exist; each only
            # if it is still at the attempt the decision saw (else the pass ends: StaleWrite).
            move = decision.relabel
            patch = restart_in_place_patch(move.attempt, move.resume_step, move.master_addr)["metadata"]
            attempts = {name: str(labels[ATTEMPT_LABEL]) for name in move.pods
                        if ATTEMPT_LABEL in (labels := _labels(self.seen.get(name)))}
            self.gone += relabel_pods(self.kube, namespace, attempts, patch)
            if unseen := [name for name in move.pods if name not in attempts]:
                self.gone += self.kube.patch_pods(namespace, unseen, {"metadata": patch})
        if decision.checkpoint_request is not None:
            # The trainer reads its pod's annotations through the control volume.
            ask = decision.checkpoint_request
            self.gone += self.kube.patch_pods(namespace, list(ask.pods),
                                              {"metadata": {"annotations": {CHECKPOINT_REQUEST: ask.value}}})
        if decision.launch is not None:
            try:
                refused = self._launch(key, _job_meta(key, body), spec, decision.launch)
            except ForeignObject as exc:  # the next pass's Observer says so in ConfigValid
                log.warning("%s/%s: %s", *key, exc.message)
                self.problem = exc.problem
                return {}
        if decision.release and not refused:
            self.gone += self._release(namespace, decision.release)
        if decision.delete_job:  # spec.ttlSecondsAfterFinished; the children go by owner reference
            self.kube.delete_job(namespace, key[1], str(body["metadata"]["uid"]))
        return refused

    def _release(self, namespace: str, names: list[str]) -> list[str]:
        """Release the gate of `names`, except those this process released in the last
        RELEASED_MEMORY seconds: the next pass often sees them still gated (the watch has not
        brought the change yet), and a burst of new jobs made each gang's release twice."""
        now = time.monotonic()
        self._released = {n: t for n, t in self._released.items() if now - t < RELEASED_MEMORY}
        todo = [n for n in names if n not in self._released]
        if not todo:
            return []
        gone = self.kube.release_pods(namespace, todo)
        self._released.update(dict.fromkeys(todo, now))
        return gone

    def reserve(self, key: JobKey, body: Mapping[str, Any], spec: TrainingJobSpec,
                decision: Decision) -> None:
        """Record the pods `decision` will create in the ledger (no I/O): called under the plan
        lock, so the next job's plan counts their GPUs as taken before they exist."""
        if decision.launch is not None:
            for manifest in self._manifests(_job_meta(key, body), spec, decision.launch):
                self.ledger.record(key, manifest)

    def unreserve(self, key: JobKey, decision: Decision) -> None:
        """The pass failed before creating the launch's pods: free their GPUs at once."""
        launch = decision.launch
        if launch is not None:
            for i in launch.only or tuple(sorted(launch.assignments)):
                self.ledger.forget(key[0], pod_name(key[1], launch.attempt, i))

    def _manifests(self, job: JobMeta, spec: TrainingJobSpec, launch: Launch) -> list[dict[str, Any]]:
        settings = self.settings
        indices = launch.only or tuple(sorted(launch.assignments))
        # The operator binds (docs/operator.md, "Who binds a pod"): each pod is created on its
        # planned node, so neither a gate release nor a scheduler's bind is written for it.
        binds = launch.release and not self.queued and settings.pod_binding == "operator"
        manifests = [
            pod(job, spec, PodPlan(
                attempt=launch.attempt, index=i, node=launch.assignments[i], data=launch.data,
                resume_step=launch.resume_step, master_port=settings.master_port,
                s3_endpoint=settings.s3_endpoint, master_addr=launch.master_addr,
            ))
            for i in indices
        ]
        for manifest, i in zip(manifests, indices, strict=True):
            manifest["metadata"].setdefault("annotations", {})[CREATED_BY_ANNOTATION] = settings.identity
            if launch.assignments[i] in self.tas_hosts:
                manifest["metadata"].setdefault("annotations", {})[TAS_POD_ANNOTATION] = (
                    settings.labels.block)
            if binds:
                bind(manifest, launch.assignments[i])
        if not binds and launch.release and len(manifests) == 1 and not self.queued:
            # One pod is all that starts (a one-pod gang, an in-place restart's replacement): it
            # is created ungated, not gated and then released by a second API call.
            manifests[0]["spec"].pop("schedulingGates", None)
        return manifests

    def _launch(
        self, key: JobKey, job: JobMeta, spec: TrainingJobSpec, launch: Launch,
    ) -> dict[str, str]:
        settings = self.settings
        children = [service(job, settings.master_port)]
        if settings.network_policy:
            children.append(network_policy(job, spec.metrics_port))
        if not launch.only or launch.in_place:
            children.append(rank_table(job, spec, launch.attempt, launch.data, launch.pool, launch.assignments))
        # At once, not one after the other: each is a read and an apply, and a launch pass's
        # round trips add up on a busy API server (a new job's first pass took over a second
        # while a 1,024-pod gang started). The first refusal (ForeignObject) is raised when all
        # are done; the pods are created only once every child is in place.
        self.kube.apply_all(children)
        manifests = self._manifests(job, spec, launch)
        for manifest in manifests:
            self.ledger.record(key, manifest)
        created, refused = self.kube.create_pods(manifests)
        self._created = frozenset(created)
        # (an in-place restart's other indices are kept pods of earlier attempts: never touched here)
        every = [pod_name(job.name, launch.attempt, i)
                 for i in sorted(launch.only if launch.in_place else launch.assignments)]
        if refused:
            # Never leave half a gang holding quota or GPUs: take back what was created, gated.
            log.warning("%s/%s attempt %d: the API server refused %d pod(s) (%s); deleting the "
                        "%d created", *key, launch.attempt, len(refused),
                        next(iter(refused.values())), len(created))
            # (a refused name is not ours: absent, or a foreign pod that must stay)
            self.kube.delete_pods(job.namespace, [n for n in every if n not in refused], 0)
            for name in every:
                self.ledger.forget(job.namespace, name)
            return refused
        if launch.release and _gated(manifests):
            self._release(job.namespace, every)
        return {}


def relabel_pods(kube: Kube, namespace: str, seen: Mapping[str, str],
                 patch: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Set `patch`'s labels and annotations on each pod of `seen` whose attempt label still holds
    the value the pass saw (`seen`: name -> value); raises StaleWrite when one's does not."""
    def one(name: str) -> None:
        try:
            drain(kube.core.patch_namespaced_pod(name, namespace, tested_patch(ATTEMPT_LABEL, seen[name], patch),
                                                 field_manager=FIELD_OWNER, _preload_content=False,
                                                 _content_type="application/json-patch+json"))
        except ApiException as exc:
            if exc.status == 422:
                raise StaleWrite(f"pod {namespace}/{name}'s attempt is no longer {seen[name]}", exc) from None
            raise

    return kube.each_pod(list(seen), one)


def acts(decision: Decision) -> bool:
    """Whether the pass goes on to change pods or the Workload after its status write."""
    return bool(decision.delete or decision.launch or decision.relabel or decision.release
                or decision.checkpoint_request or decision.release_quota or decision.delete_job)


def _labels(pod: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return ((pod or {}).get("metadata") or {}).get("labels") or {}


def _gated(manifests: list[dict[str, Any]]) -> bool:
    return any(m["spec"].get("schedulingGates") for m in manifests)


def _job_meta(key: JobKey, body: Mapping[str, Any]) -> JobMeta:
    meta = body.get("metadata", {})
    return JobMeta(name=key[1], namespace=key[0], uid=str(meta.get("uid", "")))
