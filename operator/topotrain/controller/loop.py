"""One reconcile loop per TrainingJob: observe, decide (pure), act, write status once.

The kopf daemon of each job runs `JobLoop.run`: a pass, then a wait until a
watch event wakes it (its pods, a node, freed capacity) or the pass's requeue
time or the idle interval passes. A decision that plans or creates pods is made
under one process-wide lock, with the pods it creates recorded in the ledger before
the lock is released, so concurrent jobs never plan onto the same free GPUs; every
other pass (most of them: a Running job's heartbeat) decides without it. The
decision runs in a worker thread; no API or S3 call is made under the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kopf

from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import JobTemplateStatus, Reason, TrainingJobStatus
from topotrain.controller.act import Actuator, acts
from topotrain.controller.health import PASSES
from topotrain.controller.indexes import JobKey
from topotrain.controller.kopf_finalizer import finalizer_shown
from topotrain.controller.leader import STALE
from topotrain.controller.look import WatchLook
from topotrain.controller.metrics import METRICS
from topotrain.controller.observe import Observer
from topotrain.controller.process import Operator, wants_capacity
from topotrain.controller.queue_link import QueueLink, QueueView, admitted_spec, queue_name
from topotrain.controller.snapshot import Snapshot
from topotrain.core import reconcile as rec
from topotrain.core import templates, transitions
from topotrain.core.decision import (
    Decision,
    NeedsRankTable,
    Observed,
    PodsAccepted,
    Refusal,
    Unread,
)
from topotrain.core.kueue_admission import lost_assigned, within_assignment
from topotrain.core.manifests import template_hash
from topotrain.core.multikueue import Manager, manager_of
from topotrain.core.node_failures import avoided_nodes
from topotrain.core.planning import (
    LazyPlanner,
    PlacementPlanner,
    Planner,
    WithinAssignment,
    WouldPlan,
)
from topotrain.core.rank_table import RankTable
from topotrain.core.reconcile_status import CheckpointView

log = logging.getLogger("topotrain.jobs")
COALESCE_SECONDS = 0.02  # let a burst of watch events land before the next pass
SLOW_PASS_SECONDS = 1.0  # a pass longer than this is logged with where its time went


class JobLoop:
    """The reconcile loop of one TrainingJob."""

    def __init__(self, op: Operator, key: JobKey, body: kopf.Body) -> None:
        self.op, self.key, self.body = op, key, body
        self.uid = str(body.get("metadata", {}).get("uid") or "")  # children are ours by this UID
        self.observer = Observer(op.kube, op.settings, self.uid)
        self.actuator = Actuator(op.kube, op.settings, op.ledger)
        self.last_refusal: datetime | None = None
        # The API server's answer to the last pass's pod creates, for the next pass to say.
        self.refusal: Refusal | None = None
        self.accepted: PodsAccepted | None = None
        self.queue = QueueLink(op.kube, key, self.uid, op.settings.labels)
        self.queue_view: QueueView | None = None  # this pass's reading of the Kueue Workload
        self.version: str | None = None  # the job's resourceVersion this loop's next write tests
        self.job_template: JobTemplateStatus | None = None  # this pass's (core/templates.py)
        self.first_pass = True
        self.lock_wait = 0.0  # seconds the last pass's decision waited for the plan lock

    async def run(self, stopped: kopf.DaemonStopped, pods: kopf.Index[str, Any],
                  nodes: kopf.Index[str, Any]) -> None:
        # Its own event, never a stopping namesake's (that loop's end must not take this one's).
        event = self.op.wakers[self.key] = asyncio.Event()
        PASSES.loop_started()
        try:
            await finalizer_shown(self.body, stopped)  # the first pass decides from kopf's write
            while not stopped:
                event.clear()
                if self.op.leader is not None and not await self.op.leader.wait_acting(1.0):
                    PASSES.pass_done()  # a standby waiting for the Lease is not a stuck pass
                    continue  # only the Lease's holder runs passes
                try:
                    await self.op.resync_if_due(pods, nodes)
                    requeue = await self.pass_once(pods, nodes, stopped)
                except STALE as exc:  # the pass ends; the next decides afresh
                    log.info("%s/%s: pass ended before acting on it: %s", *self.key, exc)
                    requeue = 0.2
                except Exception:  # one job's trouble never stops the others
                    log.exception("reconcile of %s/%s failed; retrying", *self.key)
                    requeue = self.op.settings.reconcile_interval
                PASSES.pass_done()  # /healthz's watchdog (health.py)
                timeout = self.op.settings.reconcile_interval
                if requeue is not None:
                    timeout = max(0.05, min(requeue, timeout))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout)
                await asyncio.sleep(COALESCE_SECONDS)
        finally:
            PASSES.loop_ended()
            self.op.forget(self.key, event)
            self.actuator.job_ended(self.key[0], self.uid)
            METRICS.job_phase(*self.key, None)

    async def pass_once(self, pods: kopf.Index[str, Any], nodes: kopf.Index[str, Any],
                        stopped: kopf.DaemonStopped | None = None) -> float | None:
        """Observe, decide (pure), write the status once, act; the seconds until the next pass
        (None: when something changes)."""
        started = time.perf_counter()
        if (manager := manager_of(self.body)) is not Manager.TOPOTRAIN:
            # spec.managedBy names another controller: no pod, no status write (MultiKueue's
            # job only gets its Workload here, which Kueue dispatches to a worker cluster).
            if manager is Manager.MULTIKUEUE:
                await asyncio.to_thread(self.queue.dispatched, self.body)
            return None
        self.version = self.op.read_version(self.key, self.uid, self.body)
        status = TrainingJobStatus.model_validate(raw_status := self._status_read())
        raw = dict(self.body.get("spec") or {})  # merged over its template, if it names one
        name = templates.to_read(raw, status.job_template)
        live = await asyncio.to_thread(self.op.kube.job_template, name) if name else None
        resolved = templates.resolve_job(raw, status.job_template, live)
        if resolved.spec is None:
            rejected = transitions.reject_spec(status, [resolved.message], datetime.now(UTC), resolved.reason)
            self.version = await self.op.write_status(self.key, self.uid, rejected.status, self.version)
            return None if resolved.reason == Reason.INVALID_SPEC else self.op.settings.reconcile_interval
        spec, self.job_template = resolved.spec, resolved.record
        view = self.queue_view = None
        self.actuator.queued = queue_name(self.body) is not None
        if self.actuator.queued:
            view = self.queue_view = await asyncio.to_thread(
                self.queue.observe, self.body, spec, status.phase in ("Succeeded", "Failed"))
            spec = admitted_spec(spec, view)
            self.observer.run_uid = self.uid if view is None or view.run_uid is None else view.run_uid
        problem, ckpt = await self.op.store_calls.checkpoint(self.observer, self.key, spec, status)
        owned, table = await self._children(new=not raw_status)
        observed = time.perf_counter()
        look = WatchLook(self.op, self.key, pods, nodes)
        decision, nodes_used, ckpt = await self._decision(spec, status, look, ckpt, table, problem or owned)
        decided = time.perf_counter()
        if stopped:
            # The job was deleted while this pass decided: its namesake may exist already, and
            # a status patch or pod by this name would land on the other object.
            self.actuator.unreserve(self.key, decision)
            return None
        try:
            # Intent first: the status (attempt, restarts, failure) is durable before any pod
            # changes, so an operator killed at any line resumes without losing or repeating it.
            # Written even unchanged if the pass acts: a compare-and-swap on the version it read.
            self.version = await self.op.write_status(self.key, self.uid, decision.status, self.version,
                                                      fenced=acts(decision))
        except BaseException:
            self.actuator.unreserve(self.key, decision)  # nothing was created: free the GPUs now
            raise
        self.refusal = self.accepted = None  # said by this write, when there was any
        written = time.perf_counter()
        await self._act(look, spec, view, decision)
        self._log_pass(decision, (started, observed, decided, written, time.perf_counter()))
        if view is not None:
            await self._settle_queue(view, decision)
        METRICS.pass_done(*self.key, decision, ckpt.time if ckpt is not None else None)
        self.op.note(self.key, wants_capacity(decision.status, spec), nodes_used)
        METRICS.reconcile.observe(time.perf_counter() - started)
        # The API server's answer to this pass's pod creates is said by the next pass, at once.
        return 0.0 if self.refusal is not None or self.accepted is not None else decision.requeue_after

    def _status_read(self) -> dict[str, Any]:
        """The status this pass starts from: the one last written, else the object's."""
        raw_status = self.op.last_written(self.key, self.uid)
        if raw_status is None:
            raw_status = dict(self.body.get("status") or {})
            self.op.written[self.key] = (self.uid, raw_status)
        return raw_status

    async def _decision(self, spec: TrainingJobSpec, status: TrainingJobStatus, look: WatchLook,
                        ckpt: CheckpointView | None, table: RankTable | Unread | None,
                        problem: tuple[str, str] | None,
                        ) -> tuple[Decision, frozenset[str], CheckpointView | None]:
        """The pass's decision, the nodes it uses, and the checkpoint view it was taken on."""
        # Decisions run in a worker thread (building the inventory and planning a large gang take
        # long, and kopf's event loop must keep serving watches and probes). Most passes (a
        # Running job's heartbeat, a job that waits) plan nothing and create no pods: they decide
        # without the process-wide lock, so they never queue behind another job's large plan. A
        # decision that planned, launches pods or restarts in place is made again under the lock,
        # on the index as it is then, and only the decision: the launch's pods are recorded in the
        # ledger before the lock is released, so another job's plan never takes their GPUs; the
        # status write and the pod changes run after it, so one job's slow API call never holds
        # up every other job.
        # The rank table (an API GET) is read only when a decision asks for it (NeedsRankTable:
        # a restart, an in-place replacement, a gang still being created) or before one that
        # plans: a Running job's passes never need it.
        decision: Decision | None = None
        nodes_used: frozenset[str] = frozenset()
        claims = False
        for _ in range(2):
            try:
                decision, nodes_used, claims = await asyncio.to_thread(
                    self._decide, spec, status, look.take(), ckpt, table, problem, probe=True)
                break
            except WouldPlan:
                claims = True
                break
            except NeedsRankTable:
                table, problem = await self._read_table(problem)
        locked = claims or decision is None or decision.relabel is not None
        if locked and isinstance(table, Unread):  # never read under the lock
            table, problem = await self._read_table(problem)
        self.lock_wait = 0.0
        for fresh_read in (False, True) if locked else ():
            waited = time.perf_counter()
            async with self.op.plan_lock:
                self.lock_wait += time.perf_counter() - waited
                # In the planner's own thread, in one hop: the lock is never held while the
                # decision waits for a worker thread behind other jobs' API calls (a burst of new
                # jobs queued each launch decision behind the others' pod creates).
                decision, nodes_used, stale = await asyncio.get_running_loop().run_in_executor(
                    self.op.planner, self._decide_locked, spec, status, look.take(), ckpt, table,
                    problem, fresh_read)
                if not stale:
                    break
            # A restart resumes from the newest commit: read the store again before deciding it.
            _, ckpt = await self.op.store_calls.checkpoint(self.observer, self.key, spec, status, True)
        if decision is None:  # not reached: the lock's loop decides whenever the first look did not
            raise RuntimeError(f"{self.key}: no decision")
        return decision, nodes_used, ckpt

    async def _children(self, new: bool) -> tuple[tuple[str, str] | None, RankTable | Unread | None]:
        """The ownership problem of the job's children, and its rank table on the loop's first
        pass only: later passes read it when a decision asks (_decision). A `new` job's (no
        status written yet) is known absent, not read: the status is written before any child
        is made (a ConfigMap of another owner under its name still stops the launch, in the
        Actuator's apply, and the next pass reports it)."""
        first, self.first_pass = self.first_pass, False
        recheck = self.actuator.problem is not None
        if new and not recheck:
            problem, _ = await asyncio.to_thread(self.observer.children, self.key, False, False)
            return problem, None
        return await asyncio.to_thread(self.observer.children, self.key, recheck, first)

    async def _read_table(self, problem: tuple[str, str] | None
                          ) -> tuple[RankTable | None, tuple[str, str] | None]:
        """The rank table a decision asked for, and the pass's ownership problem (a ConfigMap of
        another owner under its name is one)."""
        owned, table = await asyncio.to_thread(self.observer.rank_table, self.key)
        return table, problem or owned

    async def _act(self, look: WatchLook, spec: TrainingJobSpec, view: QueueView | None,
                   decision: Decision) -> None:
        """Carry the decision out; keep the API server's answer to its pod creates for the next
        pass (`refusal`, `accepted`), and post the pass's Events."""
        self.actuator.tas_hosts = frozenset(view.hosts or ()) if view is not None else frozenset()
        self.actuator.seen = {str(p["metadata"]["name"]): p for p in look.pods}
        try:
            refused = await self.actuator.apply_in_thread(self.key, self.body, spec, decision)
        except STALE:
            self.actuator.unreserve(self.key, decision)  # the pods it created show up in the watch
            raise
        if self.actuator.gone and (ghosts := self.op.ghosts.mark(look.pods, self.key[0], self.actuator.gone)):
            # Mostly a deletion the watch has not delivered yet; sometimes one it never will.
            log.info("%s/%s: the API server has no pod %s though the watch cache shows it: "
                     "leaving it out from now on", *self.key, ", ".join(sorted(self.actuator.gone)))
            self.op.ghosts_found(len(ghosts), [self.key])
        if refused:
            self.last_refusal = datetime.now(UTC)
            self.refusal = transitions.refusal_condition(refused)
        elif decision.launch is not None and self.last_refusal is not None:
            self.last_refusal = None
            launch = decision.launch
            self.accepted = PodsAccepted(launch.attempt, len(launch.only or launch.assignments))
        for kind, reason, message in decision.events:
            kopf.event(self.body, type=kind, reason=reason, message=message)
            log.info("%s/%s %s %s: %s", *self.key, kind, reason, message)

    def _log_pass(self, decision: Decision, marks: tuple[float, float, float, float, float]) -> None:
        """Log a pass that changed pods, and any pass over SLOW_PASS_SECONDS, with where its time
        went: observe (the job, its template, Workload, checkpoint and children), decide (of
        which waiting for the plan lock), the status write, and the pod changes."""
        started, observed, decided, written, ended = marks
        times = (decided - started, written - decided, ended - written, observed - started, self.lock_wait)
        if decision.launch or decision.delete or decision.release or decision.relabel:
            launch = decision.launch
            log.info("%s/%s phase %s: delete %d, create %s, release %d "
                     "(observe+decide %.2fs, status %.2fs, act %.2fs) observe %.2fs, plan lock wait %.2fs",
                     *self.key, decision.status.phase, len(decision.delete),
                     f"attempt {launch.attempt} x{len(launch.only or launch.assignments)}" if launch else "-",
                     len(decision.release), *times)
        elif ended - started > SLOW_PASS_SECONDS:
            log.info("%s/%s slow pass, phase %s: %.2fs (observe+decide %.2fs, status %.2fs, act %.2fs) "
                     "observe %.2fs, plan lock wait %.2fs", *self.key, decision.status.phase, ended - started,
                     *times)

    def _decide(self, spec: TrainingJobSpec, status: TrainingJobStatus,
                take: Callable[[], Snapshot],
                ckpt: CheckpointView | None, table: RankTable | Unread | None,
                problem: tuple[str, str] | None, probe: bool = False
                ) -> tuple[Decision, frozenset[str], bool]:
        """Snapshot (`take`: WatchLook's) and decide (pure, CPU only): run in a worker thread.
        Also returns the nodes the job's pods are on or planned for (what wakes it), and whether
        the decision claims free GPUs (it planned, or launches pods): only such a decision needs
        the plan lock. `probe`: raise WouldPlan where the decision would plan."""
        snapshot = take()
        obs = self._observed(spec, status, snapshot, ckpt, table, problem, probe)
        decision = rec.reconcile(obs)
        used = {p.node or p.planned_node for p in obs.pods}
        if decision.launch is not None:
            used |= set(decision.launch.assignments.values())
        planned = any(isinstance(p, LazyPlanner) and p.used for p in (obs.planner, obs.unavoiding_planner))
        return decision, frozenset(used - {""}), planned or decision.launch is not None

    def _decide_locked(self, spec: TrainingJobSpec, status: TrainingJobStatus,
                       take: Callable[[], Snapshot], ckpt: CheckpointView | None,
                       table: RankTable | Unread | None, problem: tuple[str, str] | None,
                       fresh_read: bool) -> tuple[Decision, frozenset[str], bool]:
        """Under the plan lock: decide and, unless the checkpoint view is stale for a launch or
        an in-place restart (then the store is read again first), record the launch's pods in
        the ledger. Returns (decision, nodes used, stale)."""
        decision, nodes_used, _ = self._decide(spec, status, take, ckpt, table, problem)
        stale = (spec.checkpoint is not None and not fresh_read
                 and (decision.launch is not None or decision.relabel is not None)
                 and not self.observer.fresh(self.key))
        if not stale:
            self.actuator.reserve(self.key, self.body, spec, decision)
        return decision, nodes_used, stale

    def _observed(self, spec: TrainingJobSpec, status: TrainingJobStatus, snapshot: Snapshot,
                  ckpt: CheckpointView | None, table: RankTable | Unread | None,
                  problem: tuple[str, str] | None, probe: bool = False) -> Observed:
        labels = self.op.settings.labels
        tolerations = [t.to_wire() for t in spec.worker.tolerations]

        avoid = avoided_nodes(status.node_failures)
        view = self.queue_view
        # Under Kueue, only the nodes of the admitted ResourceFlavor.
        selector = {**spec.worker.node_selector, **view.node_labels} if view else spec.worker.node_selector

        def make(avoiding: frozenset[str]) -> Callable[[], Planner]:
            def build() -> Planner:
                inventory = snapshot.inventory(self.key, labels, tolerations, selector, avoiding,
                                               uid=self.uid or None)  # fmt: skip
                if view is None or not view.hosts:
                    return PlacementPlanner(spec, inventory)
                # Kueue's topology assignment only: the flavor's other nodes may be promised to
                # admitted workloads whose pods do not exist yet (a lost node: hand the job back).
                assigned = within_assignment(inventory, view.hosts, spec.worker.gpus_per_pod)
                lost = lost_assigned(inventory, view.hosts, avoiding)
                return WithinAssignment(PlacementPlanner(spec, assigned), lost)
            return build

        return Observed(
            name=self.key[1], namespace=self.key[0],
            generation=int(self.body.get("metadata", {}).get("generation") or 0),
            spec=spec, status=status, pods=snapshot.job_pods(self.key, self.uid or None),
            nodes=snapshot.node_views(), planner=LazyPlanner(make(avoid), probe), now=datetime.now(UTC),
            unavoiding_planner=LazyPlanner(make(frozenset()), probe) if avoid else None,
            checkpoint=ckpt, rank_table=table,
            config_problem=problem or snapshot.foreign_problem(self.key, self.uid, status.attempt),
            strategy=self.op.settings.recovery, last_refusal=self.last_refusal,
            template=template_hash(spec), move_off_cordoned=self.op.settings.move_off_cordoned,
            checkpoint_request_timeout=self.op.settings.checkpoint_request_timeout,
            queue=view.gate if view else None, refusal=self.refusal, accepted=self.accepted,
            took_over=self.observer.took_over, job_template=self.job_template,
        )

    async def _settle_queue(self, view: QueueView, decision: Decision) -> None:
        """Hand a job that lost a node of its topology assignment back to Kueue; give back an evicted
        job's quota once its pods are gone; delete a finished job's Workload."""
        if decision.hand_back is not None:
            await asyncio.to_thread(self.queue.hand_back, view, decision.hand_back)
        if decision.release_quota:
            await asyncio.to_thread(self.queue.release, view)
        status = decision.status
        if status.phase in ("Succeeded", "Failed") and view.workload is not None:
            await asyncio.to_thread(self.queue.finish, view, status.phase == "Succeeded", status.message or "")
        else:  # written only when it changes (a Workload changed since it was read: next pass)
            await asyncio.to_thread(self.queue.pods_ready, view, status.phase == "Running")
