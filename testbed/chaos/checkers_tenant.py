"""Invariant 13: the soak's jobs recover from their own faults in their usual time while
another namespace's checkpoint store is a tarpit (`tenant-tarpit`, testbed/chaos/tenant.py).

"Usual" is measured in the same soak: the recoveries (testbed.chaos.report.measured) of each
fault class whose span — from the fault to the job stepping again — touched no tenant
tarpit, each fault's recoveries taken as one observation (their median: the jobs one fault
hit recover together, they are not independent). Only clean recoveries are compared, on both sides: one whose span overlapped another
fault that slows every job (the GLOBAL classes: the operator, the API server, the store, a
quota; or the same namespace's checkpoint tarpit) or another fault that touched the same job
(a node fault under it, a Kueue eviction, a second crash) says nothing about the tenant. A
clean recovery whose span overlapped a tarpit is compared with the median of its class
outside: the median of those ratios must stay within MEDIAN_RATIO, and no single one may
take STALL_SECONDS (one store-read deadline) longer than the longest of its class outside (a
stalled operator shows as recoveries that wait out the tarpit's reads). Classes with fewer than MIN_USUAL
recoveries outside are not judged (named in a note). A tarpit the operator never sent a
request to proves nothing: that is a violation too, the fault was not really injected.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

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


def recoveries(t: Timeline) -> list[tuple[str, int, float, float, float]]:
    """(fault class, fault index, start, end, seconds) of every clean recovery of a soak job."""
    others = [c for c in causes(t) if c.kind != Kind.TENANT_TARPIT]
    found = []
    for fault, job, healed, (seconds, restarted, _) in measured(t):
        at = float(fault["t"])
        end = (at if restarted else float(healed)) + seconds
        if any(c.index != fault["index"] and c.start < end and c.healed > at
               and (c.kind in CONFOUNDING or job in c.jobs) for c in others):  # fmt: skip
            continue
        found.append((str(fault["kind"]), int(fault["index"]), at, end, seconds))
    return found


def events(t: Timeline) -> list[tuple[str, float, float, float]]:
    """(class, start, end, median seconds) of each fault's clean recoveries taken together: the
    jobs one fault hit recover together, so they are one observation, not several."""
    grouped: dict[tuple[str, int], list[tuple[float, float, float]]] = defaultdict(list)
    for kind, index, begin, end, seconds in recoveries(t):
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
        return verdict("13 other tenants recover as usual while one's store is a tarpit", 0, [])
    usual: dict[str, list[float]] = defaultdict(list)
    during: list[tuple[str, float, float]] = []  # (class, when, seconds)
    for kind, begin, end, seconds in events(t):
        if any(begin < w_end and end > w_start for w_start, w_end in windows):
            during.append((kind, begin, seconds))
        else:
            usual[kind].append(seconds)
    ratios = []
    for kind, when, seconds in during:
        if len(usual[kind]) < MIN_USUAL:
            notes.append(f"{kind} at t={when:.0f}: {seconds:.1f}s, too few {kind} recoveries outside to compare")
            continue
        ratios.append(seconds / max(0.1, statistics.median(usual[kind])))
        longest = max(usual[kind])
        if seconds > longest + STALL_SECONDS:
            problems.append(f"{kind} at t={when:.0f}: recovered in {seconds:.1f}s during a tenant tarpit, "
                            f"the longest outside {longest:.1f}s")  # fmt: skip
    if len(ratios) >= MIN_JUDGED and (median := statistics.median(ratios)) > MEDIAN_RATIO:
        problems.append(f"recoveries during tenant tarpits took {median:.2f}x their class's usual median "
                        f"(limit {MEDIAN_RATIO}x, {len(ratios)} faults)")  # fmt: skip
    elif ratios:
        notes.append(f"median {statistics.median(ratios):.2f}x the usual over {len(ratios)} faults' recoveries "
                     f"in {len(windows)} tenant tarpits")  # fmt: skip
    return verdict("13 other tenants recover as usual while one's store is a tarpit", len(during), problems, notes)
