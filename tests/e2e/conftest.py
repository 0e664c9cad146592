"""Fixtures of the end-to-end suite.

`harness` runs the pods of the test's namespace that sit on KWOK nodes as
local processes (testbed.harness: a stand-in for a kubelet's process
execution, not a kubelet). Every test in this folder is marked `e2e`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.harness import PodProcessHarness
from testbed.kube import Kube


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def harness(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[PodProcessHarness]:
    """The pod process harness for this test's namespace (processes killed at teardown)."""
    logging.getLogger("topotrain.testbed.harness").setLevel(logging.INFO)
    with PodProcessHarness(kube.kubeconfig, tmp_path / "harness", namespace=namespace) as running:
        yield running
