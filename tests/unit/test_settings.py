"""The operator's settings from environment and flags."""

from __future__ import annotations

import pytest
from topotrain.controller.settings import Settings, SettingsError, parse


def test_defaults() -> None:
    s = Settings.from_env({})
    assert (s.metrics_port, s.health_port, s.lease_name, s.namespaces) == (9090, 8080, "topotrain", ())
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
        ({"TOPOTRAIN_LEASE_NAME": "blue"}, [], "lease_name", "blue"),
        ({"TOPOTRAIN_LEASE_NAME": "blue"}, ["--standalone"], "lease_name", ""),
        ({}, ["--lease-name", "green"], "lease_name", "green"),
        ({}, [], "lease_duration", 15.0),
        ({}, [], "renew_deadline", 10.0),
        ({}, [], "retry_period", 2.0),
        ({"TOPOTRAIN_LEASE_DURATION": "30", "TOPOTRAIN_RENEW_DEADLINE": "20"}, [], "renew_deadline", 20.0),
        ({"TOPOTRAIN_IDENTITY": "replica-a"}, [], "identity", "replica-a"),
        ({"TOPOTRAIN_S3_ENDPOINT": "http://s3:9000"}, [], "s3_endpoint", "http://s3:9000"),
        ({"TOPOTRAIN_RECONCILE_INTERVAL": "2.5"}, [], "reconcile_interval", 2.5),
        ({"TOPOTRAIN_RECOVERY": "recreate"}, [], "recovery", "recreate"),
        ({}, ["--recovery", "recreate"], "recovery", "recreate"),
        ({}, [], "pod_binding", "scheduler"),
        ({"TOPOTRAIN_POD_BINDING": "operator"}, [], "pod_binding", "operator"),
        ({"TOPOTRAIN_POD_BINDING": "operator"}, ["--pod-binding", "scheduler"], "pod_binding", "scheduler"),
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
     {"TOPOTRAIN_RECONCILE_INTERVAL": "-1"}, {"TOPOTRAIN_RECOVERY": "fast"}, {"TOPOTRAIN_POD_BINDING": "kubelet"},
     {"TOPOTRAIN_NETWORK_POLICY": "on"}, {"TOPOTRAIN_MOVE_OFF_CORDONED": "sometimes"},
     {"TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT": "-5"}],
)
def test_bad_values_name_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError, match=next(iter(env))):
        Settings.from_env(env)


def test_replicas_get_distinct_identities_unless_named() -> None:
    # Two replicas with one identity would both count as the Lease's holder.
    assert len({Settings.from_env({}).identity for _ in range(20)}) == 20


@pytest.mark.parametrize(
    ("env", "words"),
    [({"TOPOTRAIN_RENEW_DEADLINE": "15"}, "TOPOTRAIN_RENEW_DEADLINE=15 < TOPOTRAIN_LEASE_DURATION=15"),
     ({"TOPOTRAIN_RETRY_PERIOD": "10"}, "TOPOTRAIN_RETRY_PERIOD=10 < TOPOTRAIN_RENEW_DEADLINE=10"),
     ({"TOPOTRAIN_RETRY_PERIOD": "0"}, "TOPOTRAIN_RETRY_PERIOD=0"),
     ({"TOPOTRAIN_LEASE_DURATION": "15.5"}, "TOPOTRAIN_LEASE_DURATION=15.5: whole seconds")],
)
def test_a_leader_must_stop_before_its_lease_can_expire(env: dict[str, str], words: str) -> None:
    """Renew deadline < lease duration (and a retry within the deadline), or it is refused."""
    with pytest.raises(SettingsError, match=words):
        Settings.from_env(env)


def test_the_lease_lives_in_the_operators_namespace_else_the_first_watched_one() -> None:
    assert Settings.from_env({"TOPOTRAIN_LEASE_NAMESPACE": "ops"}).lease_home({"POD_NAMESPACE": "x"}) == "ops"
    assert Settings.from_env({"TOPOTRAIN_NAMESPACES": "a,b"}).lease_home({"POD_NAMESPACE": "x"}) == "x"
    assert Settings.from_env({"TOPOTRAIN_NAMESPACES": "a,b"}).lease_home({}) == "a"
    assert Settings.from_env({}).lease_home({}) == "default"
