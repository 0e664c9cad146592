"""bench/versus.py's results, one type per phase: the placement phase's instances
(`PlacementResult`), the recovery phase's rows (`RecoveryRow`) and each system's stream
(`SystemResult`). The phases fill them; versus_report.py prints them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scale_workload import JobShape
from topotrain.placement.topology import NodeInfo
from versus_jobs import Placed, placement_cost
from versus_watch import Gang, Recovery


@dataclass
class Instance:
    seed: int
    shape: JobShape
    ours: Placed | None = None
    theirs: Placed | None = None
    ours_note: str = ""
    theirs_note: str = ""


@dataclass
class PlacementResult:
    seeds: list[int] = field(default_factory=list)
    instances: list[Instance] = field(default_factory=list)
    seconds: float = 0.0
    recovery: list[RecoveryRow] = field(default_factory=list)  # the recovery phase, after it
    recovery_seconds: float = 0.0


@dataclass(frozen=True)
class RecoveryRow:
    system: str
    restart: str  # how the system was told to restart the gang
    job: str
    pods: int
    recovery: Recovery | None  # None: the gang never ran, so no node was lost
    note: str = ""


@dataclass
class SystemResult:
    system: str
    shapes: Sequence[JobShape]
    gangs: dict[str, Gang]
    pools: Mapping[str, list[NodeInfo]]
    recovery: Recovery | None = None
    log_tail: str = ""
    victim_state: str = ""  # the node-loss victim's Workload conditions after the wait
    placed: dict[str, Placed] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for shape in self.shapes:
            gang = self.gangs.get(shape.name)
            if gang is not None and gang.running is not None:
                placed = placement_cost(shape, gang.nodes, self.pools)
                if placed is not None:
                    self.placed[shape.name] = placed

    def latency(self, job: str) -> float | None:
        gang = self.gangs.get(job)
        if gang is None or gang.running is None or not gang.applied:
            return None
        return gang.running - gang.applied

    def latencies(self) -> list[float]:
        return sorted(g.running - g.applied for g in self.gangs.values()
                      if g.running is not None and g.applied)  # fmt: skip

    def admissions_per_minute(self) -> float:
        done = [g.running for g in self.gangs.values() if g.running is not None]
        applied = [g.applied for g in self.gangs.values() if g.applied]
        if not done or not applied:
            return 0.0
        span = max(done) - min(applied)
        return len(done) * 60 / span if span > 0 else float("nan")
