"""The chaos soak's stand-in trainer speaks the trainer's exit codes: a peer that loses rank 0,
however the loss shows (a closed or a reset connection), exits EXIT_PEER_LOST so its pod stays
up for a restart in place, as the real trainer's ranks do."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from testbed.standin import EXIT_PEER_LOST, run_peer


@pytest.mark.parametrize("reset", [False, True])
def test_a_peer_losing_rank_0_exits_peer_lost(reset: bool) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def rank0() -> None:
        conn, _ = server.accept()
        conn.sendall(b"1\n")
        conn.recv(64)  # the peer acknowledged step 1
        if reset:  # close with RST: the peer's next read raises ConnectionResetError
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
        server.close()

    thread = threading.Thread(target=rank0)
    thread.start()
    assert run_peer("127.0.0.1", server.getsockname()[1], rank=1) == EXIT_PEER_LOST
    thread.join()
