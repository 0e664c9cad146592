"""bench/versus.py's recovery phase: the node-loss job alone under each system on the same
fragmented fleet (the stream's fillers, nothing else of either system), so both recover
into exactly the same free GPUs.

Per system and restart strategy, one after the other (topotrain restarting in place, the
default, and recreating the gang; JobSet's Recreate and BlockingRecreate): the job applied
(a TrainingJob, or the JobSet of bench/versus_jobs.py in its LocalQueue), its gang all
Running, then the Node of its pod 0 deleted (a machine leaving); timed until the gang is all
Running again off that node, with the pods created meanwhile counted
(`versus_watch.time_recovery`). The node and its filler pods are put back and the job
deleted before the next run. The stream's own
node loss (bench/versus.py) comes on top: there each system recovers into what its own
stream left free, which differs between the two.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from scale_workload import JobShape
from topotrain.core.manifests import INDEX_LABEL, JOB_LABEL
from versus_bench import Bench
from versus_jobs import COMPLETION_INDEX_LABEL, JOBSET_NAME_LABEL, jobset_manifest
from versus_results import RecoveryRow
from versus_watch import GangWatch, time_recovery

from testbed.kueue_queues import KueueQueues


class _System:
    """How one system's job is made, watched and removed."""

    def __init__(self, name: str, restart: str, namespace: str, job_label: str, index_label: str,
                 create: Callable[[JobShape], None], delete: Callable[[str], None]) -> None:  # fmt: skip
        self.name, self.restart, self.namespace = name, restart, namespace
        self.job_label, self.index_label = job_label, index_label
        self.create, self.delete = create, delete


def _until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def recover_once(bench: Bench, system: _System, shape: JobShape, timeout: float) -> RecoveryRow:
    least = bench.least[shape.name]
    watch = GangWatch(bench.api, system.namespace, system.job_label, system.index_label,
                      {shape.name: least})  # fmt: skip
    selector = f"{system.job_label}={shape.name}"
    try:
        watch.applied(shape.name, time.time())
        system.create(shape)
        if not _until(lambda: watch.snapshot()[shape.name].running is not None, bench.args.timeout):
            return RecoveryRow(system.name, system.restart, shape.name, shape.pods, None, "not Running")
        gang = watch.snapshot()[shape.name]
        node = gang.nodes[min(gang.nodes)]
        print(f"[recovery] {system.name} ({system.restart}): {shape.name} Running; deleting node {node}",
              file=sys.stderr, flush=True)  # fmt: skip
        recovery = time_recovery(watch, shape.name, least, bench.kill_node, node, timeout)
        bench.restore_node(node)
        return RecoveryRow(system.name, system.restart, shape.name, shape.pods, recovery)
    finally:
        watch.close()
        system.delete(shape.name)
        _until(lambda: not bench.core.list_namespaced_pod(
            system.namespace, label_selector=selector).items, 180)  # fmt: skip


def run_recovery(bench: Bench, shape: JobShape, timeout: float, topotrain_namespace: str,
                 kueue_namespace: str, queues: KueueQueues,
                 make_job: Callable[..., dict[str, Any]]) -> list[RecoveryRow]:  # fmt: skip
    """Both systems' recovery of `shape` alone; their controllers are running (the placement
    phase's operator and Kueue + JobSet) with `queues` applied in `kueue_namespace`."""
    custom = client.CustomObjectsApi(bench.api)
    tj = ("topotrain.io", "v1alpha1", topotrain_namespace, "trainingjobs")
    js = ("jobset.x-k8s.io", "v1alpha2", kueue_namespace, "jobsets")
    background = client.V1DeleteOptions(propagation_policy="Background")

    def trainingjob(in_place: bool) -> Callable[[JobShape], None]:
        def create(s: JobShape) -> None:
            job = make_job(s, bench.name, topotrain_namespace)
            job["spec"].setdefault("failurePolicy", {})["restartInPlace"] = in_place
            custom.create_namespaced_custom_object(*tj, job)
        return create

    def jobset(strategy: str) -> Callable[[JobShape], None]:
        return lambda s: custom.create_namespaced_custom_object(*js, jobset_manifest(
            s, kueue_namespace, bench.name, queues.queue_for(s.gpu_types), queues.levels,
            restart_strategy=strategy))

    def delete_tj(name: str) -> None:
        custom.delete_namespaced_custom_object(*tj, name)

    def delete_js(name: str) -> None:
        custom.delete_namespaced_custom_object(*js, name, body=background)

    ours, theirs = "topotrain", "Kueue TAS + JobSet"
    systems = [
        # restartInPlace (the default): only the lost node's pod is replaced, the others kept
        _System(ours, "in place", topotrain_namespace, JOB_LABEL, INDEX_LABEL,
                trainingjob(True), delete_tj),
        _System(ours, "recreate", topotrain_namespace, JOB_LABEL, INDEX_LABEL,
                trainingjob(False), delete_tj),
        # JobSet's InPlaceRestart needs an agent in every pod (and a feature gate): not on KWOK
        _System(theirs, "Recreate", kueue_namespace, JOBSET_NAME_LABEL, COMPLETION_INDEX_LABEL,
                jobset("Recreate"), delete_js),
        _System(theirs, "BlockingRecreate", kueue_namespace, JOBSET_NAME_LABEL,
                COMPLETION_INDEX_LABEL, jobset("BlockingRecreate"), delete_js),
    ]  # fmt: skip
    return [recover_once(bench, system, shape, timeout) for system in systems]
