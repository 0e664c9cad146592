"""The soak's invariants, each an independent checker of the history
(testbed.chaos.timeline). None of them reads the operator's status to decide
that something went right: job phases are used only to know that a job
claims to be finished, and the claim is then checked against the trainers'
output and S3.

1. resume: every attempt starts from a step whose COMMITTED marker S3 showed,
   and no newer COMMITTED existed `slack` seconds before its pods were created;
2. exclusive: never two live pods for one job/attempt/index, never two
   attempts' pods Running together (a crashed pod kept for its logs is Failed,
   not Running), and never two attempts' trainers stepping at the same time;
3. gpus: per node, GPUs requested by non-terminal pods <= allocatable;
4. outcome: every job ends Succeeded with every loss equal to the
   uninterrupted run's, or Failed with a reason naming a budget; a deleted job
   leaves neither itself nor pods behind;
5. availability: no job goes longer than `bound` seconds without a Running
   attempt unless a condition says why;
6. lost work per restart <= one checkpoint interval + steps since the last commit;
7. retention: <= keep + 1 committed checkpoints, the newest never deleted;
8. memory: the operator's RSS peak and slope stay bounded;
9. restarts: every new attempt follows a fault that touched its job (or is a
   resize), so a restart loop the operator makes up by itself is caught even
   when it ends in a budget-exhausted Failed;
10. roll floor (checkers_roll.py): after a spec roll, no restart resumes from a step the
   replaced gang saved after the roll's step;
11. fenced pod writes (checkers_lease.py): the API server's audit log shows no pod created or
   deleted by a replica that did not hold the Lease;
12. one failure, one restart (checkers_once.py): a crash, hang or deleted pod that alone
   explains a job's restarts explains one, not two;
13. tenant isolation (checkers_tenant.py): while another namespace's store is a tarpit, the
   soak's jobs recover from their own faults in the time the same soak shows as usual;
14. eviction bound (checkers_kueue.py, a soak run with Kueue): every Kueue eviction of a soak
   job gives its quota back within checkpointRequestTimeoutSeconds and a slack.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Callable

from testbed.chaos.catalogue import Kind
from testbed.chaos.causes import candidates, causes, restarts
from testbed.chaos.checkers_kueue import check_eviction_bound
from testbed.chaos.checkers_lease import check_fenced_pod_writes
from testbed.chaos.checkers_once import check_one_restart_per_failure
from testbed.chaos.checkers_roll import behind_floor, check_roll_floor
from testbed.chaos.checkers_tenant import check_tenant_isolation
from testbed.chaos.timeline import TERMINAL, Timeline, Verdict, timestamp, verdict

BUDGET_REASONS = {"MaxRestartsExceeded": "maxRestarts",
                  "MaxInfrastructureRestartsExceeded": "maxInfrastructureRestarts"}  # fmt: skip
EXPLAINING = {("Schedulable", "False"), ("PodsCreated", "False"), ("CheckpointStoreReachable", "False"),
              ("Admitted", "False"), ("Suspended", "True")}  # the last two: waiting for, or evicted by, Kueue
EXPLAINING_REASONS = {("Ready", "False", "PodsPending"), ("Recovering", "True", "BackoffWaiting"),
                      ("CheckpointStoreReachable", "True", "CheckpointStoreErrors")}  # fmt: skip


def _created(pod: dict[str, object]) -> float:
    raw = pod["created"]
    return raw if isinstance(raw, float) else timestamp(str(raw)) or 0.0


def check_resume(t: Timeline, slack: float = 6.0) -> Verdict:
    """Each pod against its own creation time; pods of one attempt (one run of it) agree. A newer
    commit the gang replaced by a spec roll saved after the roll's step is not resumable
    (invariant 10 judges those)."""
    commits, behind = t.commits(), behind_floor(t)
    problems: list[str] = []
    pods: dict[tuple[object, object], dict[str, object]] = {}
    for record in t.api:
        for pod in t.job_pods(record):
            if (pod["uid"], pod["attempt"]) in pods:
                continue
            if any(uid == pod["uid"] for uid, _ in pods):
                # Restarted in place: this attempt began when the pod was moved to it (seen now),
                # not when the pod was created.
                pod = {**pod, "created": record["t"]}
            pods[(pod["uid"], pod["attempt"])] = pod
    runs: dict[tuple[object, object, int], set[object]] = defaultdict(set)
    indices: dict[tuple[object, object, int], set[object]] = defaultdict(set)
    for pod in sorted(pods.values(), key=_created):
        job, number, raw = str(pod["job"]), pod["attempt"], pod["resume"]
        created = _created(pod)
        run = 0
        while pod["index"] in indices[(job, number, run)]:
            run += 1  # the same index again: a reused attempt number (invariant 2 says so)
        indices[(job, number, run)].add(pod["index"])
        runs[(job, number, run)].add(raw or None)
        resume = int(str(raw)) if raw else None
        seen = commits.get(job, {})
        if resume is not None and not (resume in seen and seen[resume] <= created + slack):
            problems.append(f"{job} attempt {number}: resumed from step {resume}, never seen COMMITTED before")
        newer = sorted(s for s, m in seen.items() if (resume is None or s > resume) and m < created - slack
                       and not (isinstance(number, int) and behind(job, number, s, created)))  # fmt: skip
        if newer:
            problems.append(f"{job} attempt {number}: resumed from {resume} while step {newer[-1]} was COMMITTED")
    problems += [f"{job} attempt {number}: pods told different steps {sorted(map(str, r))}"
                 for (job, number, _), r in runs.items() if len(r) > 1]  # fmt: skip
    return verdict("1 resume from the newest COMMITTED step", len(pods), list(dict.fromkeys(problems)))


def check_exclusive(t: Timeline) -> Verdict:
    problems: list[str] = []
    together: dict[str, tuple[int, ...]] = {}  # the previous snapshot's mixes of attempts
    for record in t.api:
        live: dict[tuple[str, int | None, int | None], int] = defaultdict(int)
        running: dict[str, set[int | None]] = defaultdict(set)
        for pod in t.job_pods(record):
            if pod["phase"] in TERMINAL or pod["deleting"]:
                continue
            live[(pod["job"], pod["attempt"], pod["index"])] += 1
            if pod["phase"] == "Running":
                running[pod["job"]].add(pod["attempt"])
        problems += [f"t={record['t']:.0f}: {n} live pods for {key}" for key, n in live.items() if n > 1]
        # A restart in place moves the kept pods to the next attempt one patch after another,
        # milliseconds apart, in one pass: a snapshot may catch that move half done. Two
        # attempts Running together in two snapshots in a row is a second gang, not a move.
        mixed = {job: tuple(sorted(a, key=str)) for job, a in running.items() if len(a) > 1}  # type: ignore[arg-type]
        problems += [f"t={record['t']:.0f}: {job} attempts {list(a)} Running together"
                     for job, a in mixed.items() if together.get(job) == a]  # fmt: skip
        together = mixed
    uids: dict[tuple[str, int | None, int | None], set[str]] = defaultdict(set)
    created: dict[str, float] = {}
    for record in t.api:
        for pod in t.job_pods(record):
            uids[(pod["job"], pod["attempt"], pod["index"])].add(pod["uid"])
            created.setdefault(pod["uid"], timestamp(pod["created"]) or record["t"])
    notes: list[str] = []
    for (job, attempt, index), found in sorted(uids.items(), key=str):
        if len(found) < 2:
            continue
        later = sorted(created[u] for u in found)[1]
        said = any(r["t"] < later and any(j["name"] == job and j["phase"] == "Running" and j.get("attempt") == attempt
                                          for j in r["jobs"]) for r in t.api)  # fmt: skip
        line = f"{job} attempt {attempt} index {index}: {len(found)} pods, the attempt was reused"
        (problems if said else notes).append(line + (" after the job said it Running" if said else ""))
    for job in t.events:
        spans: dict[int, tuple[float, float]] = {}
        for step in t.steps(job):
            first, _ = spans.get(step["attempt"], (step["time"], step["time"]))
            spans[step["attempt"]] = (first, step["time"])
        ordered = sorted(spans.items())
        for (a, (_, last_a)), (b, (first_b, _)) in itertools.pairwise(ordered):
            if first_b < last_a:
                problems.append(f"{job}: attempt {a} still stepping {last_a - first_b:.1f}s after attempt {b} began")
    return verdict("2 one gang at a time", len(t.api), problems, notes)


def check_gpus(t: Timeline) -> Verdict:
    problems: list[str] = []
    for record in t.api:
        used: dict[str, int] = defaultdict(int)
        for pod in record["pods"]:
            if pod["node"] and pod["phase"] not in TERMINAL:
                used[pod["node"]] += pod["gpus"]
        problems += [f"t={record['t']:.0f}: {node} has {n} GPUs requested of {record['nodes'][node]}"
                     for node, n in used.items() if node in record["nodes"] and n > record["nodes"][node]]  # fmt: skip
    return verdict("3 no GPU double-booked", len(t.api), problems)


def check_outcomes(t: Timeline, expected: Callable[[int, int], dict[int, float]]) -> Verdict:
    problems: list[str] = []
    for job, plan in sorted(t.created.items()):
        want = expected(plan["seed"], plan["steps"])
        wrong = [s for s in t.steps(job) if want.get(s["step"]) != s["loss"]]
        if wrong:
            problems.append(f"{job}: step {wrong[0]['step']} (attempt {wrong[0]['attempt']}) loss "
                            f"{wrong[0]['loss']} != uninterrupted {want.get(wrong[0]['step'])}")
        if job in t.deleted:
            problems += _leftovers(t, job)
            continue
        final = t.final_job(job) or {}
        if final.get("phase") == "Succeeded":
            reached = {s["step"] for s in t.steps(job)}
            if set(want) - reached or not any(e.get("event") == "done" for e in t.events.get(job, [])):
                problems.append(f"{job}: Succeeded without its trainer reaching step {plan['steps']}")
        elif final.get("phase") == "Failed":
            field = BUDGET_REASONS.get(final.get("reason") or "")
            if field is None or field not in (final.get("message") or ""):
                problems.append(f"{job}: Failed with {final.get('reason')}: {final.get('message')}")
        else:
            problems.append(f"{job}: unfinished at the end ({final.get('phase')}, {final.get('reason')})")
    return verdict("4 Succeeded with uninterrupted losses, or Failed on a budget", len(t.created), problems)


def _leftovers(t: Timeline, job: str, grace: float = 120.0) -> list[str]:
    after = [r for r in t.api if r["t"] > t.deleted[job] + grace]
    if not after:
        return []
    last = after[-1]
    if any(j["name"] == job for j in last["jobs"]) or any(p["job"] == job for p in t.job_pods(last)):
        return [f"{job}: deleted, but it or its pods are still there {grace:.0f}s later"]
    return []


def _running(t: Timeline, record: dict[str, object], job: str) -> bool:
    pods = [p for p in t.job_pods(record) if p["job"] == job and not p["deleting"] and p["phase"] not in TERMINAL]  # type: ignore[arg-type]
    if not pods:
        return False
    newest = max(p["attempt"] or 0 for p in pods)
    return all(p["phase"] == "Running" for p in pods if (p["attempt"] or 0) == newest)


def _explained(record: dict[str, object], job: str) -> bool:
    for seen in record["jobs"]:  # type: ignore[attr-defined]
        if seen["name"] == job:
            return any((c[0], c[1]) in EXPLAINING or tuple(c) in EXPLAINING_REASONS for c in seen["conditions"])
    return False


def check_availability(t: Timeline, bound: float = 120.0) -> Verdict:
    problems: list[str] = []
    for job, plan in sorted(t.created.items()):
        end, last_running, explained, reported = t.end_of(job), plan["t"], False, False
        for record in t.api:
            if record["t"] < plan["t"] or record["t"] > end:
                continue
            if _running(t, record, job):
                last_running, explained, reported = record["t"], False, False
                continue
            explained = explained or _explained(record, job)
            if record["t"] - last_running > bound and not explained and not reported:
                problems.append(f"{job}: no Running attempt for {record['t'] - last_running:.0f}s "
                                f"(from t={last_running:.0f}) and no condition saying why")
                reported = True
    return verdict(f"5 never over {bound:.0f}s without a Running attempt unexplained", len(t.created), problems)


def check_lost_work(t: Timeline) -> Verdict:
    commits, problems, checked = t.commits(), [], 0
    for job, plan in sorted(t.created.items()):
        reached = 0
        for start in t.starts(job):
            before = [s["step"] for s in t.steps(job) if s["time"] < start["time"]]
            reached = max([reached, *before])
            if not before:
                continue
            checked += 1
            newest = max((s for s, m in commits.get(job, {}).items() if m <= start["time"]), default=0)
            lost = reached - (start["resume"] or 0)
            allowed = plan["interval"] + max(0, reached - newest)
            if lost > allowed:
                problems.append(f"{job} attempt {start['attempt']}: lost {lost} steps, allowed {allowed}")
    return verdict("6 lost work <= interval + steps since the last commit", checked, problems)


# Faults during which retention's deletes may not run: the store down or slow, every job's store
# calls queued behind a tarpit (they share the namespace's store slots), or no Secret for a new
# attempt's pods to start with (issue 37's long soak, seed 3701: elastic-0001 held 4 committed,
# keep 2, 10 s after a checkpoint-tarpit on its store ended).
S3_FAULTS = {Kind.S3_DOWN, Kind.S3_ERRORS, Kind.S3_SLOW, Kind.CHECKPOINT_TARPIT, Kind.CREDENTIALS_DELETED}


def check_retention(t: Timeline, grace: float = 30.0) -> Verdict:
    """More than keep + 1 is allowed only within `grace` s of the newest commit (a trainer killed
    between a COMMITTED and its retention leaves one more until the next attempt's retention), or
    of the end of an S3 fault (retention is the store's deletes: they fail while it errs)."""
    problems: list[str] = []
    notes: list[str] = []
    newest: dict[str, int] = {}
    heals = {r["index"]: float(r["t"]) for r in t.heals}
    outages = [(float(f["t"]), heals.get(f["index"], float("inf"))) for f in t.faults if f["kind"] in S3_FAULTS]
    for record in t.s3:
        now = float(record["t"])
        # the end of the latest S3 fault begun by now (the future while it lasts)
        store_back = max((end for start, end in outages if start <= now), default=float("-inf"))
        for job, steps in record["committed"].items():
            if t.deleted.get(job, float("inf")) <= now:
                continue  # a deleted job's checkpoints stay as they were: no trainer applies retention
            present = {int(s) for s, _ in steps}
            keep = t.created.get(job, {}).get("keep", 1)
            if len(present) > keep + 1:
                line = f"t={record['t']:.0f}: {job} has {len(present)} committed (keep {keep})"
                young = now - max([max(float(m) for _, m in steps), store_back]) < grace
                (notes if young else problems).append(line + (", retention in flight" if young else ""))
            gone = job in newest and newest[job] not in present and max(present, default=-1) < newest[job]
            if gone and job not in t.deleted:
                problems.append(f"t={record['t']:.0f}: {job}'s newest committed step {newest[job]} is gone")
            newest[job] = max([newest.get(job, -1), *present])
    return verdict("7 retention <= keep + 1, never the newest", len(t.s3), problems, notes)


def memory_samples(records: list[dict[str, object]]) -> list[tuple[float, float]]:
    return [(float(r["t"]), max(r["mib"].values())) for r in records if r["type"] == "rss"]  # type: ignore[arg-type, attr-defined]


def check_restarts_explained(t: Timeline, window: float = 120.0, per_fault: int = 3) -> Verdict:
    """Every new attempt follows a fault that touched the job while the previous attempt ran or
    within `window` s before (at most `per_fault` restarts per fault and job), or changes the
    data degree (a resize)."""
    found_causes = causes(t)
    problems, checked = [], 0
    for job in sorted(t.created):
        used: dict[int, int] = defaultdict(int)
        for began, number, at in restarts(t, job):
            checked += 1
            found = next((i for i in candidates(found_causes, job, began, at, window) if used[i] < per_fault),
                         None)  # fmt: skip
            if found is None:
                problems.append(f"{job} attempt {number} at t={at:.0f}: no fault explains it")
            else:
                used[found] += 1
    return verdict("9 no restart without a fault", checked, problems)


def check_memory(samples: list[tuple[float, float]], peak_limit: float = 1024.0) -> Verdict:
    problems: list[str] = []
    if samples:
        peak = max(m for _, m in samples)
        if peak > peak_limit:
            problems.append(f"operator RSS peaked at {peak:.0f} MiB (limit {peak_limit:.0f})")
        third = len(samples) // 3
        if third >= 10 and samples[-1][0] - samples[0][0] >= 300:
            first = statistics.median(m for _, m in samples[:third])
            last = statistics.median(m for _, m in samples[-third:])
            if last > first * 1.5 + 64:
                problems.append(f"operator RSS grew from a median {first:.0f} MiB to {last:.0f} MiB")
    return verdict("8 operator memory bounded", len(samples), problems)


def slope_mib_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope after the first fifth (start-up), MiB per hour."""
    tail = samples[len(samples) // 5 :]
    if len(tail) < 3:
        return 0.0
    xs, ys = [t for t, _ in tail], [m for _, m in tail]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 3600 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def check_all(t: Timeline, records: list[dict[str, object]],
              expected: Callable[[int, int], dict[int, float]]) -> list[Verdict]:  # fmt: skip
    return [check_resume(t), check_exclusive(t), check_gpus(t), check_outcomes(t, expected),
            check_availability(t), check_lost_work(t), check_retention(t),
            check_memory(memory_samples(records)), check_restarts_explained(t),
            check_roll_floor(t), check_fenced_pod_writes(t.replicas, t.audit),
            check_one_restart_per_failure(t), check_tenant_isolation(t),
            check_eviction_bound(t, records)]  # fmt: skip
