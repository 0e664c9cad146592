"""Node accounting of the failure policy: which nodes a job's failures are charged to, and
which nodes its re-plans avoid.

A failure is attributed to the node(s) it happened on when it is localized (one node's pods
failed, the node was lost, pods stuck there); after `nodeFailureThreshold` failures that node
is avoided by the job's re-plans and listed in `status.nodeFailures` (at most MAX_NODE_ROWS
rows). The failure that gets a node avoided is charged to the infrastructure budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from topotrain.api.spec import FailurePolicy
from topotrain.api.status import NodeFailures
from topotrain.core.policy import INFRASTRUCTURE, Failure


def record_node_failures(
    table: list[NodeFailures], failure: Failure, policy: FailurePolicy, when: str,
) -> list[NodeFailures]:
    """The job's node failure table after `failure`; nodes at the threshold become avoided."""
    rows = {row.node: row.model_copy() for row in table}
    for node in sorted(failure.blamed):
        row = rows.setdefault(node, NodeFailures(node=node))
        row.failures += 1
        row.last_reason, row.last_time = failure.reason, when
        threshold = policy.node_failure_threshold
        row.avoided = threshold > 0 and row.failures >= threshold
    worst = sorted(rows.values(), key=lambda r: (-r.failures, r.node))
    return sorted(worst[:MAX_NODE_ROWS], key=lambda r: r.node)


MAX_NODE_ROWS = 64  # status stays small: the nodes with the most failures


def charged_to_node(
    failure: Failure, table: list[NodeFailures], policy: FailurePolicy,
) -> Failure:
    """`failure`, charged to the infrastructure budget when it gets a node avoided.

    A node whose pods always crash reaches nodeFailureThreshold on application failures; the
    failure that crosses it shows the node is at fault, not the trainer, so it is the node's:
    the job moves off the node on the infrastructure budget instead of failing with
    MaxRestartsExceeded while a spare node is free.
    """
    if failure.kind == INFRASTRUCTURE or not failure.blamed:
        return failure
    newly = avoided_nodes(record_node_failures(table, failure, policy, "")) - avoided_nodes(table)
    if not newly:
        return failure
    nodes = ", ".join(sorted(newly))
    return replace(failure, node_fault=True, message=(
        f"{failure.message}; node {nodes} failed this job {policy.node_failure_threshold} times "
        "(spec.failurePolicy.nodeFailureThreshold): the node's failure, charged to the "
        "infrastructure budget"))


def avoided_nodes(table: Iterable[NodeFailures]) -> frozenset[str]:
    return frozenset(row.node for row in table if row.avoided)
