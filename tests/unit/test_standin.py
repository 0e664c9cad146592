"""The chaos soak's stand-in trainer speaks the trainer's exit codes: a peer that loses rank 0,
however the loss shows (a closed or a reset connection), exits EXIT_PEER_LOST so its pod stays
up for a restart in place, as the real trainer's ranks do."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path
from types import SimpleNamespace

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


def test_rank0_serves_a_checkpoint_request_once_and_remembers_it_across_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in serves the operator's checkpoint request like the trainer: a save of the
    step it reached, whose COMMITTED and heartbeat name the request; never twice, not even by
    the attempt that resumed from that save (so the soak's resizes go checkpoint-first)."""
    import topotrain.checkpoints as checkpoints
    from topotrain.checkpoints import CheckpointStore, ServedRequest

    from testbed.standin import run_rank0
    from tests.unit.test_checkpoints import FakeS3Client

    client = FakeS3Client()
    monkeypatch.setattr(checkpoints, "CheckpointStore",
                        lambda uri: CheckpointStore(uri, client=client))  # type: ignore[arg-type]
    (tmp_path / "annotations").write_text('topotrain.io/checkpoint-request="resize-0-x"\n')
    monkeypatch.setenv("TOPOTRAIN_CONTROL_DIR", str(tmp_path))
    env = SimpleNamespace(checkpoint_uri="s3://ckpt/ns/job", resume_step=None, attempt=0, data=1,
                          nnodes=1, master_port=0, checkpoint_interval=0, checkpoint_keep=3)
    config = {"steps": 4, "stepSeconds": 0, "seed": 7}
    assert run_rank0(env, config) == 0
    store = CheckpointStore("s3://ckpt/ns/job", client=client)  # type: ignore[arg-type]
    assert store.step_dirs() == [1]  # served at the first step boundary, once
    commit, progress = store.read_commit(1), store.read_progress()
    assert commit is not None and commit.request == "resize-0-x"
    assert commit.attempt == 0  # recorded, as the trainer does: the roll floor needs it
    assert progress is not None and progress.checkpoint_request == ServedRequest("resize-0-x", 1)
    # The next attempt resumes from the served step with the annotation still there: no new save.
    assert run_rank0(SimpleNamespace(**{**vars(env), "resume_step": 1, "attempt": 1}), config) == 0
    assert store.step_dirs() == [1]
    progress = store.read_progress()
    assert progress is not None and progress.step == 4 and progress.checkpoint_request == ServedRequest("resize-0-x", 1)
