"""The operator's settings from environment and flags."""

from __future__ import annotations

import pytest
from topotrain.controller.settings import Settings, SettingsError, parse


def test_defaults() -> None:
    s = Settings.from_env({})
    assert (s.metrics_port, s.health_port, s.peering, s.namespaces) == (9090, 8080, "topotrain", ())
    assert s.cluster_wide and not s.standalone
    assert s.labels.rack == "topology.topotrain.io/rack" and s.labels.nvlink == "nvidia.com/gpu.clique"


@pytest.mark.parametrize(
    ("env", "argv", "field", "value"),
    [
        ({"TOPOTRAIN_NAMESPACES": "a, b,"}, [], "namespaces", ("a", "b")),
        ({"TOPOTRAIN_NAMESPACES": "a"}, ["--namespace", "x", "-n", "y,z"], "namespaces", ("x", "y", "z")),
        ({"TOPOTRAIN_METRICS_PORT": "9100"}, [], "metrics_port", 9100),
        ({"TOPOTRAIN_METRICS_PORT": "9100"}, ["--metrics-port", "0"], "metrics_port", 0),
        ({"TOPOTRAIN_HEALTH_PORT": "8081"}, [], "health_port", 8081),
        ({"TOPOTRAIN_PEERING": "blue"}, [], "peering", "blue"),
        ({"TOPOTRAIN_PEERING": "blue"}, ["--standalone"], "peering", ""),
        ({}, ["--peering", "green"], "peering", "green"),
        ({"TOPOTRAIN_S3_ENDPOINT": "http://s3:9000"}, [], "s3_endpoint", "http://s3:9000"),
        ({"TOPOTRAIN_RECONCILE_INTERVAL": "2.5"}, [], "reconcile_interval", 2.5),
        ({"TOPOTRAIN_RECOVERY": "recreate"}, [], "recovery", "recreate"),
        ({}, ["--recovery", "recreate"], "recovery", "recreate"),
        ({"TOPOTRAIN_MASTER_PORT": "23456"}, [], "master_port", 23456),
        ({}, [], "network_policy", False),
        ({"TOPOTRAIN_NETWORK_POLICY": "true"}, [], "network_policy", True),
        ({"TOPOTRAIN_NETWORK_POLICY": "0"}, [], "network_policy", False),
        ({}, [], "move_off_cordoned", True),
        ({"TOPOTRAIN_MOVE_OFF_CORDONED": "false"}, [], "move_off_cordoned", False),
        ({}, [], "checkpoint_request_timeout", 120.0),
        ({"TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT": "0"}, [], "checkpoint_request_timeout", 0.0),
        ({"TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT": "600"}, [], "checkpoint_request_timeout", 600.0),
    ],
)
def test_env_and_flags(env: dict[str, str], argv: list[str], field: str, value: object) -> None:
    assert getattr(parse(argv, env), field) == value


def test_label_overrides() -> None:
    s = Settings.from_env({"TOPOTRAIN_LABEL_RACK": "rack", "TOPOTRAIN_LABEL_PRODUCT": "gpu"})
    assert (s.labels.rack, s.labels.product, s.labels.block) == ("rack", "gpu", "topology.topotrain.io/block")


@pytest.mark.parametrize(
    "env",
    [{"TOPOTRAIN_METRICS_PORT": "http"}, {"TOPOTRAIN_HEALTH_PORT": "70000"},
     {"TOPOTRAIN_RECONCILE_INTERVAL": "-1"}, {"TOPOTRAIN_RECOVERY": "fast"},
     {"TOPOTRAIN_NETWORK_POLICY": "on"}, {"TOPOTRAIN_MOVE_OFF_CORDONED": "sometimes"},
     {"TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT": "-5"}],
)
def test_bad_values_name_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError, match=next(iter(env))):
        Settings.from_env(env)


def test_replicas_get_distinct_peering_priorities_unless_pinned() -> None:
    # kopf pauses every replica that sees a peer of the same priority: HA needs them distinct.
    priorities = {Settings.from_env({}).peering_priority for _ in range(20)}
    assert len(priorities) > 1
    assert Settings.from_env({"TOPOTRAIN_PEERING_PRIORITY": "7"}).peering_priority == 7
    with pytest.raises(SettingsError, match="TOPOTRAIN_PEERING_PRIORITY"):
        Settings.from_env({"TOPOTRAIN_PEERING_PRIORITY": "high"})


def test_peering_lifetime_bounds_a_standby_takeover_and_refuses_too_short() -> None:
    assert Settings.from_env({}).peering_lifetime == 30
    assert Settings.from_env({"TOPOTRAIN_PEERING_LIFETIME": "45"}).peering_lifetime == 45
    with pytest.raises(SettingsError, match="TOPOTRAIN_PEERING_LIFETIME=5: must be at least 10"):
        Settings.from_env({"TOPOTRAIN_PEERING_LIFETIME": "5"})
