"""The children a TrainingJob gets: names, labels, owner refs, pod env, gates, pinning."""

from __future__ import annotations

import json
from typing import Any

import pytest
from topotrain.api.pod import operator_annotation, operator_label
from topotrain.api.spec import TrainingJobSpec
from topotrain.contract import TrainerEnv
from topotrain.core.manifests import (
    GANG_GATE,
    JobMeta,
    PodPlan,
    network_policy,
    pod,
    restart_in_place_patch,
    service,
    template_hash,
)
from topotrain.core.rank_table import parse_rank_table, rank_rows, rank_table

JOB = JobMeta("llm", "team", "uid-1")


def spec(**kw: Any) -> TrainingJobSpec:
    base: dict[str, Any] = {
        "image": "trainer:1", "command": ["python", "-m", "topotrain_trainer"],
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 2}, "worker": {"gpusPerPod": 2},
        "checkpoint": {"uri": "s3://ckpt/runs", "credentialsSecret": "creds",
                       "endpoint": "http://s3:9000", "intervalSteps": 50},
        "env": [{"name": "LOG", "value": "1"}],
    }
    base.update(kw)
    return TrainingJobSpec.model_validate(base)


def env_of(manifest: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in manifest["spec"]["containers"][0]["env"]}


def test_pod_is_gated_pinned_and_owned() -> None:
    p = pod(JOB, spec(), PodPlan(attempt=3, index=1, node="gpu-7", data=2, resume_step=400))
    assert p["metadata"]["name"] == "llm-3-1"
    assert p["metadata"]["labels"] == {
        "topotrain.io/job": "llm", "topotrain.io/attempt": "3", "topotrain.io/index": "1",
        "app.kubernetes.io/managed-by": "topotrain",
    }
    owner = p["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"], owner["blockOwnerDeletion"]) == (
        "TrainingJob", "uid-1", True, True)
    assert p["spec"]["schedulingGates"] == [{"name": GANG_GATE}]
    term = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gpu-7"]
    assert p["spec"]["restartPolicy"] == "Never"
    assert (p["spec"]["hostname"], p["spec"]["subdomain"]) == ("llm-3-1", "llm")
    res = p["spec"]["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == "2" and res["limits"]["nvidia.com/gpu"] == "2"


def test_pod_env_follows_the_contract() -> None:
    p = pod(JOB, spec(), PodPlan(attempt=3, index=1, node="gpu-7", data=2, resume_step=400))
    env = env_of(p)
    contract = TrainerEnv.from_env({k: v for k, v in env.items() if isinstance(v, str)})
    assert contract.master_addr == "llm-3-0.llm.team.svc"
    assert (contract.nnodes, contract.node_rank, contract.world_size) == (4, 1, 8)
    assert (contract.attempt, contract.resume_step) == (3, 400)
    assert contract.checkpoint_uri == "s3://ckpt/runs/team/llm"
    assert env["AWS_ENDPOINT_URL_S3"] == "http://s3:9000" and env["LOG"] == "1"
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "creds", "key": "AWS_ACCESS_KEY_ID"}}
    assert p["spec"]["containers"][0]["command"] == ["python", "-m", "topotrain_trainer"]


@pytest.mark.parametrize(("resume", "value"), [(None, ""), (0, "0"), (1200, "1200")])
def test_resume_step(resume: int | None, value: str) -> None:
    env = env_of(pod(JOB, spec(), PodPlan(attempt=0, index=0, node="n", data=2, resume_step=resume)))
    assert env["TOPOTRAIN_RESUME_STEP"] == value


def test_operator_endpoint_is_the_fallback() -> None:
    s = spec(checkpoint={"uri": "s3://ckpt/runs"})
    env = env_of(pod(JOB, s, PodPlan(0, 0, "n", 2, None, s3_endpoint="http://default:9000")))
    assert env["AWS_ENDPOINT_URL_S3"] == "http://default:9000" and "AWS_ACCESS_KEY_ID" not in env


def test_headless_service() -> None:
    svc = service(JOB, 29500)
    assert svc["metadata"]["name"] == "llm" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"topotrain.io/job": "llm"}
    assert svc["spec"]["publishNotReadyAddresses"] is True


def test_rank_table_round_trip_and_order() -> None:
    nodes = {0: "a", 1: "a2", 2: "b", 3: "b2"}
    cm = rank_table(JOB, spec(), 2, 2, "H100", nodes)
    assert parse_rank_table(cm["data"]) == (2, 2, nodes)
    rows = rank_rows(spec(), 2, nodes)
    # tp-pp-dp: r = (dp*PP + pp)*TP + tp; pod = r // gpusPerPod
    assert [(r["tp"], r["pp"], r["dp"], r["pod"]) for r in rows[:4]] == [
        (0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 1), (1, 1, 0, 1)]
    assert rows[7]["node"] == "b2"
    assert parse_rank_table({"attempt": "x"}) is None


def test_pods_meet_the_restricted_pod_security_standard_by_default() -> None:
    p = pod(JOB, spec(), PodPlan(0, 0, "n", 2, None))
    container = p["spec"]["containers"][0]
    assert p["spec"]["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert p["spec"]["automountServiceAccountToken"] is False
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # downwardAPI is one of the volume types the restricted standard allows
    assert p["spec"]["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "topotrain-control", "downwardAPI": {"items": [
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}},
    ]
    assert container["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "topotrain-control", "mountPath": "/etc/topotrain", "readOnly": True},
    ]


def test_pods_carry_their_attempt_and_rank_zero_address_for_the_supervisor() -> None:
    p = pod(JOB, spec(), PodPlan(3, 1, "n", 2, 8))
    notes = p["metadata"]["annotations"]
    assert notes["topotrain.io/attempt"] == "3" and notes["topotrain.io/resume-step"] == "8"
    assert notes["topotrain.io/master-addr"] == f"{JOB.name}-3-0.{JOB.name}.{JOB.namespace}.svc"
    kept_zero = f"{JOB.name}-1-0.{JOB.name}.{JOB.namespace}.svc"
    moved = pod(JOB, spec(), PodPlan(3, 1, "n", 2, 8, master_addr=kept_zero))
    env = {e["name"]: e.get("value") for e in moved["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == kept_zero == moved["metadata"]["annotations"]["topotrain.io/master-addr"]
    patch = restart_in_place_patch(4, None, kept_zero)
    assert patch == {"metadata": {"labels": {"topotrain.io/attempt": "4"}, "annotations": {
        "topotrain.io/attempt": "4", "topotrain.io/master-addr": kept_zero,
        "topotrain.io/resume-step": ""}}}


def test_an_image_that_needs_root_opts_out_per_job() -> None:
    worker = {"gpusPerPod": 2, "podSecurity": "Unrestricted", "automountServiceAccountToken": True,
              "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}, "shmSize": "16Gi"}
    p = pod(JOB, spec(worker=worker), PodPlan(0, 0, "n", 2, None))
    assert "securityContext" not in p["spec"], "the image's own user (root) applies"
    assert p["spec"]["containers"][0]["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert p["spec"]["automountServiceAccountToken"] is True
    assert p["spec"]["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    bare = pod(JOB, spec(worker={"gpusPerPod": 2, "podSecurity": "Unrestricted"}), PodPlan(0, 0, "n", 2, None))
    assert "securityContext" not in bare["spec"]["containers"][0]


def test_another_uid_for_a_restricted_image() -> None:
    p = pod(JOB, spec(worker={"gpusPerPod": 2, "runAsUser": 1000}), PodPlan(0, 0, "n", 2, None))
    assert (p["spec"]["securityContext"]["runAsUser"], p["spec"]["securityContext"]["runAsGroup"]) == (1000, 1000)


def test_a_security_context_under_restricted_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"spec\.worker\.securityContext requires spec\.worker\.podSecurity"):
        spec(worker={"gpusPerPod": 2, "securityContext": {"privileged": True}})


@pytest.mark.parametrize("gpus_per_pod", [8, 1])
def test_the_rank_table_of_a_65536_rank_gang_fits_a_configmap(gpus_per_pod: int) -> None:
    big = spec(parallelism={"tensor": 8, "pipeline": 8, "data": 1024},
               worker={"gpusPerPod": gpus_per_pod})  # fmt: skip
    pods = 65536 // gpus_per_pod
    nodes = {i: f"team-a-gpu-block{i // 4096}-rack{i // 256:03d}-node{i // 8:05d}" for i in range(pods)}
    cm = rank_table(JOB, big, 4, 1024, "H100-80GB", nodes)
    assert len(json.dumps(cm).encode()) < 1024 * 1024, "the API server refuses a ConfigMap over 1 MiB"
    assert parse_rank_table({**cm["data"], **cm.get("binaryData", {})}) == (4, 1024, nodes)
    assert "ranks.tsv" not in cm["data"] and "pod r // gpusPerPod" in cm["data"]["ranksOmitted"]
    assert rank_table(JOB, big, 4, 1024, "H100-80GB", nodes) == cm, "the same table every pass"


def test_a_small_gang_keeps_its_readable_rank_table() -> None:
    cm = rank_table(JOB, spec(), 0, 2, "H100", {0: "a", 1: "a", 2: "b", 3: "b"})
    assert "binaryData" not in cm and "ranksOmitted" not in cm["data"]
    assert cm["data"]["ranks.tsv"].splitlines()[0] == "rank\tpod\tlocal\ttp\tpp\tdp\tnode"
    assert len(cm["data"]["ranks.tsv"].splitlines()) == 9


def test_the_network_policy_lets_only_the_gang_in() -> None:
    policy = network_policy(JOB)
    assert (policy["kind"], policy["metadata"]["name"], policy["metadata"]["namespace"]) == (
        "NetworkPolicy", "llm", "team")
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    gang = {"matchLabels": {"topotrain.io/job": "llm"}}
    p = pod(JOB, spec(), PodPlan(0, 0, "n", 2, None))
    assert p["metadata"]["labels"].items() >= gang["matchLabels"].items(), "the policy selects the pods"
    assert policy["spec"]["podSelector"] == gang
    assert policy["spec"]["policyTypes"] == ["Ingress"], "egress stays open (S3, DNS)"
    # one rule, from the gang's pods, with no port list: every port, for them alone
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": gang}]}]


def test_the_trainers_metrics_port_is_declared_and_open_to_any_scraper() -> None:
    s = spec()
    assert s.metrics_port == 9400  # the bundled trainer's default
    ports = pod(JOB, s, PodPlan(0, 0, "n", 2, None))["spec"]["containers"][0]["ports"]
    assert {"name": "metrics", "containerPort": 9400} in ports
    gang = {"matchLabels": {"topotrain.io/job": "llm"}}
    assert network_policy(JOB, s.metrics_port)["spec"]["ingress"] == [
        {"from": [{"podSelector": gang}]},
        {"ports": [{"protocol": "TCP", "port": 9400}]},  # no `from`: Prometheus, wherever it runs
    ]
    off = spec(training={"metricsPort": 0})
    assert off.metrics_port is None
    ports = pod(JOB, off, PodPlan(0, 0, "n", 2, None))["spec"]["containers"][0]["ports"]
    assert [p["name"] for p in ports] == ["rendezvous"]


PASS_THROUGH = {
    "gpusPerPod": 2,
    "volumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
                {"name": "hf-cache", "emptyDir": {"sizeLimit": "100Gi"}}],
    "volumeMounts": [{"name": "datasets", "mountPath": "/datasets", "readOnly": True},
                     {"name": "hf-cache", "mountPath": "/cache/huggingface", "subPath": "hub"}],
    "imagePullSecrets": ["registry", "mirror"],
    "labels": {"team": "llm", "example.com/cost-centre": "research"},
    "annotations": {"example.com/owner": "ml-platform"},
}


def test_volumes_pull_secrets_and_pod_metadata_pass_through_after_the_operators_own() -> None:
    p = pod(JOB, spec(worker=PASS_THROUGH), PodPlan(3, 1, "gpu-7", 2, None))
    assert [v["name"] for v in p["spec"]["volumes"]] == ["dshm", "topotrain-control", "datasets", "hf-cache"]
    assert p["spec"]["volumes"][2:] == PASS_THROUGH["volumes"], "kept whole, undeclared keys included"
    mounts = p["spec"]["containers"][0]["volumeMounts"]
    assert [m["mountPath"] for m in mounts[:2]] == ["/dev/shm", "/etc/topotrain"]
    assert mounts[2:] == PASS_THROUGH["volumeMounts"]
    assert p["spec"]["imagePullSecrets"] == [{"name": "registry"}, {"name": "mirror"}]
    labels, notes = p["metadata"]["labels"], p["metadata"]["annotations"]
    assert labels["team"] == "llm" and labels["example.com/cost-centre"] == "research"
    assert (labels["topotrain.io/job"], labels["topotrain.io/attempt"], labels["topotrain.io/index"]) == (
        "llm", "3", "1")
    assert notes["example.com/owner"] == "ml-platform" and notes["topotrain.io/node"] == "gpu-7"
    bare = pod(JOB, spec(), PodPlan(3, 1, "gpu-7", 2, None))
    assert "imagePullSecrets" not in bare["spec"] and len(bare["spec"]["volumes"]) == 2


def test_a_spec_cannot_set_the_pod_labels_and_annotations_the_operator_sets() -> None:
    p = pod(JOB, spec(worker=PASS_THROUGH), PodPlan(3, 1, "gpu-7", 2, 40))
    own_labels = p["metadata"]["labels"].keys() - PASS_THROUGH["labels"].keys()
    own_notes = p["metadata"]["annotations"].keys() - PASS_THROUGH["annotations"].keys()
    assert own_labels and all(operator_label(key) for key in own_labels)
    assert own_notes and all(operator_annotation(key) for key in own_notes)
    assert all(operator_annotation(key) for key in restart_in_place_patch(4, None, "a")["metadata"]["annotations"])


def test_extended_resources_reach_the_container_beside_the_gpus() -> None:
    rdma = {"rdma/rdma_shared_device_a": 1}
    worker = {"gpusPerPod": 2, "resources": {"requests": {"cpu": "16", **rdma}, "limits": rdma}}
    res = pod(JOB, spec(worker=worker), PodPlan(0, 0, "n", 2, None))["spec"]["containers"][0]["resources"]
    assert res == {
        "requests": {"cpu": "16", "rdma/rdma_shared_device_a": 1, "nvidia.com/gpu": "2"},
        "limits": {"rdma/rdma_shared_device_a": 1, "nvidia.com/gpu": "2"},
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("volumes", [{"name": "datasets", "persistentVolumeClaim": {"claimName": "other"}},
                     PASS_THROUGH["volumes"][1]]),
        ("volumeMounts", [{"name": "datasets", "mountPath": "/datasets"}]),
        ("imagePullSecrets", ["registry"]),
        ("labels", {"team": "vision"}),
        ("annotations", {"example.com/owner": "someone-else"}),
        ("shmSize", "32Gi"),
    ],
)
def test_editing_a_pass_through_field_rolls_the_gang(field: str, value: Any) -> None:
    before = spec(worker=PASS_THROUGH)
    after = spec(worker={**PASS_THROUGH, field: value})
    assert template_hash(after) != template_hash(before)
    assert template_hash(spec(worker=dict(PASS_THROUGH))) == template_hash(before)


def test_a_job_without_pass_through_fields_keeps_its_template_hash_across_an_upgrade() -> None:
    """Absent, not [] or {}: the pods of a job stored before these fields existed still match."""
    worker = spec().to_wire()["worker"]
    assert not {"volumes", "volumeMounts", "imagePullSecrets", "labels", "annotations"} & worker.keys()
    # The hash the operator before these fields gave this spec: a new value here would roll
    # every running gang when the operator is upgraded.
    assert template_hash(spec()) == "17b993a29409e83a"
