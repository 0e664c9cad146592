"""Invariant 13: the soak's jobs recover from their own faults in their usual time while
another namespace's checkpoint store is a tarpit (`tenant-tarpit`, testbed/chaos/tenant.py).

"Usual" is measured in the same soak: the recoveries (testbed.chaos.report.measured) of each
fault class whose span — from the fault to the job stepping again — touched no tenant
tarpit, each fault's recoveries taken as one observation (their median: the jobs one fault
hit recover together, they are not independent). A recovery whose span overlapped a tarpit is
compared with the median of its class outside: the median of those ratios must stay within
MEDIAN_RATIO, and no single one may take STALL_SECONDS (one store-read deadline) longer than
the longest of its class outside (a stalled operator shows as recoveries that wait out the
tarpit's reads). A tarpit the operator never sent a request to proves nothing: that is a
violation too, the fault was not really injected.

Which recoveries are compared, the same rule on both sides (two tiers):

- **clean**: one whose span overlapped another fault that slows every job (the GLOBAL classes:
  the operator, the API server, the store, a quota; or the same namespace's checkpoint tarpit)
  or another fault that touched the same job (a node fault under it, a Kueue eviction, a
  second crash) is left out: it says nothing about the tenant;
- **matched density**, when the clean tier has fewer than MIN_JUDGED recoveries in tarpit
  windows to judge (the long form: a fault every second or so, and every job is hit by
  overlapping faults all along): only the recoveries that overlapped a fault slowing every job
  are left out, and a job's own overlapping faults stay in on both sides. The tarpits fall at
  random times, so inside and outside their windows the recoveries meet the same density of
  other faults: the comparison is still like for like, only noisier. Too few of one class fall
  outside the windows to give it a usual time of its own (seed 3702: 46 fault events inside,
  16 outside, over 15 classes), so the classes are pooled: each recovery is divided by its
  class's median over the whole soak, and the median of those ratios inside the windows must
  stay within MEDIAN_RATIO times the median outside (at least MIN_JUDGED inside and MIN_USUAL
  outside); the stall rule holds per class wherever the class has a recovery outside.

In the clean tier, classes with fewer than MIN_USUAL recoveries outside are not judged (named
in a note).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from testbed.chaos.catalogue import GLOBAL, Kind
from testbed.chaos.causes import causes
from testbed.chaos.report import measured
from testbed.chaos.timeline import Timeline, Verdict, verdict

MEDIAN_RATIO = 1.5  # the soak's noise is large (load 7 on two cores): bench/isolation.py measures 20 %
# A recovery that waited on the tenant's stuck reads waits at least one of the operator's
# store-read deadlines (controller/storecalls.py DEADLINE_SECONDS) longer than usual.
STALL_SECONDS = 30.0
MIN_USUAL = 3
CONFOUNDING = {str(k) for k in GLOBAL | {Kind.CHECKPOINT_TARPIT}}  # faults that slow every job
MIN_JUDGED = 5  # fewer recoveries in tarpit windows than this: the median is not judged


def recoveries(t: Timeline, *, clean: bool = True) -> list[tuple[str, int, float, float, float]]:
    """(fault class, fault index, start, end, seconds) of every recovery of a soak job that no
    fault slowing every job overlapped and, when `clean`, no other fault of the same job."""
    others = [c for c in causes(t) if c.kind != Kind.TENANT_TARPIT]
    found = []
    for fault, job, healed, (seconds, restarted, _) in measured(t):
        at = float(fault["t"])
        end = (at if restarted else float(healed)) + seconds
        if any(c.index != fault["index"] and c.start < end and c.healed > at
               and (c.kind in CONFOUNDING or (clean and job in c.jobs)) for c in others):  # fmt: skip
            continue
        found.append((str(fault["kind"]), int(fault["index"]), at, end, seconds))
    return found


def events(t: Timeline, *, clean: bool = True) -> list[tuple[str, float, float, float]]:
    """(class, start, end, median seconds) of each fault's recoveries (`recoveries`) taken
    together: the jobs one fault hit recover together, so they are one observation, not several."""
    grouped: dict[tuple[str, int], list[tuple[float, float, float]]] = defaultdict(list)
    for kind, index, begin, end, seconds in recoveries(t, clean=clean):
        grouped[(kind, index)].append((begin, end, seconds))
    return [(kind, min(b for b, _, _ in found), max(e for _, e, _ in found),
             statistics.median(s for _, _, s in found)) for (kind, _), found in sorted(grouped.items())]  # fmt: skip


def check_tenant_isolation(t: Timeline) -> Verdict:
    heals = {r["index"]: r for r in t.heals}
    windows = []
    problems: list[str] = []
    notes: list[str] = []
    for fault in t.faults:
        if fault["kind"] != Kind.TENANT_TARPIT:
            continue
        heal = heals.get(fault["index"])
        end = float(heal["t"]) if heal else float("inf")
        windows.append((float(fault["t"]), end))
        if heal is not None and not heal.get("requests"):
            problems.append(f"tenant-tarpit #{fault['index']}: the operator sent its tarpit no request")
    if not windows:
        return verdict(NAME, 0, [])
    tiers = [compare(events(t), windows)]
    if tiers[0].judged < MIN_JUDGED:  # (a clean stall found meanwhile still counts)
        tiers.append(compare_pooled(events(t, clean=False), windows))
        notes.append(f"clean tier: {tiers[0].judged} recoveries in tarpit windows to judge (fewer than "
                     f"{MIN_JUDGED}): judged at matched density ({tiers[1].judged})")  # fmt: skip
    for tier in tiers:
        problems.extend(p for p in tier.problems if p not in problems)
        notes.extend(tier.notes)
    return verdict(NAME, tiers[-1].during, problems, notes)


NAME = "13 other tenants recover as usual while one's store is a tarpit"


@dataclass
class Tier:
    during: int = 0  # fault events whose recoveries overlapped a tarpit window
    judged: int = 0  # of those, the ones with enough of their class outside to compare
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _inside(begin: float, end: float, windows: list[tuple[float, float]]) -> bool:
    """Whether a recovery's span overlaps a tarpit window."""
    return any(begin < w_end and end > w_start for w_start, w_end in windows)


def compare(found: list[tuple[str, float, float, float]], windows: list[tuple[float, float]]) -> Tier:
    """Recoveries overlapping a tarpit window against those of the same class outside."""
    tier = Tier()
    usual: dict[str, list[float]] = defaultdict(list)
    during: list[tuple[str, float, float]] = []  # (class, when, seconds)
    for kind, begin, end, seconds in found:
        if _inside(begin, end, windows):
            during.append((kind, begin, seconds))
        else:
            usual[kind].append(seconds)
    tier.during = len(during)
    ratios = []
    for kind, when, seconds in during:
        if len(usual[kind]) < MIN_USUAL:
            tier.notes.append(f"{kind} at t={when:.0f}: {seconds:.1f}s, too few {kind} recoveries outside to compare")
            continue
        ratios.append(seconds / max(0.1, statistics.median(usual[kind])))
        longest = max(usual[kind])
        if seconds > longest + STALL_SECONDS:
            tier.problems.append(f"{kind} at t={when:.0f}: recovered in {seconds:.1f}s during a tenant tarpit, "
                                 f"the longest outside {longest:.1f}s")  # fmt: skip
    tier.judged = len(ratios)
    if len(ratios) >= MIN_JUDGED and (median := statistics.median(ratios)) > MEDIAN_RATIO:
        tier.problems.append(f"recoveries during tenant tarpits took {median:.2f}x their class's usual median "
                             f"(limit {MEDIAN_RATIO}x, {len(ratios)} faults)")  # fmt: skip
    elif ratios:
        tier.notes.append(f"median {statistics.median(ratios):.2f}x the usual over {len(ratios)} faults' "
                          f"recoveries in {len(windows)} tenant tarpits")  # fmt: skip
    return tier


def compare_pooled(found: list[tuple[str, float, float, float]], windows: list[tuple[float, float]]) -> Tier:
    """The matched-density tier: every class's recoveries divided by the class's median over the
    soak, pooled; the median ratio inside the tarpit windows against the median outside."""
    tier = Tier()
    by_class: dict[str, list[tuple[bool, float, float]]] = defaultdict(list)  # (inside, when, seconds)
    for kind, begin, end, seconds in found:
        by_class[kind].append((_inside(begin, end, windows), begin, seconds))
    inside: list[float] = []
    outside: list[float] = []
    for kind, found_of in sorted(by_class.items()):
        tier.during += sum(1 for i, _, _ in found_of if i)
        usual = [s for i, _, s in found_of if not i]
        if len(found_of) < 2:
            continue  # its own median: nothing to compare
        middle = max(0.1, statistics.median(s for _, _, s in found_of))
        for is_inside, when, seconds in found_of:
            (inside if is_inside else outside).append(seconds / middle)
            if is_inside and usual and seconds > max(usual) + STALL_SECONDS:
                tier.problems.append(f"{kind} at t={when:.0f}: recovered in {seconds:.1f}s during a tenant tarpit, "
                                     f"the longest outside {max(usual):.1f}s")  # fmt: skip
    tier.judged = len(inside)
    if len(inside) < MIN_JUDGED or len(outside) < MIN_USUAL:
        tier.notes.append(f"matched density: {len(inside)} recoveries inside the tarpits and {len(outside)} "
                          f"outside, too few to compare")  # fmt: skip
        return tier
    ratio = statistics.median(inside) / max(0.01, statistics.median(outside))
    line = (f"matched density: recoveries inside {len(windows)} tenant tarpits took {ratio:.2f}x those outside "
            f"(each over its class's median; {len(inside)} inside, {len(outside)} outside, limit {MEDIAN_RATIO}x)")
    (tier.problems if ratio > MEDIAN_RATIO else tier.notes).append(line)
    return tier
