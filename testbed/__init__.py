"""The topotrain testbed: a real Kubernetes control plane run as local
processes, KWOK-simulated GPU nodes from topology files, fault injection and
an S3-compatible server. Used by tests, benchmarks and the demo; product code
never imports it."""

from testbed.cluster import DEFAULT_BUCKET, Testbed, default_state_dir
from testbed.nodes import (
    add_node,
    apply_topology,
    delete_node,
    delete_topology,
    ready_node_names,
    wait_nodes_ready,
)
from testbed.s3 import S3Server

__all__ = [
    "DEFAULT_BUCKET",
    "S3Server",
    "Testbed",
    "add_node",
    "apply_topology",
    "default_state_dir",
    "delete_node",
    "delete_topology",
    "ready_node_names",
    "wait_nodes_ready",
]
