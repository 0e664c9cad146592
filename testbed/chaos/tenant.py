"""The soak's other tenant (issue 37): a second namespace the operator also watches, whose
jobs, during a `tenant-tarpit` fault, keep their checkpoints at a `testbed.tarpit.Tarpit`
(every request: a 200 that trickles one byte every 0.5 s, so botocore's per-read timeout
never fires). Nothing of the soak's own jobs is touched: the fault is recorded against no
job, and invariant 13 (testbed/chaos/checkers_tenant.py) judges whether the soak's jobs
recovered from their own faults in their usual time while it lasted.

The tenant's jobs ask for one GPU on a node label no node has, so they take no GPU from the
soak and run no pod; the operator still reads their store on every pass (a job's newest
committed checkpoint is read before it is placed), which is what the tarpit holds.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from testbed.chaos.catalogue import Fault
from testbed.harness_stack import CREDENTIALS_SECRET, GROUP, PLURAL, TRAINER_IMAGE, VERSION
from testbed.tarpit import Tarpit

NOWHERE = {"topotrain.io/chaos-tenant": "no-such-pool"}  # a label no node of the soak has


def delete_until_gone(delete: Callable[[], object], timeout: float = 300.0, pause: float = 2.0) -> None:
    """`delete()` until it succeeds or the object is gone (404), asked again while the API server
    is away (an apiserver-restart overlapping the heal: in the soak with Kueue, seed 3702, a
    preemptor Workload left behind that way held its ClusterQueue's quota for good)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            delete()
            return
        except ApiException as err:
            if err.status == 404:
                return
            if err.status < 500 or time.monotonic() > deadline:
                raise
        except (OSError, urllib3.exceptions.HTTPError):
            if time.monotonic() > deadline:
                raise
        time.sleep(pause)


def tenant_namespace(soak_namespace: str) -> str:
    return f"{soak_namespace}-tenant"


def tarpit_jobs(fault: Fault) -> int:
    """How many of the tenant's jobs point at the tarpit: 8 to 16 (the issue's attack: 16)."""
    return 8 + min(8, int(fault.size * 9))


def job_manifest(name: str, namespace: str, endpoint: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "image": TRAINER_IMAGE, "parallelism": {"tensor": 1, "pipeline": 1, "data": 1},
            "worker": {"gpusPerPod": 1, "nodeSelector": dict(NOWHERE)},
            "checkpoint": {"uri": "s3://tenant/jobs", "endpoint": endpoint,
                           "credentialsSecret": CREDENTIALS_SECRET},
            "failurePolicy": {"progressTimeoutSeconds": 0, "schedulingTimeoutSeconds": 3600},
        },
    }  # fmt: skip


class TenantFaults:
    """The `tenant-tarpit` class, a mixin of the Nemesis (needs its rig, stop event, `_record`)."""

    rig: Any  # the Nemesis's testbed.chaos.rig.Rig (rig imports this module)
    _stop: threading.Event

    def _tenant_tarpit(self, fault: Fault) -> None:
        nemesis: Any = self
        namespace = self.rig.tenant
        custom = self.rig.stack.custom
        names = [f"tarpit-{fault.index:04d}-{i:02d}" for i in range(tarpit_jobs(fault))]
        with Tarpit(interval=0.5) as tarpit:
            nemesis._record(fault, [], namespace=namespace, tenant_jobs=len(names), endpoint=tarpit.url)
            try:
                for name in names:
                    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                           job_manifest(name, namespace, tarpit.url))  # fmt: skip
                self._stop.wait(fault.duration)
            finally:
                for name in names:  # the operator removes their finalizers; nothing waits on it
                    delete_until_gone(functools.partial(custom.delete_namespaced_custom_object,
                                                        GROUP, VERSION, namespace, PLURAL, name))  # fmt: skip
            reached, most = tarpit.requests, tarpit.most_trickling
        # the evidence that the operator's reads really reached the tarpit (invariant 13 asks)
        self.rig.history.add("heal", index=fault.index, kind=fault.kind.value, requests=reached,
                             most_trickling=most)  # fmt: skip
