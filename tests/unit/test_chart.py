"""The Helm chart as a platform team reviews it, rendered by the real `helm`
binary (no cluster): lint, what each set of values renders, least-privilege
RBAC, restricted pod security, and the schema refusing bad values."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "topotrain"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]

NON_DEFAULT: dict[str, Any] = {
    "replicaCount": 2,
    "watchNamespaces": ["team-a", "team-b"],
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "trainerPodMonitor": {"enabled": True},
    },
    "dashboard": {"enabled": True, "namespace": "monitoring"},
    "rbac": {"checkpointSecrets": [
        {"namespace": "team-a", "names": ["s3-ckpt"]},
        {"namespace": "team-b", "names": ["s3-ckpt", "s3-other"]},
        {"namespace": "team-a", "names": ["s3-extra"]},
    ]},
    "image": {"digest": "sha256:" + "ab" * 32},
    "operator": {"recovery": "recreate", "verbose": True, "checkpointRequestTimeoutSeconds": 0,
                 "podBinding": "operator"},
}


def _helm_path() -> Path:
    from testbed.binaries import binary

    try:
        return binary("helm")
    except FileNotFoundError as err:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{err} (CI=true: not skipping)", pytrace=False)
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def helm() -> Path:
    return _helm_path()


def run_helm(helm: Path, *args: str, values: dict[str, Any] | None = None,
             tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(helm), *args]
    if values is not None:
        assert tmp is not None
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)


def render(helm: Path, tmp: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    result = run_helm(helm, "template", "topotrain", str(CHART), "--namespace", "topotrain-system",
                      values=values or {}, tmp=tmp)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def rbac_rules(docs: list[dict[str, Any]]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(kind, namespace, rule) for every rule of every Role and ClusterRole."""
    for doc in docs:
        if doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc["rules"]:
                yield doc["kind"], doc["metadata"].get("namespace", ""), rule


def grants(docs: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    """(scope, group/resource, verb, resourceName or '*') granted by the rendered RBAC."""
    found = set()
    for kind, namespace, rule in rbac_rules(docs):
        scope = "cluster" if kind == "ClusterRole" else namespace
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames", ["*"]):
                        found.add((scope, f"{group}/{resource}".lstrip("/"), verb, name))
    return found


# What the operator calls, and nothing more (docs/helm.md, "RBAC review").
WORKLOAD = {
    "topotrain.io/trainingjobs": {"get", "list", "watch", "patch", "update", "delete"},
    "topotrain.io/trainingjobs/status": {"get", "patch", "update"},
    "topotrain.io/trainingjobs/scale": {"get"},
    "topotrain.io/trainingjobs/finalizers": {"update"},
    "pods": {"get", "list", "watch", "create", "delete", "patch"},
    "services": {"get", "list", "watch", "create", "patch", "delete"},
    "configmaps": {"get", "list", "watch", "create", "patch", "delete"},
    "events": {"create", "patch"},
    "events.k8s.io/events": {"create", "patch"},
    "networking.k8s.io/networkpolicies": {"get", "create", "patch"},  # networkPolicy.enabled
    # Kueue: the Workload of a job sent to a queue; its status only to give back an eviction's quota
    "kueue.x-k8s.io/workloads": {"get", "list", "watch", "create", "patch", "delete"},
    "kueue.x-k8s.io/workloads/status": {"get", "patch"},
    "kueue.x-k8s.io/localqueues": {"get"},
}
# The operator disables kopf's cluster scanning: no namespaces, no CRDs. Kueue: the admitted
# ResourceFlavor's node labels and a job's PriorityClass value.
CLUSTER_READ = {"nodes": {"get", "list", "watch"}, "kueue.x-k8s.io/resourceflavors": {"get"},
                "scheduling.k8s.io/priorityclasses": {"get"}, "topotrain.io/trainingjobtemplates": {"get"}}


def expected(scope: str, table: dict[str, set[str]]) -> set[tuple[str, str, str, str]]:
    return {(scope, res, verb, "*") for res, verbs in table.items() for verb in verbs}


def lease(namespace: str, name: str) -> set[tuple[str, str, str, str]]:
    """Leader election: create a Lease (create takes no resourceNames), read and renew its own,
    and read the release's Deployment (of the same name), the Lease's owner, for its UID."""
    return {(namespace, "coordination.k8s.io/leases", "create", "*"),
            (namespace, "apps/deployments", "get", name)} | {
        (namespace, "coordination.k8s.io/leases", v, name) for v in ("get", "update")
    }


def test_lint_passes_with_default_and_non_default_values(helm: Path, tmp_path: Path) -> None:
    default = run_helm(helm, "lint", "--strict", str(CHART))
    assert default.returncode == 0, default.stdout + default.stderr
    custom = run_helm(helm, "lint", "--strict", str(CHART), values=NON_DEFAULT, tmp=tmp_path)
    assert custom.returncode == 0, custom.stdout + custom.stderr


def test_default_install_is_cluster_wide_with_exactly_the_needed_rules(
    helm: Path, tmp_path: Path
) -> None:
    docs = render(helm, tmp_path)
    assert sorted(doc["kind"] for doc in docs) == sorted([
        "ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding",
        "ClusterRoleBinding", "Service", "Deployment", "Role", "RoleBinding",
    ])
    assert grants(docs) == (
        expected("cluster", WORKLOAD) | expected("cluster", CLUSTER_READ)
        | lease("topotrain-system", "topotrain")
    )
    for binding in by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "topotrain", "namespace": "topotrain-system"}
        ]


def test_namespaced_mode_grants_workload_rules_only_in_watched_namespaces(
    helm: Path, tmp_path: Path
) -> None:
    docs = render(helm, tmp_path, NON_DEFAULT)
    assert {doc["metadata"]["name"] for doc in by_kind(docs, "ClusterRole")} == {"topotrain-cluster"}
    secrets = {
        ("team-a", "secrets", "get", "s3-ckpt"), ("team-a", "secrets", "get", "s3-extra"),
        ("team-b", "secrets", "get", "s3-ckpt"), ("team-b", "secrets", "get", "s3-other"),
    }
    per_namespace = set()
    for ns in ("team-a", "team-b"):
        per_namespace |= expected(ns, WORKLOAD)
    assert grants(docs) == (expected("cluster", CLUSTER_READ) | per_namespace | secrets
                            | lease("topotrain-system", "topotrain"))
    bindings = by_kind(docs, "RoleBinding")
    assert {(b["metadata"]["namespace"], b["roleRef"]["name"]) for b in bindings} == {
        ("team-a", "topotrain"), ("team-b", "topotrain"), ("topotrain-system", "topotrain-leader"),
        ("team-a", "topotrain-checkpoint-secrets"), ("team-b", "topotrain-checkpoint-secrets"),
    }


@pytest.mark.parametrize("values", [{}, NON_DEFAULT], ids=["default", "non-default"])
def test_rbac_cannot_escalate_or_read_arbitrary_secrets(
    helm: Path, tmp_path: Path, values: dict[str, Any]
) -> None:
    for _, _, rule in rbac_rules(render(helm, tmp_path, values)):
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
        assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"])
        assert "rbac.authorization.k8s.io" not in rule["apiGroups"]
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["get"] and rule.get("resourceNames"), rule
        if "nodes" in rule["resources"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}


def test_deployment_runs_the_pinned_image_under_restricted_pod_security(
    helm: Path, tmp_path: Path
) -> None:
    deployment = one(render(helm, tmp_path), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"ghcr.io/topotrain/operator:{APP_VERSION}"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert any(v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 9090, "health": 8080}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TOPOTRAIN_NAMESPACES"] == ""
    assert env["TOPOTRAIN_LEASE_NAME"] == "topotrain"
    assert env["TOPOTRAIN_LEASE_NAMESPACE"] == "topotrain-system"
    assert env["TOPOTRAIN_LEASE_OWNER"] == deployment["metadata"]["name"]  # uninstall deletes the Lease
    assert (env["TOPOTRAIN_LEASE_DURATION"], env["TOPOTRAIN_RENEW_DEADLINE"], env["TOPOTRAIN_RETRY_PERIOD"]) == (
        "15", "10", "2")
    # Each replica is named in the Lease by its pod's name.
    identity = next(e for e in container["env"] if e["name"] == "TOPOTRAIN_IDENTITY")
    assert identity["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["TOPOTRAIN_LABEL_NVLINK"] == "nvidia.com/gpu.clique"
    assert env["TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT"] == "120"
    assert container["resources"]["limits"]["memory"]


def test_non_default_values_reach_the_pod(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, NON_DEFAULT)
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"ghcr.io/topotrain/operator:{APP_VERSION}@sha256:{'ab' * 32}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TOPOTRAIN_NAMESPACES"] == "team-a,team-b"
    assert env["TOPOTRAIN_RECOVERY"] == "recreate"
    assert env["TOPOTRAIN_POD_BINDING"] == "operator"
    assert env["TOPOTRAIN_VERBOSE"] == "true"
    assert env["TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT"] == "0"  # checkpoint-on-demand off
    # Two replicas spread over hosts unless affinity is given.
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_per_job_network_policies_are_on_by_default_and_can_be_turned_off(
    helm: Path, tmp_path: Path
) -> None:
    def env(docs: list[dict[str, Any]]) -> dict[str, str]:
        (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in container["env"]}

    default = render(helm, tmp_path)
    assert env(default)["TOPOTRAIN_NETWORK_POLICY"] == "true"
    assert ("cluster", "networking.k8s.io/networkpolicies", "patch", "*") in grants(default)
    off = render(helm, tmp_path, {"networkPolicy": {"enabled": False}})
    assert env(off)["TOPOTRAIN_NETWORK_POLICY"] == "false"
    assert not any("networkpolicies" in res for _, res, _, _ in grants(off)), "no rule it does not use"


def test_standalone_mode_has_no_leader_election(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, {"leaderElection": {"enabled": False}})
    assert not any("coordination.k8s.io" in rule["apiGroups"] for _, _, rule in rbac_rules(docs))
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["--standalone"]
    assert not {"TOPOTRAIN_LEASE_NAME", "TOPOTRAIN_LEASE_OWNER"} & {e["name"] for e in container["env"]}


def test_two_replicas_without_leader_election_are_refused(helm: Path, tmp_path: Path) -> None:
    result = run_helm(helm, "template", "t", str(CHART),
                      values={"replicaCount": 2, "leaderElection": {"enabled": False}}, tmp=tmp_path)
    assert result.returncode != 0
    assert "replicaCount > 1 needs leaderElection.enabled" in result.stderr


def test_a_renew_deadline_at_or_past_the_lease_duration_is_refused(helm: Path, tmp_path: Path) -> None:
    """The leader must stop acting before a standby may take its Lease over."""
    result = run_helm(helm, "template", "t", str(CHART), tmp=tmp_path,
                      values={"leaderElection": {"renewDeadlineSeconds": 15, "leaseDurationSeconds": 15}})
    assert result.returncode != 0
    assert "retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds" in result.stderr


def test_moving_image_tag_is_refused(helm: Path, tmp_path: Path) -> None:
    result = run_helm(helm, "template", "t", str(CHART), values={"image": {"tag": "latest"}},
                      tmp=tmp_path)
    assert result.returncode != 0
    assert 'image.tag: "latest" is a moving tag' in result.stderr


def test_service_monitor_scrapes_the_metrics_service(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, NON_DEFAULT)
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]


def exported_series(registry: Any) -> set[str]:
    """Names of the series a prometheus_client registry exposes, by metric type."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {
        family.name + suffix
        for family in registry.collect()
        for suffix in suffixes.get(family.type, [""])
    }


def test_dashboard_configmap_charts_every_metric_the_code_exports(
    helm: Path, tmp_path: Path
) -> None:
    import prometheus_client
    import topotrain_trainer.metrics  # noqa: F401  (registers the trainer's metrics)
    from topotrain.controller.metrics import Metrics

    operator_series = exported_series(Metrics().registry)
    trainer_series = {
        name for name in exported_series(prometheus_client.REGISTRY)
        if name.startswith("topotrain_")
    }
    configmap = one(render(helm, tmp_path, NON_DEFAULT), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(configmap["data"]["topotrain.json"])
    exprs = " ".join(
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    )
    used = set(re.findall(r"topotrain_[a-z_]+", exprs))
    assert used <= operator_series | trainer_series, "the dashboard queries unknown series"
    charted = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    for series in operator_series | trainer_series:
        assert re.sub(r"_(bucket|sum|count)$", "", series) in charted, f"{series} is not charted"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_trainer_pod_monitor_labels_series_with_the_trainingjob(
    helm: Path, tmp_path: Path
) -> None:
    monitor = one(render(helm, tmp_path, NON_DEFAULT), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"] if "targetLabel" in r}
    assert relabel["job"]["sourceLabels"] == ["__meta_kubernetes_pod_label_topotrain_io_job"]
    assert relabel["__address__"]["replacement"] == "${1}:9400"


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"replicas": 2}, "replicas"),
        ({"image": {"tagg": "0.1.0"}}, "tagg"),
        ({"replicaCount": "two"}, "replicaCount"),
        ({"securityContext": {"allowPrivilegeEscalation": True}}, "allowPrivilegeEscalation"),
        ({"securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}}}, "add"),
        ({"rbac": {"checkpointSecrets": [{"namespace": "a"}]}}, "names"),
        ({"watchNamespaces": "team-a"}, "watchNamespaces"),
    ],
    ids=["unknown-key", "unknown-nested-key", "wrong-type",
         "privilege-escalation", "added-capability", "secret-without-names", "namespaces-not-list"],
)
def test_schema_refuses_bad_values_naming_the_key(
    helm: Path, tmp_path: Path, values: dict[str, Any], named: str
) -> None:
    result = run_helm(helm, "template", "t", str(CHART), values=values, tmp=tmp_path)
    assert result.returncode != 0, f"accepted {values}"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert named in result.stderr, result.stderr


def _schema_objects(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if node.get("type") == "object":
        yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _schema_objects(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _schema_objects(node["items"], f"{path}[]")


def test_schema_closes_every_object_except_kubernetes_passthroughs() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = [
        path for path, node in _schema_objects(schema, "")
        if node.get("additionalProperties", True) is True
    ]
    # Kubernetes structures handed to the pod spec unchanged.
    assert open_objects == [
        ".tolerations[]", ".affinity.nodeAffinity", ".affinity.podAffinity",
        ".affinity.podAntiAffinity",
    ]


def _leaf_keys(values: Any, path: str = "") -> Iterator[str]:
    if isinstance(values, dict) and values:
        for key, child in values.items():
            yield from _leaf_keys(child, f"{path}.{key}" if path else key)
    else:
        yield path


def _commented_keys(lines: list[str]) -> set[str]:
    """Dotted paths of the keys in values.yaml whose line sits right under a comment."""
    stack: list[tuple[int, str]] = []
    commented = set()
    for index, line in enumerate(lines):
        match = re.match(r"( *)([A-Za-z][A-Za-z0-9]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group(2)))
        if index and lines[index - 1].lstrip().startswith("#"):
            commented.add(".".join(key for _, key in stack))
    return commented


def test_every_value_is_in_the_schema_and_documented() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    commented = _commented_keys((CHART / "values.yaml").read_text().splitlines())
    undocumented = []
    for leaf in _leaf_keys(values):
        node: dict[str, Any] = schema
        for part in leaf.split("."):
            if node.get("additionalProperties") not in (None, False) and part not in node.get(
                "properties", {}
            ):
                break  # inside a typed map (resources.requests, ...)
            assert part in node["properties"], f"{leaf} is not in values.schema.json"
            node = node["properties"][part]
        parts = leaf.split(".")
        # The value, or a map value it belongs to (resources, securityContext), has a comment.
        if not any(".".join(parts[:n]) in commented for n in range(1, len(parts) + 1)):
            undocumented.append(leaf)
    assert undocumented == []


def test_chart_ships_the_topotrain_crds_only() -> None:
    # (leader election uses the built-in Lease: no kopf peering CRDs are needed any more)
    names = {
        doc["metadata"]["name"]: doc
        for path in sorted((CHART / "crds").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text()) if doc
    }
    assert set(names) == {"trainingjobs.topotrain.io", "trainingjobtemplates.topotrain.io"}


def test_operator_image_matches_what_the_chart_expects() -> None:
    """The Dockerfile cannot be built here (no Docker); check what the chart relies on."""
    dockerfile = (ROOT / "operator" / "Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[a-f0-9]{64})?", base[1])
    assert dockerfile.count("FROM ") >= 2, "multi-stage: no build tools in the runtime image"
    instructions = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    assert not any("trainer]" in line for line in instructions), "the operator image needs no torch"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    assert re.search(rf"^USER {uid}:{uid}$", dockerfile, re.M)
    assert 'ENTRYPOINT ["topotrain", "run"]' in dockerfile
    exposed = re.search(r"^EXPOSE (.+)$", dockerfile, re.M)
    assert exposed and set(exposed[1].split()) == {
        str(values["healthPort"]), str(values["metrics"]["port"]),
    }


PLATFORM_TEMPLATE: dict[str, Any] = {
    "image": "registry.example/trainer:1.4",
    "worker": {"gpusPerPod": 8, "gpuTypes": ["H100-80GB"]},
    "failurePolicy": {"rules": [{"name": "oom-is-fatal", "action": "Fail", "onTerminationReasons": ["OOMKilled"]}]},
}


def test_the_chart_installs_platform_templates_from_values(helm: Path, tmp_path: Path) -> None:
    from topotrain.api.job_template import template_problems

    docs = render(helm, tmp_path, {"jobTemplates": {"h100-llm": PLATFORM_TEMPLATE}})
    [template] = by_kind(docs, "TrainingJobTemplate")
    assert template["apiVersion"] == "topotrain.io/v1alpha1" and template["metadata"]["name"] == "h100-llm"
    assert template["spec"] == PLATFORM_TEMPLATE and template_problems(template["spec"]) == []
    assert not by_kind(render(helm, tmp_path), "TrainingJobTemplate")


def test_the_values_schema_knows_the_template_fields_and_refuses_others(helm: Path, tmp_path: Path) -> None:
    from topotrain.api.job_template import template_spec_schema

    schema = json.loads((CHART / "values.schema.json").read_text())
    fields = schema["properties"]["jobTemplates"]["additionalProperties"]["propertyNames"]["enum"]
    assert fields == sorted(template_spec_schema()["properties"]), "regenerate jobTemplates' field list"
    result = run_helm(helm, "template", "t", str(CHART), tmp=tmp_path,
                      values={"jobTemplates": {"t": {"imagee": "x"}}})
    assert result.returncode != 0 and "invalid propertyName 'imagee'" in result.stderr, result.stderr
