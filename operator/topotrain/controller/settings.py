"""The operator's settings: one typed object, from the environment and the command line.

Every knob the operator has is a field here, with its environment variable.
The command line (`topotrain run --...`) overrides the environment, which
overrides the defaults. The Helm chart sets the environment.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from topotrain.contract import DEFAULT_MASTER_PORT
from topotrain.placement.topology import TopologyLevels

RecoveryStrategy = Literal["incremental", "recreate"]
RECOVERY_STRATEGIES: tuple[RecoveryStrategy, ...] = ("incremental", "recreate")


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
    | peering | TOPOTRAIN_PEERING ("" = standalone) | topotrain |
    | s3_endpoint | TOPOTRAIN_S3_ENDPOINT (when a job names none) | unset |
    | checkpoint_endpoints | TOPOTRAIN_CHECKPOINT_ENDPOINTS (comma list: endpoints a job may name besides in-cluster Services and s3_endpoint; endpoints.py) | none |
    | master_port | TOPOTRAIN_MASTER_PORT | 29500 |
    | reconcile_interval | TOPOTRAIN_RECONCILE_INTERVAL seconds (idle re-check) | 10 |
    | checkpoint_poll | TOPOTRAIN_CHECKPOINT_POLL seconds (S3 re-read while Running) | 10 |
    | resync_seconds | TOPOTRAIN_RESYNC_SECONDS (LISTs of pods and nodes against the watch cache; 0 disables) | 120 |
    | recovery | TOPOTRAIN_RECOVERY: incremental or recreate | incremental |
    | pod_grace_seconds | TOPOTRAIN_POD_GRACE_SECONDS (deleting a gang) | 30 |
    | network_policy | TOPOTRAIN_NETWORK_POLICY (true: a NetworkPolicy per job) | false |
    | move_off_cordoned | TOPOTRAIN_MOVE_OFF_CORDONED (a cordoned node's gang moves, checkpointing first) | true |
    | checkpoint_request_timeout | TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT seconds a planned change waits for the checkpoint it asked for (0: asks none, resumes from the last commit) | 120 |
    | peering_priority | TOPOTRAIN_PEERING_PRIORITY (highest replica acts) | random per process |
    | peering_lifetime | TOPOTRAIN_PEERING_LIFETIME seconds (a killed acting replica's standby takes over within it) | 30 |
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
    peering: str = "topotrain"
    s3_endpoint: str | None = None
    # Endpoints a job's spec.checkpoint.endpoint may name besides the defaults (endpoints.py).
    checkpoint_endpoints: tuple[str, ...] = ()
    master_port: int = DEFAULT_MASTER_PORT
    reconcile_interval: float = 10.0
    checkpoint_poll: float = 10.0
    resync_seconds: float = 120.0
    recovery: RecoveryStrategy = "incremental"
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
    # kopf pauses every replica that sees a peer of equal priority, so replicas
    # must differ: the highest one acts, the others wait to take over.
    peering_priority: int = field(default_factory=lambda: random.SystemRandom().randint(1, 1_000_000))
    # How long a replica's keep-alive in the peering object counts: a SIGKILLed acting replica
    # (node lost) leaves its entry behind, and the standby acts only once that entry expires.
    peering_lifetime: int = 30
    verbose: bool = False

    @property
    def standalone(self) -> bool:
        return not self.peering

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
            peering=env.get("TOPOTRAIN_PEERING", base.peering).strip(),
            s3_endpoint=env.get("TOPOTRAIN_S3_ENDPOINT") or None,
            checkpoint_endpoints=_split(env.get("TOPOTRAIN_CHECKPOINT_ENDPOINTS", "")),
            master_port=_port(env, "TOPOTRAIN_MASTER_PORT", base.master_port),
            reconcile_interval=_seconds(env, "TOPOTRAIN_RECONCILE_INTERVAL", base.reconcile_interval),
            checkpoint_poll=_seconds(env, "TOPOTRAIN_CHECKPOINT_POLL", base.checkpoint_poll),
            resync_seconds=_seconds(env, "TOPOTRAIN_RESYNC_SECONDS", base.resync_seconds),
            recovery=_strategy(recovery, "TOPOTRAIN_RECOVERY"),
            pod_grace_seconds=int(_seconds(env, "TOPOTRAIN_POD_GRACE_SECONDS", base.pod_grace_seconds)),
            network_policy=_flag(env, "TOPOTRAIN_NETWORK_POLICY", base.network_policy),
            move_off_cordoned=_flag(env, "TOPOTRAIN_MOVE_OFF_CORDONED", base.move_off_cordoned),
            checkpoint_request_timeout=_seconds(env, "TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT",
                                                base.checkpoint_request_timeout),
            peering_priority=_integer(env, "TOPOTRAIN_PEERING_PRIORITY", base.peering_priority),
            peering_lifetime=_lifetime(env, base.peering_lifetime),
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
            changes["peering"] = ""
        elif getattr(args, "peering", None):
            changes["peering"] = args.peering
        for name in ("metrics_port", "health_port"):
            value = getattr(args, name, None)
            if value is not None:
                changes[name] = _check_port(value, "--" + name.replace("_", "-"))
        if getattr(args, "recovery", None):
            changes["recovery"] = _strategy(args.recovery, "--recovery")
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
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME", help="kopf peering name (TOPOTRAIN_PEERING)")
    peering.add_argument(
        "--standalone", action="store_true",
        help="no peering: act even if another replica runs (tests, single replica)",
    )
    parser.add_argument("--metrics-port", type=int, metavar="N", help="Prometheus /metrics port")
    parser.add_argument("--health-port", type=int, metavar="N", help="liveness /healthz port")
    parser.add_argument(
        "--recovery", choices=RECOVERY_STRATEGIES,
        help="incremental (default): keep healthy pods' nodes; recreate: delete the whole gang, "
        "wait until it is gone, plan from scratch",
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


def _integer(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise SettingsError(f"{key}={raw!r}: not an integer") from None


def _lifetime(env: Mapping[str, str], default: int) -> int:
    key = "TOPOTRAIN_PEERING_LIFETIME"
    value = _integer(env, key, default)
    if value < 10:  # the keep-alive is sent 5-10 s before the lifetime ends
        raise SettingsError(f"{key}={value}: must be at least 10 seconds")
    return value


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


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from `env` and `topotrain run`-style flags (for tests and scripts)."""
    parser = argparse.ArgumentParser(prog="topotrain run")
    add_arguments(parser)
    return Settings.from_env(env).with_args(parser.parse_args(list(argv or [])))
