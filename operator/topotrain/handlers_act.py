"""Carrying out a reconcile decision against the API server, in a safe order.

Order within a pass: delete what must go; apply the Service and the rank
table; record the new pods in the ledger, create them all behind the gang
gate, and only when every one exists release the gate on all of them, so a
gang never half-starts and never holds GPUs while waiting for the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from topotrain.api import TrainingJobSpec
from topotrain.kube import Kube
from topotrain.manifests import JobMeta, PodPlan, pod, pod_name, rank_table, service
from topotrain.reconcile import Decision, Launch
from topotrain.settings import Settings
from topotrain.snapshot import JobKey, Ledger

log = logging.getLogger("topotrain.act")


class Actuator:
    """Applies decisions for one job."""

    def __init__(self, kube: Kube, settings: Settings, ledger: Ledger) -> None:
        self.kube = kube
        self.settings = settings
        self.ledger = ledger

    def apply(self, key: JobKey, body: Mapping[str, Any], spec: TrainingJobSpec, decision: Decision) -> None:
        namespace = key[0]
        if decision.delete:
            self.kube.delete_pods(namespace, decision.delete, self.settings.pod_grace_seconds)
            for name in decision.delete:
                self.ledger.forget(namespace, name)
        if decision.launch is not None:
            meta = body.get("metadata", {})
            job = JobMeta(name=key[1], namespace=namespace, uid=str(meta.get("uid", "")))
            self._launch(key, job, spec, decision.launch)
        if decision.release:
            self.kube.release_pods(namespace, decision.release)

    def _launch(self, key: JobKey, job: JobMeta, spec: TrainingJobSpec, launch: Launch) -> None:
        settings = self.settings
        self.kube.apply(service(job, settings.master_port))
        if not launch.only:
            self.kube.apply(rank_table(job, spec, launch.attempt, launch.data, launch.pool,
                                       launch.assignments))
        indices = launch.only or tuple(sorted(launch.assignments))
        manifests = [
            pod(job, spec, PodPlan(
                attempt=launch.attempt, index=i, node=launch.assignments[i], data=launch.data,
                resume_step=launch.resume_step, master_port=settings.master_port,
                s3_endpoint=settings.s3_endpoint,
            ))
            for i in indices
        ]
        for manifest in manifests:
            self.ledger.record(key, manifest)
        created = set(self.kube.create_pods(manifests))
        missing = [m["metadata"]["name"] for m in manifests if m["metadata"]["name"] not in created]
        if missing:
            log.warning("%s/%s attempt %d: %d pod(s) not created yet (%s); gate kept closed",
                        *key, launch.attempt, len(missing), ", ".join(missing[:3]))
            for name in missing:
                self.ledger.forget(job.namespace, name)
            return
        if not launch.release:
            return
        every = [pod_name(job.name, launch.attempt, i) for i in sorted(launch.assignments)]
        self.kube.release_pods(job.namespace, every)
