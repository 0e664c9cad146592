"""One mode of the goodput benchmark: a TrainingJob on its own KWOK node
pool, failures injected at a fixed step rate, every recovery timed by phase.

Two failure classes (`FAILURES`): `node`, a node fails through KWOK's NotReady
stage (testbed.faults) and the pod process harness then kills the trainer
processes on that node, as the machine's death would; `crash`, the trainer
rank of one pod is SIGKILLed (its pod and node stay). Either way the operator
finds out the way it would on a cluster.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

from testbed import faults
from testbed.harness_proc import events_by_attempt
from testbed.harness_stack import Stack
from testbed.restart_probes import pod_pid

POLL = 0.25


@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    sync_checkpoint: bool
    recovery: str  # the operator's recovery strategy
    warm_spares: bool = False  # training.warmSpares
    baseline: bool = False  # what topotrain's defaults must beat


MODES = (
    Mode("topotrain", "topotrain: async ckpt + incremental", False, "incremental"),
    Mode("spares", "topotrain + warm spares", False, "incremental", warm_spares=True),
    Mode("sync", "synchronous checkpoints", True, "incremental", baseline=True),
    Mode("full", "full-gang restart", False, "recreate", baseline=True),
)
FAILURES = ("node", "crash")


@dataclass
class Failure:
    """One injected failure and when each phase of the recovery ended (wall clock)."""

    attempt: int
    node: str
    before: frozenset[str]  # UIDs of the job's pods when it struck (a kept pod keeps its UID)
    step: int  # the last step the failed attempt finished
    injected: float
    detected: float | None = None
    planned: float | None = None
    running: float | None = None
    launched: float | None = None
    restored: float | None = None
    load_seconds: float | None = None
    resumed_step: int | None = None
    lost_seconds: float = 0.0
    warm: str = ""  # "<warm ranks>/<ranks>" the next attempt started (supervisors' workers_started)

    @property
    def done(self) -> bool:
        return self.restored is not None

    def phases(self) -> dict[str, float]:
        """detection, re-plan, pod start, process start, checkpoint load (seconds)."""
        marks = (
            self.injected,
            self.detected,
            self.planned,
            self.running,
            self.launched,
            self.restored,
        )
        if any(m is None for m in marks):
            return {}
        inj, det, plan, run, launch, restored = (float(m) for m in marks)  # type: ignore[arg-type]
        load = self.load_seconds or 0.0
        return {
            "detection": det - inj,
            "re-plan": plan - det,
            "pod start": max(run, launch) - plan,
            "process start": restored - load - max(run, launch),
            "checkpoint load": load,
        }

    @property
    def recovery(self) -> float:
        return float(self.restored or self.injected) - self.injected

    @property
    def lost_steps(self) -> int:
        return self.step - (self.resumed_step or 0)


@dataclass
class ModeResult:
    mode: Mode
    wall: float = 0.0
    useful: float = 0.0
    steps: int = 0
    stalls: list[float] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    phase: str = ""

    @property
    def goodput(self) -> float:
        return self.useful / self.wall if self.wall else 0.0


def job_spec(mode: Mode, product: str, steps: int, interval: int) -> dict[str, Any]:
    return {
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2},
        "worker": {"gpusPerPod": 1, "gpuTypes": [product]},
        "checkpoint": {"intervalSteps": interval, "keep": 3},
        # The faults strike pod index 1 again and again: no node is to blame (with the default
        # threshold the second strike would move the gang off its node, a recreate in every mode).
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 100, "nodeFailureThreshold": 0},
        "training": {
            "model": "tiny", "steps": steps, "globalBatch": 8, "microBatch": 2,
            "progressEvery": 1, "metricsPort": 0, "syncCheckpoint": mode.sync_checkpoint,
            "warmSpares": mode.warm_spares,
        },
    }  # fmt: skip


def job_events(stack: Stack, job: str) -> dict[int, list[dict[str, Any]]]:
    """The job's JSON events per attempt (a pod restarted in place logs several attempts)."""
    assert stack.harness is not None
    return events_by_attempt(stack.harness.job_logs(stack.namespace, job))


class Runner:
    """Drives one job: injects a failure of class `failure` (FAILURES) every `fail_every` steps
    and times the recoveries."""

    def __init__(
        self, stack: Stack, mode: Mode, steps: int, fail_every: int, interval: int, product: str,
        failure: str = "node",
    ) -> None:
        self.stack, self.mode, self.steps, self.failure = stack, mode, steps, failure
        self.fail_every, self.interval, self.product = fail_every, interval, product
        self.job = f"goodput-{mode.key}"
        self.result = ModeResult(mode)
        # Failures land mid-interval, the expected phase of a failure striking at random.
        self.next_failure = fail_every - interval // 2

    def run(self, timeout: float) -> ModeResult:
        created = time.time()
        self.stack.apply_job(self.job, job_spec(self.mode, self.product, self.steps, self.interval))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.stack.job(self.job)
            status = job.get("status", {})
            self.result.phase = status.get("phase", "")
            if self.result.phase in ("Succeeded", "Failed"):
                break
            self._observe(status)
            time.sleep(POLL)
        self._finish(created)
        return self.result

    def _observe(self, status: dict[str, Any]) -> None:
        events = job_events(self.stack, self.job)
        pending = next((f for f in self.result.failures if not f.done), None)
        if pending is not None:
            self._track(pending, status, events)
            return
        attempt = int(status.get("attempt", 0))
        steps = [e["step"] for e in events.get(attempt, []) if e.get("event") == "step"]
        if steps and steps[-1] >= self.next_failure and self.next_failure < self.steps:
            self._inject(attempt, steps[-1])
            self.next_failure += self.fail_every

    def _inject(self, attempt: int, step: int) -> None:
        pods = [
            p
            for p in self.stack.pods(self.job)
            if p["metadata"]["labels"].get("topotrain.io/attempt") == str(attempt)
        ]
        node = next(
            p["spec"]["nodeName"]
            for p in pods
            if p["metadata"]["labels"].get("topotrain.io/index") == "1"
        )
        before = frozenset(p["metadata"]["uid"] for p in self.stack.pods(self.job))
        if self.failure == "crash":
            faults.signal_trainer(pod_pid(self.stack, self.job, 1), signal.SIGKILL)
        else:
            faults.node_not_ready(self.stack.kubeconfig, node)
        self.result.failures.append(Failure(attempt, node, before, step, time.time()))

    def _track(
        self, f: Failure, status: dict[str, Any], events: dict[int, list[dict[str, Any]]]
    ) -> None:
        now, nxt = time.time(), max(f.attempt + 1, int(status.get("attempt", 0)))
        if f.detected is None and int(status.get("attempt", 0)) > f.attempt:
            f.detected = now
        pods = [
            p
            for p in self.stack.pods(self.job)
            if p["metadata"]["labels"].get("topotrain.io/attempt") == str(nxt)
        ]
        if f.detected is not None and f.planned is None and pods:
            f.planned = now
        if (
            f.planned is not None
            and f.running is None
            and pods
            and all(p["status"].get("phase") == "Running" for p in pods)
        ):
            f.running = now
        assert self.stack.harness is not None
        launches = [
            launch.time
            for launch in self.stack.harness.launches
            if launch.job == self.job and launch.attempt == str(nxt)
        ]
        # Pods of the next attempt made for it (an in-place restart keeps the others, whose
        # processes its supervisors restart: they are "launched" once Running on that attempt).
        made = [p for p in pods if p["metadata"]["uid"] not in f.before]
        if pods and len(launches) >= len(made):
            f.launched = max(launches, default=f.running or now)
        restored = [e for e in events.get(nxt, []) if e.get("event") == "restored"]
        if restored and f.launched is not None:
            f.restored = float(restored[0]["time"])
            f.resumed_step = int(restored[0]["step"])
            f.load_seconds = restored[0].get("load_seconds")
            started = [e for e in events.get(nxt, []) if e.get("event") == "workers_started"]
            f.warm = (f"{sum(int(e.get('warm', 0)) for e in started)}/"
                      f"{sum(int(e.get('workers', 0)) for e in started)}")  # fmt: skip
            lost = [
                e
                for e in events.get(f.attempt, [])
                if e.get("event") == "step" and e["step"] > f.resumed_step
            ]
            f.lost_seconds = sum(float(e["step_seconds"]) for e in lost)
            f.step = max([f.step, *(int(e["step"]) for e in lost)])
            if self.failure == "node":
                faults.node_ready(self.stack.kubeconfig, f.node)  # capacity returns as a spare

    def _finish(self, created: float) -> None:
        events = job_events(self.stack, self.job)
        final: dict[int, float] = {}
        for attempt in sorted(events):
            for e in events[attempt]:
                if e.get("event") == "step":
                    final[int(e["step"])] = float(e["step_seconds"])
                elif e.get("event") == "checkpoint_saved":
                    self.result.stalls.append(float(e["stall_seconds"]))
        done = [e for attempt in events.values() for e in attempt if e.get("event") == "done"]
        self.result.steps = len(final)
        self.result.useful = sum(final.values())
        self.result.wall = (float(done[-1]["time"]) if done else time.time()) - created
