"""Simulated GPU nodes on a running API server: create them from a topology,
add or delete single nodes, and wait until KWOK reports them Ready."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes.client import ApiException

from testbed.client import api_client, core_v1
from testbed.topology import (
    PRELOAD_NAMESPACE,
    TOPOLOGY_LABEL,
    NodePlan,
    Pool,
    node_manifest,
    parse_topology,
    plan_nodes,
    preload_pod_manifest,
)

CREATE_PARALLELISM = 8


def _create_ignoring_conflict(create: Any, *args: Any) -> None:
    try:
        create(*args)
    except ApiException as err:
        if err.status != 409:
            raise


def apply_topology(kubeconfig: Path | str, source: Path | str | Mapping[str, Any]) -> list[str]:
    """Create the topology's nodes and preload pods (existing ones are kept); returns node names."""
    topology = parse_topology(source)
    plans = list(plan_nodes(topology))
    with api_client(kubeconfig) as api:
        core = core_v1(api)
        with ThreadPoolExecutor(CREATE_PARALLELISM) as pool:
            list(
                pool.map(
                    lambda p: _create_ignoring_conflict(
                        core.create_node, node_manifest(p, topology.name)
                    ),
                    plans,
                )
            )
        preloaded = [p for p in plans if p.preload_gpus]
        if preloaded:
            _ensure_namespace(core, PRELOAD_NAMESPACE)
            for plan in preloaded:
                _create_ignoring_conflict(
                    core.create_namespaced_pod,
                    PRELOAD_NAMESPACE,
                    preload_pod_manifest(plan, topology.name),
                )
    return [p.name for p in plans]


def _ensure_namespace(core: Any, name: str) -> None:
    _create_ignoring_conflict(core.create_namespace, {"metadata": {"name": name}})


def add_node(
    kubeconfig: Path | str,
    name: str,
    *,
    product: str = "H100-80GB",
    gpus: int = 8,
    block: str = "extra-b0",
    rack: str = "extra-b0-r0",
    clique: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> str:
    """Create one simulated GPU node (KWOK makes it Ready); returns its name."""
    pool = Pool(name="extra", product=product, gpus_per_node=gpus)
    manifest = node_manifest(NodePlan(name, pool, block, rack, clique, index=0), "extra")
    manifest["metadata"]["labels"].update(labels or {})
    with api_client(kubeconfig) as api:
        core_v1(api).create_node(manifest)
    return name


def delete_node(kubeconfig: Path | str, name: str) -> bool:
    """Delete a node object (as when a machine leaves the cluster); False if it was absent."""
    with api_client(kubeconfig) as api:
        try:
            core_v1(api).delete_node(name)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
    return True


def delete_topology(kubeconfig: Path | str, topology_name: str) -> int:
    """Delete every node created from the named topology and its preload pods; returns the node count."""
    selector = f"{TOPOLOGY_LABEL}={topology_name}"
    with api_client(kubeconfig) as api:
        core = core_v1(api)
        core.delete_collection_namespaced_pod(PRELOAD_NAMESPACE, label_selector=selector)
        names = [n.metadata.name for n in core.list_node(label_selector=selector).items]
        for name in names:
            core.delete_node(name)
    return len(names)


def ready_node_names(kubeconfig: Path | str, label_selector: str = "") -> set[str]:
    """Names of nodes whose Ready condition is True."""
    with api_client(kubeconfig) as api:
        response = core_v1(api).list_node(label_selector=label_selector, _preload_content=False)
        items = json.loads(response.data)["items"]
    return {
        item["metadata"]["name"]
        for item in items
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in item.get("status", {}).get("conditions") or []
        )
    }


def wait_nodes_ready(kubeconfig: Path | str, names: Iterable[str], timeout: float = 120.0) -> None:
    """Block until every named node is Ready; TimeoutError lists the missing ones."""
    wanted = set(names)
    deadline = time.monotonic() + timeout
    while True:
        missing = wanted - ready_node_names(kubeconfig)
        if not missing:
            return
        if time.monotonic() > deadline:
            sample = ", ".join(sorted(missing)[:5])
            raise TimeoutError(f"{len(missing)} node(s) not Ready after {timeout:.0f}s: {sample}")
        time.sleep(0.5)
