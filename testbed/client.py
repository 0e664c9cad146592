"""The Kubernetes client edge of the testbed: one place that builds clients.

It imports nothing of the testbed, so every module of it (and the tests, the benchmarks)
can build a client without an import circle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client, config


def api_client(kubeconfig: Path | str) -> client.ApiClient:
    """A kubernetes ApiClient for `kubeconfig` (use it as a context manager)."""
    configuration = client.Configuration()
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), client_configuration=configuration
    )
    # Room for the thread pools that create a fleet's nodes in parallel.
    configuration.connection_pool_maxsize = 16
    return client.ApiClient(configuration)


def core_v1(api: client.ApiClient) -> Any:
    """CoreV1Api, typed loosely: the testbed sends plain-dict manifests and patches."""
    return client.CoreV1Api(api)
