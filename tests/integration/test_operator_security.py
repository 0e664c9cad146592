"""Security defaults on the testbed: restricted pod security and the per-job NetworkPolicy.

The real API server's PodSecurity admission judges the operator's pods; KWOK
nodes run them (no processes). A bare pod is refused in the same namespace, so
the test would notice an API server that does not enforce the label. The
testbed has no network plugin, so the NetworkPolicy is checked as an object
(selector, owner, garbage collection), not as enforced traffic.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from operator_support import Cluster, cluster_fixture, wait_for

from testbed.kube import Kube

pytestmark = pytest.mark.integration
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}


@pytest.fixture
def cluster(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    kube.core.patch_namespace(namespace, {"metadata": {"labels": RESTRICTED}})
    yield from cluster_fixture(kube, namespace, tmp_path)


def test_a_restricted_namespace_admits_the_gang(cluster: Cluster) -> None:
    with pytest.raises(ApiException) as refused:
        cluster.kube.core.create_namespaced_pod(cluster.namespace, {
            "metadata": {"name": "bare"},
            "spec": {"containers": [{"name": "c", "image": "example.invalid/c:1"}]},
        })
    assert refused.value.status == 403 and "restricted" in str(refused.value.body)

    cluster.add_nodes(racks=1, per_rack=2)
    cluster.apply(cluster.manifest("llm", pipeline=1))
    pods = wait_for("the gang Running", lambda: cluster.running_gang("llm", 0, 2))
    for pod in pods:
        assert pod.spec.security_context.run_as_non_root is True
        assert pod.spec.security_context.run_as_user == 10001
        assert pod.spec.automount_service_account_token is False
        mounts = {m.mount_path for m in pod.spec.containers[0].volume_mounts}
        assert "/dev/shm" in mounts
        assert not any("serviceaccount" in m for m in mounts), "an API token was mounted"
    cluster.wait_phase("llm", "Running")


@pytest.fixture
def guarded(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Cluster]:
    """The operator with per-job NetworkPolicies on, as the chart installs it."""
    yield from cluster_fixture(kube, namespace, tmp_path, TOPOTRAIN_NETWORK_POLICY="true")


def test_each_job_gets_a_network_policy_that_admits_only_its_gang(guarded: Cluster) -> None:
    guarded.add_nodes(racks=1, per_rack=2)
    guarded.apply(guarded.manifest("llm", pipeline=1))
    guarded.wait_phase("llm", "Running")
    networking = client.NetworkingV1Api(guarded.kube.api)
    policy = networking.read_namespaced_network_policy("llm", guarded.namespace)
    gang = {"topotrain.io/job": "llm"}
    assert policy.spec.pod_selector.match_labels == gang
    assert policy.spec.policy_types == ["Ingress"]
    rule, metrics = policy.spec.ingress
    assert [peer.pod_selector.match_labels for peer in rule._from] == [gang] and not rule.ports
    # the trainer's metrics port (the bundled trainer's default) from any source, and nothing else
    assert not metrics._from and [(p.protocol, p.port) for p in metrics.ports] == [("TCP", 9400)]
    owner = policy.metadata.owner_references[0]
    assert (owner.kind, owner.uid) == ("TrainingJob", guarded.job("llm")["metadata"]["uid"])

    guarded.delete_job("llm")
    wait_for("the policy garbage-collected with its job", lambda: not networking.list_namespaced_network_policy(
        guarded.namespace).items)
