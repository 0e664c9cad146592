"""kopf's diff base is built for nothing (controller/kopf_diffbase.py): the operator registers no
change handler, so no handler can read the empty diffs; one registered later is named."""

from __future__ import annotations

from typing import Any

import kopf
from topotrain.controller import main
from topotrain.controller.kopf_diffbase import EmptyDiffBase, change_handlers


def test_the_operator_registers_no_change_handler_and_builds_no_essence() -> None:
    assert main.configure is not None  # the operator's handlers are registered by importing it
    registry = kopf.get_default_registry()
    assert registry._watching.get_all_handlers() and registry._spawning.get_all_handlers()
    assert change_handlers() == []
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"a": "b"}},
           "spec": {"containers": [{"name": "c"}]}}  # fmt: skip
    storage = EmptyDiffBase()
    assert storage.build(body=pod) == {} and storage.fetch(body=pod) == {}


def test_a_change_handler_registered_later_is_named_for_the_start_up_check() -> None:
    registry = kopf.OperatorRegistry()

    @kopf.on.update("pods", registry=registry, id="pod-updated")
    def updated(**_: Any) -> None:
        return None

    assert change_handlers(registry) == ["pod-updated"]
