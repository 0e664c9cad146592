"""One soak: a private testbed, a stream of jobs, a seeded nemesis, a history,
then the checkers. `run_soak` returns everything the bench prints and the
bounded test asserts."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.chaos import audit, checkers, report
from testbed.chaos.catalogue import CALM, NEEDS_KUEUE, Fault, Kind, schedule
from testbed.chaos.nemesis import Nemesis
from testbed.chaos.queued import queue_labels
from testbed.chaos.rig import Rig
from testbed.chaos.timeline import Timeline, Verdict
from testbed.chaos.workload import Workload
from testbed.harness_proc import json_lines
from testbed.standin import expected_losses

ONE_REPLICA_KINDS = set(Kind) - {Kind.OPERATOR_FAILOVER}


@dataclass
class SoakConfig:
    seed: int
    faults: int
    jobs: int
    mean_gap: float = 3.0
    steps: tuple[int, int] = (150, 250)
    step_seconds: float = 0.5
    replicas: int = 1
    kinds: set[Kind] | None = None
    calm: float = CALM  # seconds without a global fault after one
    drain_seconds: float = 600.0
    warmup_seconds: float = 15.0
    kueue: bool = False  # the real Kueue beside the operator: queued jobs and kueue-preempt


@dataclass
class SoakResult:
    config: SoakConfig
    schedule: list[Fault]
    verdicts: list[Verdict]
    rows: dict[str, report.ClassRow]
    goodput: float
    seconds: float
    setup_seconds: float
    load: list[float] = field(default_factory=list)
    skipped: str = ""
    rss_peak: float = 0.0
    rss_slope: float = 0.0
    workdir: Path = Path()

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)


def run_soak(config: SoakConfig, workdir: Path, log: Any = print) -> SoakResult:
    kinds = config.kinds or (set(Kind) if config.replicas > 1 else ONE_REPLICA_KINDS)
    if not config.kueue:
        kinds = kinds - NEEDS_KUEUE
    plan = schedule(config.seed, config.faults, config.mean_gap, kinds, config.calm)
    log(f"chaos soak: seed {config.seed}, {len(plan)} faults over ~{plan[-1].at:.0f}s, "
        f"{config.jobs} concurrent jobs, {config.replicas} operator replica(s); workdir {workdir}")  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(workdir / "soak.log")  # the harness's and clients' complaints
    logging.getLogger().addHandler(handler)
    load: list[float] = []
    with Rig(workdir, config.seed, config.jobs, config.replicas, kueue=config.kueue) as rig:
        log(f"testbed, fleet and stack up in {rig.setup_seconds:.0f}s ({len(rig.node_names)} nodes)")
        rig.history.add("soak-start", namespace=rig.namespace, seed=config.seed, faults=config.faults,
                        jobs=config.jobs, replicas=config.replicas, nodes=len(rig.node_names),
                        kueue=config.kueue, checkpoint_request_timeout=rig.checkpoint_request_timeout)  # fmt: skip
        rig.workload = Workload(rig.stack, rig.history, rig.namespace, config.seed, config.jobs,
                                config.steps, config.step_seconds,
                                queue_labels=queue_labels(rig.namespace) if config.kueue else None)  # fmt: skip
        rig.workload.tick(keep_going=True)
        nemesis = Nemesis(rig, plan, calm=config.calm)
        began = time.time()
        thread = threading.Thread(target=nemesis.run, args=(began + config.warmup_seconds,), daemon=True)
        thread.start()
        while thread.is_alive():
            _tick(rig, keep_going=True)
            load.append(os.getloadavg()[0])
            thread.join(timeout=2.0)
        log(f"nemesis done after {time.time() - began:.0f}s; draining")
        deadline = time.monotonic() + config.drain_seconds
        while rig.workload.job_names() and time.monotonic() < deadline:
            _tick(rig, keep_going=False)
            load.append(os.getloadavg()[0])
            time.sleep(2.0)
        time.sleep(3.0)  # one more observation of the end state
        seconds = time.time() - began
        assert rig.stack.harness is not None
        for job in sorted(rig.workload.plans):
            events = list(json_lines(rig.stack.harness.job_logs(rig.namespace, job)))
            rig.history.add("trainer-events", job=job,
                            events=[e for e in events if "event" in e and "time" in e])  # fmt: skip
        rig.history.add("audit", events=audit.read(rig.bed.root / "audit.log"))  # who wrote pods, Leases
        records = list(rig.history.records)
        namespace, setup = rig.namespace, rig.setup_seconds
    logging.getLogger().removeHandler(handler)
    timeline = Timeline.of(records, namespace)
    samples = checkers.memory_samples(records)
    return SoakResult(
        config, plan, checkers.check_all(timeline, records, expected_losses),
        report.class_rows(timeline, records), report.goodput(timeline, config.step_seconds),
        seconds, setup, load, report.not_injected(records), max((m for _, m in samples), default=0.0),
        checkers.slope_mib_per_hour(samples), workdir,
    )  # fmt: skip


def _tick(rig: Rig, keep_going: bool) -> None:
    try:
        rig.workload.tick(keep_going)
    except Exception as err:  # the API server is down (a fault): submit on a later tick
        rig.history.add("workload-error", error=f"{type(err).__name__}: {err}"[:200])


def summary(result: SoakResult) -> str:
    c = result.config
    load = result.load or [0.0]
    lines = [
        f"seed {c.seed}: {len(result.schedule)} faults scheduled, {c.jobs} concurrent jobs, "
        f"{c.replicas} operator replica(s); ran {result.seconds:.0f}s (+{result.setup_seconds:.0f}s set-up)",
        f"machine load average (1 min): mean {sum(load) / len(load):.1f}, max {max(load):.1f}, "
        f"{os.cpu_count()} CPUs",
        "", report.table(result.rows), "", f"not injected: {result.skipped or 'none'}",
        f"fleet goodput: {result.goodput:.1%}",
        f"operator RSS: peak {result.rss_peak:.0f} MiB, slope {result.rss_slope:+.0f} MiB/h", "",
        *(v.line() for v in result.verdicts),
        f"history: {result.workdir / 'history.jsonl'}",
    ]  # fmt: skip
    return "\n".join(lines)


def replay(history: Path) -> tuple[list[Verdict], dict[str, report.ClassRow]]:
    """Run the checkers and the report again on a recorded history (no cluster needed)."""
    import json

    records = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    start = next(r for r in records if r["type"] == "soak-start")
    timeline = Timeline.of(records, start["namespace"])
    return checkers.check_all(timeline, records, expected_losses), report.class_rows(timeline, records)


def evidence(result: SoakResult, lines: int = 25) -> str:
    """What the run left about each job a failed invariant names: its pod logs (one file per pod
    run, the last `lines` of each) and the operator's log lines naming it, so a failure seen once
    in CI, whose workdir is gone, can still be explained from the output alone."""
    failed = "\n".join(d for v in result.verdicts if not v.ok for d in v.details)
    jobs = sorted(set(re.findall(r"\b[a-z]+-\d{4}\b", failed)))
    out: list[str] = []
    for job in jobs:
        for path in sorted(result.workdir.glob(f"logs/*/{job}/*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out += [f"--- {path.name} (last {len(tail)} lines)", *tail]
        for path in sorted(result.workdir.glob("operator-*.log")):
            named = [x for x in path.read_text(errors="replace").splitlines() if job in x][-lines:]
            out += [f"--- {path.name}: last {len(named)} lines naming {job}", *named]
    return "\n".join(out)

