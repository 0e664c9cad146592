"""Time to first step after a failure: restart in place against a recreate (`bench/recovery.py
--first-step`).

One small 3D TrainingJob (tp=2, pp=2, dp=2 on four 2-GPU pods, the tiny model, as in
tests/e2e) runs with the real operator (Helm chart, ServiceAccount), the real trainer
processes (pod process harness) and the real S3 server, on a KWOK pool of its own: five
2-GPU nodes, one pod per node and a spare. Faults of four classes are injected into the
pod of index 1, again and again, each once with `failurePolicy.restartInPlace: true` and
once with `false` (toggled on the same job between faults: the flag is not part of the pod
template, so it rolls nothing), in alternating order:

- crash: its trainer ranks SIGKILLed (`testbed.faults.signal_trainer`), the pod stays up;
- pod deletion: the pod deleted;
- node loss: its node made NotReady (KWOK), the harness kills the node's processes; made
  Ready again once the job trains. Always a recreate;
- hang: its trainer ranks SIGSTOPped; detected after `progressTimeoutSeconds` (30).

Each sample is the operator's own `status.recovery.timeToFirstStepSeconds` (failure
detected -> the new attempt's first completed step; detection itself, such as the hang
timeout, is not in it) with its phases, and the pods that got new UIDs. Before each fault
the job trains a few steps past its last restart.
"""

from __future__ import annotations

import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput import cluster, node_pool

from testbed import faults
from testbed.client import api_client
from testbed.harness_stack import GROUP, PLURAL, VERSION, Stack, stack_in_new_namespace
from testbed.kube import Kube
from testbed.nodes import wait_nodes_ready
from testbed.restart_probes import first_step_after, live_uids, node_of, pod_name, pod_pid

CLASSES = ("crash", "pod deletion", "node loss", "hang")
JOB = "ttfs"
VICTIM = 1  # the pod index every fault strikes
SETTLE_STEPS = 3  # steps trained after a restart before the next fault
HANG_TIMEOUT = 30
RECOVERY_TIMEOUT = 900.0


def job_spec(product: str, warm_spares: bool = False) -> dict[str, Any]:
    return {
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 2},
        "worker": {"gpusPerPod": 2, "gpuTypes": [product]},
        "checkpoint": {"intervalSteps": 4, "keep": 2},
        "failurePolicy": {
            "backoffSeconds": 0, "maxRestarts": 1000, "maxInfrastructureRestarts": 1000,
            "nodeFailureThreshold": 0,  # the faults are injected: no node is to blame
            "progressTimeoutSeconds": HANG_TIMEOUT, "restartInPlace": True,
        },
        "training": {"model": "tiny", "steps": 1_000_000, "globalBatch": 8, "microBatch": 2,
                     "progressEvery": 1, "metricsPort": 0, "warmSpares": warm_spares},
    }  # fmt: skip


@dataclass
class Sample:
    kind: str
    in_place: bool  # what restartInPlace asked for
    mode: str  # what the operator did: status.recovery.mode (inPlace) or recreate
    reason: str  # status.lastFailure.reason
    seconds: float  # status.recovery.timeToFirstStepSeconds
    recreated: int  # pods with a new UID
    phases: dict[str, float] = field(default_factory=dict)


class FirstStepBench:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def _status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.stack.job(JOB).get("status") or {}
        return status

    def settle(self) -> None:
        """Until the current attempt has trained SETTLE_STEPS past its resume step (and a
        checkpoint is committed), so every fault finds the job in the same state."""
        status = self._status()
        since = int((status.get("recovery") or {}).get("resumeStep") or 0)

        def trained(job: dict[str, Any]) -> bool:
            st = job.get("status") or {}
            progress = st.get("progress") or {}
            return (st.get("phase") == "Running" and progress.get("attempt") == st.get("attempt")
                    and int(progress.get("step", 0)) >= since + SETTLE_STEPS
                    and (st.get("checkpoint") or {}).get("step") is not None)  # fmt: skip

        self.stack.wait_job(JOB, trained, timeout=RECOVERY_TIMEOUT, what="training under way")

    def set_in_place(self, on: bool) -> None:
        """Patch restartInPlace and wait until the operator has reconciled that generation."""
        self.stack.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.stack.namespace, PLURAL, JOB,
            {"spec": {"failurePolicy": {"restartInPlace": on}}},
        )  # fmt: skip
        self.stack.wait_job(
            JOB, lambda j: int((j.get("status") or {}).get("observedGeneration") or 0)
            >= int(j["metadata"]["generation"]), timeout=120, what="the new generation reconciled",
        )  # fmt: skip

    def inject(self, kind: str) -> Callable[[], None]:
        """Strike the pod of index VICTIM; returns what undoes the fault once the job trains."""
        stack = self.stack
        if kind == "crash":
            assert faults.signal_trainer(pod_pid(stack, JOB, VICTIM), signal.SIGKILL), "no ranks"
        elif kind == "pod deletion":
            stack.core.delete_namespaced_pod(pod_name(stack, JOB, VICTIM), stack.namespace)
        elif kind == "node loss":
            node = node_of(stack, JOB, VICTIM)
            faults.node_not_ready(stack.kubeconfig, node)

            def heal() -> None:
                faults.node_ready(stack.kubeconfig, node)
                wait_nodes_ready(stack.kubeconfig, [node], timeout=120)

            return heal
        elif kind == "hang":
            assert faults.signal_trainer(pod_pid(stack, JOB, VICTIM), signal.SIGSTOP), "no ranks"
        else:
            raise ValueError(kind)
        return lambda: None

    def one(self, kind: str, in_place: bool) -> Sample:
        self.set_in_place(in_place)
        self.settle()
        attempt = int(self._status().get("attempt", 0))
        before = set(live_uids(self.stack, JOB).values())
        heal = self.inject(kind)
        job = self.stack.wait_job(
            JOB, lambda j: first_step_after(j, attempt), timeout=RECOVERY_TIMEOUT,
            what=f"the first step after the {kind}",
        )  # fmt: skip
        heal()
        status, after = job["status"], set(live_uids(self.stack, JOB).values())
        rec = status["recovery"]
        sample = Sample(
            kind, in_place, rec.get("mode") or "recreate", status["lastFailure"]["reason"],
            float(rec["timeToFirstStepSeconds"]), len(after - before), dict(rec.get("phases") or {}),
        )  # fmt: skip
        print(f"  {kind:12s} restartInPlace={str(in_place).lower():5s} -> {sample.mode:8s} "
              f"{sample.reason:14s} {sample.seconds:7.2f}s, {sample.recreated} pods new, "
              f"phases {sample.phases}", flush=True)  # fmt: skip
        return sample


def run(repeats: int, classes: tuple[str, ...] = CLASSES, warm_spares: bool = False) -> list[Sample]:
    samples: list[Sample] = []
    with ExitStack() as stack:
        kubeconfig, s3 = cluster(stack, prefix="first-step")
        api = stack.enter_context(api_client(kubeconfig))
        product = node_pool(kubeconfig, "first-step", stack, nodes=5, gpus=2)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="first-step-")))
        job_stack = stack.enter_context(
            stack_in_new_namespace(Kube(kubeconfig, api, testbed=None), s3, workdir, "first-step")
        )
        job_stack.apply_job(JOB, job_spec(product, warm_spares))
        bench, started = FirstStepBench(job_stack), time.monotonic()
        for number in range(repeats):
            for kind in classes:
                order = (True, False) if number % 2 == 0 else (False, True)
                samples += [bench.one(kind, in_place) for in_place in order]
        print(f"  {len(samples)} faults in {time.monotonic() - started:.0f}s", flush=True)
    return samples


def rows(samples: list[Sample]) -> list[tuple[str, float, float, str]]:
    """class, in-place p50, recreate p50, pods recreated ('in place / recreate', per sample)."""
    out = []
    for kind in CLASSES:
        mine = [s for s in samples if s.kind == kind]
        if not mine:
            continue
        asked = {on: [s for s in mine if s.in_place is on] for on in (True, False)}
        p50 = {on: statistics.median(s.seconds for s in asked[on]) for on in asked if asked[on]}
        pods = " / ".join(",".join(str(s.recreated) for s in asked[on]) for on in (True, False))
        fell_back = sum(s.mode != "inPlace" for s in asked[True])
        label = kind if not fell_back else (
            f"{kind} (always recreates)" if fell_back == len(asked[True])
            else f"{kind} ({fell_back} of {len(asked[True])} recreated)")  # fmt: skip
        out.append((label, p50.get(True, float("nan")), p50.get(False, float("nan")), pods))
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_table(samples: list[Sample]) -> None:
    print()
    print("| class | in-place p50 s | recreate p50 s | ratio | pods recreated (in-place / recreate) |")
    print("|---|---:|---:|---:|---|")
    for label, in_place, recreate, pods in rows(samples):
        print(f"| {label} | {in_place:.1f} | {recreate:.1f} | {recreate / in_place:.2f}x | {pods} |")
    print()
    print("phase p50 s (podsRunning / processStart / checkpointLoad / startupAndFirstStep):")
    for kind in CLASSES:
        for on in (True, False):
            mine = [s.phases for s in samples if s.kind == kind and s.in_place is on]
            if mine:
                keys = ("podsRunning", "processStart", "checkpointLoad", "startupAndFirstStep")
                cells = [_median([p[k] for p in mine if p.get(k) is not None]) for k in keys]
                print(f"  {kind:12s} {'in-place' if on else 'recreate':8s} "
                      + " / ".join(f"{c:.1f}" for c in cells))  # fmt: skip
