"""The operator's settings: one typed object, from the environment and the command line.

Every knob the operator has is a field here, with its environment variable.
The command line (`topotrain run --...`) overrides the environment, which
overrides the defaults. The Helm chart sets the environment.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from topotrain.contract import DEFAULT_MASTER_PORT
from topotrain.placement.topology import TopologyLevels

RecoveryStrategy = Literal["incremental", "recreate"]
RECOVERY_STRATEGIES: tuple[RecoveryStrategy, ...] = ("incremental", "recreate")
PodBinding = Literal["scheduler", "operator"]
POD_BINDINGS: tuple[PodBinding, ...] = ("scheduler", "operator")


class SettingsError(ValueError):
    """An environment variable or flag holds a value the operator cannot use."""


@dataclass(frozen=True)
class Settings:
    """Everything `topotrain run` is configured with.

    | field | environment | default |
    |---|---|---|
    | namespaces | TOPOTRAIN_NAMESPACES (comma list; empty = cluster-wide) | cluster-wide |
    | labels.* | TOPOTRAIN_LABEL_BLOCK/RACK/NVLINK/HOST/PRODUCT | DESIGN.md's labels |
    | metrics_port | TOPOTRAIN_METRICS_PORT (0 disables) | 9090 |
    | health_port | TOPOTRAIN_HEALTH_PORT (0 disables) | 8080 |
    | liveness_stall_seconds | TOPOTRAIN_LIVENESS_STALL_SECONDS (/healthz fails once the event loop has not run this long) | 60 |
    | pass_stall_seconds | TOPOTRAIN_PASS_STALL_SECONDS (/healthz fails once no job's pass has completed this long while jobs exist) | 300 |
    | lease_name | TOPOTRAIN_LEASE_NAME (the coordination.k8s.io Lease whose holder acts; "" = standalone, acts always) | topotrain |
    | lease_namespace | TOPOTRAIN_LEASE_NAMESPACE | POD_NAMESPACE, else the first watched namespace, else default |
    | lease_owner | TOPOTRAIN_LEASE_OWNER (a Deployment in the Lease's namespace that owns the Lease: deleting it deletes the Lease; the chart names its own) | none |
    | lease_duration | TOPOTRAIN_LEASE_DURATION seconds (a standby takes over once it has seen the Lease unrenewed this long) | 15 |
    | renew_deadline | TOPOTRAIN_RENEW_DEADLINE seconds (the leader stops acting when it has not renewed for this long; < lease_duration) | 10 |
    | retry_period | TOPOTRAIN_RETRY_PERIOD seconds between tries to renew or take the Lease (< renew_deadline) | 2 |
    | identity | TOPOTRAIN_IDENTITY (this replica in the Lease) | host_pid_nonce |
    | s3_endpoint | TOPOTRAIN_S3_ENDPOINT (when a job names none) | unset |
    | checkpoint_endpoints | TOPOTRAIN_CHECKPOINT_ENDPOINTS (comma list: endpoints a job may name besides in-cluster Services and s3_endpoint; endpoints.py) | none |
    | master_port | TOPOTRAIN_MASTER_PORT | 29500 |
    | reconcile_interval | TOPOTRAIN_RECONCILE_INTERVAL seconds (idle re-check) | 10 |
    | checkpoint_poll | TOPOTRAIN_CHECKPOINT_POLL seconds (S3 re-read while Running) | 10 |
    | resync_seconds | TOPOTRAIN_RESYNC_SECONDS (LISTs of pods and nodes against the watch cache; 0 disables) | 120 |
    | recovery | TOPOTRAIN_RECOVERY: incremental or recreate | incremental |
    | pod_binding | TOPOTRAIN_POD_BINDING: scheduler (gated pods, kube-scheduler binds them) or operator (a gang starting on free nodes is created bound to its planned nodes; docs/operator.md, "Who binds a pod") | scheduler |
    | pod_grace_seconds | TOPOTRAIN_POD_GRACE_SECONDS (deleting a gang) | 30 |
    | network_policy | TOPOTRAIN_NETWORK_POLICY (true: a NetworkPolicy per job) | false |
    | move_off_cordoned | TOPOTRAIN_MOVE_OFF_CORDONED (a cordoned node's gang moves, checkpointing first) | true |
    | checkpoint_request_timeout | TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT seconds a planned change waits for the checkpoint it asked for (0: asks none, resumes from the last commit) | 120 |
    """

    namespaces: tuple[str, ...] = ()
    labels: TopologyLevels = field(default_factory=TopologyLevels)
    metrics_port: int = 9090
    health_port: int = 8080
    # /healthz is answered by a thread (controller/health.py); it fails once the event loop has not
    # ticked for this long, so a loop busy with a burst of watch events is not restarted.
    liveness_stall_seconds: float = 60.0
    # ... and once jobs exist and none of their passes has completed for this long (health.py)
    pass_stall_seconds: float = 300.0
    # Leader election (controller/leader.py): only the holder of this Lease runs job passes.
    lease_name: str = "topotrain"
    lease_namespace: str = ""
    lease_owner: str = ""  # a Deployment in the Lease's namespace that owns it (the chart's)
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    identity: str = field(default_factory=lambda: (
        f"{socket.gethostname()}_{os.getpid()}_{random.SystemRandom().randrange(16**6):06x}"))
    s3_endpoint: str | None = None
    # Endpoints a job's spec.checkpoint.endpoint may name besides the defaults (endpoints.py).
    checkpoint_endpoints: tuple[str, ...] = ()
    master_port: int = DEFAULT_MASTER_PORT
    reconcile_interval: float = 10.0
    checkpoint_poll: float = 10.0
    resync_seconds: float = 120.0
    recovery: RecoveryStrategy = "incremental"
    # Who binds a gang's pods to the planned nodes: kube-scheduler (each pod created gated, the
    # gate released, the scheduler's bind) or the operator (spec.nodeName at creation, when the
    # gang is not queued and no older pod holds its nodes: two writes a pod fewer).
    pod_binding: PodBinding = "scheduler"
    pod_grace_seconds: int = 30
    # A NetworkPolicy per job letting only the gang's own pods in; the chart turns it on.
    network_policy: bool = False
    # A running gang with a pod on a cordoned node checkpoints and moves off it before the drain's
    # eviction (docs/operations.md, "Drains"); false leaves it until evicted.
    move_off_cordoned: bool = True
    # A planned change (resize, drain move, rollout, suspend) first asks the running gang for a
    # checkpoint of its current step and waits this long for its COMMITTED (planned.py); past it,
    # or at 0 (checkpoint-on-demand off), the change resumes from the last commit.
    checkpoint_request_timeout: float = 120.0
    verbose: bool = False

    @property
    def standalone(self) -> bool:
        return not self.lease_name

    def lease_home(self, env: Mapping[str, str] | None = None) -> str:
        """The Lease's namespace: set, else the operator's own (POD_NAMESPACE), else the first
        watched namespace, else default."""
        env = os.environ if env is None else env
        return (self.lease_namespace or env.get("POD_NAMESPACE", "").strip()
                or (self.namespaces[0] if self.namespaces else "default"))

    @property
    def cluster_wide(self) -> bool:
        return not self.namespaces

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        base = cls()
        labels = TopologyLevels(
            block=env.get("TOPOTRAIN_LABEL_BLOCK") or base.labels.block,
            rack=env.get("TOPOTRAIN_LABEL_RACK") or base.labels.rack,
            nvlink=env.get("TOPOTRAIN_LABEL_NVLINK") or base.labels.nvlink,
            host=env.get("TOPOTRAIN_LABEL_HOST") or base.labels.host,
            product=env.get("TOPOTRAIN_LABEL_PRODUCT") or base.labels.product,
        )
        recovery = env.get("TOPOTRAIN_RECOVERY") or base.recovery
        return cls(
            namespaces=_split(env.get("TOPOTRAIN_NAMESPACES", "")),
            labels=labels,
            metrics_port=_port(env, "TOPOTRAIN_METRICS_PORT", base.metrics_port),
            health_port=_port(env, "TOPOTRAIN_HEALTH_PORT", base.health_port),
            liveness_stall_seconds=_positive(_seconds(env, "TOPOTRAIN_LIVENESS_STALL_SECONDS",
                                                      base.liveness_stall_seconds),
                                             "TOPOTRAIN_LIVENESS_STALL_SECONDS"),
            pass_stall_seconds=_positive(_seconds(env, "TOPOTRAIN_PASS_STALL_SECONDS",
                                                  base.pass_stall_seconds), "TOPOTRAIN_PASS_STALL_SECONDS"),
            lease_name=env.get("TOPOTRAIN_LEASE_NAME", base.lease_name).strip(),
            lease_namespace=env.get("TOPOTRAIN_LEASE_NAMESPACE", "").strip(),
            lease_owner=env.get("TOPOTRAIN_LEASE_OWNER", "").strip(),
            **_lease_timing(env, base),
            identity=env.get("TOPOTRAIN_IDENTITY", "").strip() or base.identity,
            s3_endpoint=env.get("TOPOTRAIN_S3_ENDPOINT") or None,
            checkpoint_endpoints=_split(env.get("TOPOTRAIN_CHECKPOINT_ENDPOINTS", "")),
            master_port=_port(env, "TOPOTRAIN_MASTER_PORT", base.master_port),
            reconcile_interval=_seconds(env, "TOPOTRAIN_RECONCILE_INTERVAL", base.reconcile_interval),
            checkpoint_poll=_seconds(env, "TOPOTRAIN_CHECKPOINT_POLL", base.checkpoint_poll),
            resync_seconds=_seconds(env, "TOPOTRAIN_RESYNC_SECONDS", base.resync_seconds),
            recovery=_strategy(recovery, "TOPOTRAIN_RECOVERY"),
            pod_binding=_binding(env.get("TOPOTRAIN_POD_BINDING") or base.pod_binding, "TOPOTRAIN_POD_BINDING"),
            pod_grace_seconds=int(_seconds(env, "TOPOTRAIN_POD_GRACE_SECONDS", base.pod_grace_seconds)),
            network_policy=_flag(env, "TOPOTRAIN_NETWORK_POLICY", base.network_policy),
            move_off_cordoned=_flag(env, "TOPOTRAIN_MOVE_OFF_CORDONED", base.move_off_cordoned),
            checkpoint_request_timeout=_seconds(env, "TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT",
                                                base.checkpoint_request_timeout),
            verbose=env.get("TOPOTRAIN_VERBOSE", "").lower() in {"1", "true", "yes"},
        )

    def with_args(self, args: argparse.Namespace) -> Settings:
        """The command line's flags over these settings (unset flags keep the value)."""
        changes: dict[str, object] = {}
        if getattr(args, "namespace", None):
            changes["namespaces"] = tuple(
                ns for value in args.namespace for ns in _split(value)
            )
        if getattr(args, "standalone", False):
            changes["lease_name"] = ""
        elif getattr(args, "lease_name", None):
            changes["lease_name"] = args.lease_name
        for name in ("metrics_port", "health_port"):
            value = getattr(args, name, None)
            if value is not None:
                changes[name] = _check_port(value, "--" + name.replace("_", "-"))
        if getattr(args, "recovery", None):
            changes["recovery"] = _strategy(args.recovery, "--recovery")
        if getattr(args, "pod_binding", None):
            changes["pod_binding"] = _binding(args.pod_binding, "--pod-binding")
        if getattr(args, "verbose", False):
            changes["verbose"] = True
        return replace(self, **changes)  # type: ignore[arg-type]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `topotrain run`; each overrides its environment variable."""
    parser.add_argument(
        "--namespace", "-n", action="append", metavar="NS",
        help="watch this namespace (repeatable or comma list; default: TOPOTRAIN_NAMESPACES, "
        "else cluster-wide)",
    )
    election = parser.add_mutually_exclusive_group()
    election.add_argument("--lease-name", metavar="NAME",
                          help="the Lease whose holder acts (TOPOTRAIN_LEASE_NAME)")
    election.add_argument(
        "--standalone", action="store_true",
        help="no leader election: act even if another replica runs (tests, single replica)",
    )
    parser.add_argument("--metrics-port", type=int, metavar="N", help="Prometheus /metrics port")
    parser.add_argument("--health-port", type=int, metavar="N", help="liveness /healthz port")
    parser.add_argument(
        "--recovery", choices=RECOVERY_STRATEGIES,
        help="incremental (default): keep healthy pods' nodes; recreate: delete the whole gang, "
        "wait until it is gone, plan from scratch",
    )
    parser.add_argument(
        "--pod-binding", choices=POD_BINDINGS,
        help="scheduler (default): gated pods bound by kube-scheduler; operator: a gang starting "
        "on free nodes is created bound to its planned nodes (TOPOTRAIN_POD_BINDING)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def _split(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _check_port(value: int, name: str) -> int:
    if not 0 <= value <= 65535:
        raise SettingsError(f"{name}={value}: a port must be in [0, 65535] (0 disables)")
    return value


def _port(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        return _check_port(int(raw), key)
    except ValueError:
        raise SettingsError(f"{key}={raw!r}: not an integer port") from None


def _flag(env: Mapping[str, str], key: str, default: bool) -> bool:
    raw = env.get(key, "").strip().lower()
    if not raw:
        return default
    if raw in {"1", "true", "yes"}:
        return True
    if raw in {"0", "false", "no"}:
        return False
    raise SettingsError(f"{key}={raw!r}: must be true or false")


def _lease_timing(env: Mapping[str, str], base: Settings) -> dict[str, float]:
    """The three leader-election times; the leader must stop (renew deadline) before a standby
    may take over (lease duration), and try to renew more than once before that."""
    duration = _seconds(env, "TOPOTRAIN_LEASE_DURATION", base.lease_duration)
    deadline = _seconds(env, "TOPOTRAIN_RENEW_DEADLINE", base.renew_deadline)
    retry = _seconds(env, "TOPOTRAIN_RETRY_PERIOD", base.retry_period)
    if not 0 < retry < deadline < duration:
        raise SettingsError(
            f"TOPOTRAIN_RETRY_PERIOD={retry:g} < TOPOTRAIN_RENEW_DEADLINE={deadline:g} < "
            f"TOPOTRAIN_LEASE_DURATION={duration:g} must hold (seconds, all > 0)")
    if duration != round(duration) or duration < 1:
        raise SettingsError(f"TOPOTRAIN_LEASE_DURATION={duration:g}: whole seconds, at least 1 "
                            "(the Lease's leaseDurationSeconds)")
    return {"lease_duration": duration, "renew_deadline": deadline, "retry_period": retry}


def _positive(value: float, key: str) -> float:
    if value <= 0:
        raise SettingsError(f"{key}={value:g}: must be > 0 (a liveness probe that always fails)")
    return value


def _seconds(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{key}={raw!r}: not a number of seconds") from None
    if value < 0:
        raise SettingsError(f"{key}={raw!r}: must be >= 0")
    return value


def _strategy(value: str, name: str) -> RecoveryStrategy:
    for strategy in RECOVERY_STRATEGIES:
        if value == strategy:
            return strategy
    raise SettingsError(f"{name}={value!r}: must be one of {', '.join(RECOVERY_STRATEGIES)}")


def _binding(value: str, name: str) -> PodBinding:
    for binding in POD_BINDINGS:
        if value == binding:
            return binding
    raise SettingsError(f"{name}={value!r}: must be one of {', '.join(POD_BINDINGS)}")


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from `env` and `topotrain run`-style flags (for tests and scripts)."""
    parser = argparse.ArgumentParser(prog="topotrain run")
    add_arguments(parser)
    return Settings.from_env(env).with_args(parser.parse_args(list(argv or [])))
