"""The testbed's port choice: below the kernel's ephemeral range, so no outgoing connection's
source port can take a component's port between choosing and binding it (etcd once failed
to start with "address already in use" on a busy machine)."""

from __future__ import annotations

import socket
from pathlib import Path

from testbed.procs import PORT_SPAN, ephemeral_range, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    low, _ = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert max(1024, low - PORT_SPAN) <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_ephemeral_range_falls_back_to_linux_default(tmp_path: Path) -> None:
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    custom = tmp_path / "range"
    custom.write_text("40000\t50000\n")
    assert ephemeral_range(str(custom)) == (40000, 50000)
