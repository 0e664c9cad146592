"""A cluster as tests see it: its kubeconfig, a client, kubectl and helm, and the testbed if it
is one. The clients themselves are built by testbed/client.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.binaries import bin_dir, wait_built

if TYPE_CHECKING:
    from testbed.cluster import Testbed


@dataclass
class Kube:
    """A cluster for tests: its kubeconfig, a client, and the testbed if it is one."""

    kubeconfig: Path
    api: Any  # kubernetes.client.ApiClient
    testbed: Testbed | None

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api)

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run kubectl (the testbed's build when present) against this cluster."""
        return _run_tool("kubectl", self.kubeconfig, args, check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run_tool("helm", self.kubeconfig, args, check)

    def delete_namespace(self, namespace: str) -> None:
        """Delete a test's namespace (without waiting), first taking the operator's finalizer off
        its TrainingJobs: a test stops its operator before its namespace goes, and a namespace
        holding finalized objects stays Terminating for the rest of the session while
        kube-controller-manager sweeps it, about 60 API requests a sweep, several sweeps a second
        once a suite has left thirty such namespaces behind (CI, 2026-12-07: a third of a core of
        the integration testbed's API server)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
        from topotrain import GROUP, PLURAL, VERSION

        custom = client.CustomObjectsApi(self.api)
        try:
            jobs = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
        except ApiException as err:
            if err.status != 404:  # 404: no TrainingJob CRD in this cluster
                raise
            jobs = []
        for job in jobs:
            if job["metadata"].get("finalizers"):
                with contextlib.suppress(ApiException):  # gone meanwhile
                    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                          job["metadata"]["name"],
                                                          {"metadata": {"finalizers": None}})  # fmt: skip
        self.core.delete_namespace(namespace)

    def require_testbed(self, why: str) -> Testbed:
        """The testbed, or skip: KWOK-simulated nodes and faults exist only there."""
        if self.testbed is None:
            import pytest

            pytest.skip(f"needs the local testbed ({why}); KUBECONFIG names another cluster")
        return self.testbed


def _run_tool(
    name: str, kubeconfig: Path, args: tuple[str, ...], check: bool
) -> subprocess.CompletedProcess[str]:
    wait_built(name)
    built = bin_dir() / name
    tool = str(built) if built.exists() else name
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run([tool, *args], env=env, capture_output=True, text=True, check=check)
