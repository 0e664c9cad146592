"""The trainer's rendezvous is scoped to the attempt (issue 37 item 9; docs/trainer.md).

Real local processes with real torch.distributed (gloo on CPU), each joining the job's process
group as the trainer does (`topotrain_trainer.parallel.init_distributed(TOPOTRAIN_ATTEMPT)`) and
summing its rank + 1 with an all_reduce. A lagging rank of an older attempt that reaches the
rendezvous of a newer one is refused with an error naming both attempts, and the newer
attempt's gang forms as if it had never come; a rank of a newer attempt that reaches its rank
0's old store (the old rank 0 still stopping) waits for the new one instead of joining.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from topotrain_trainer.config import EXIT_PEER_LOST

from .harness import REPO_ROOT, free_port

pytestmark = pytest.mark.trainer
RANK = """
import json, os, sys
import torch, torch.distributed as dist
from topotrain_trainer.parallel import StaleAttempt, init_distributed
try:
    init_distributed(int(os.environ["TOPOTRAIN_ATTEMPT"]))
except StaleAttempt as err:
    print(json.dumps({"refused": str(err)}), flush=True)
    sys.exit(76)
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(json.dumps({"rank": dist.get_rank(), "sum": total.item()}), flush=True)
dist.destroy_process_group()
"""


def rank(port: int, rank: int, attempt: int) -> subprocess.Popen[str]:
    path = os.pathsep.join([str(REPO_ROOT / "operator"), str(REPO_ROOT / "trainer_image"),
                            os.environ.get("PYTHONPATH", "")])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": str(rank), "WORLD_SIZE": "2", "TOPOTRAIN_ATTEMPT": str(attempt)}  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", RANK], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, dict[str, object]]:
    out, _ = proc.communicate(timeout=timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert lines, out[-2000:]
    return proc.returncode, lines[-1]


def test_a_lagging_rank_of_an_older_attempt_is_refused_and_the_new_gang_forms() -> None:
    port = free_port()
    leader = rank(port, 0, attempt=2)
    try:
        code, said = finish(rank(port, 1, attempt=1))  # attempt 1's rank 1, late
        assert code == EXIT_PEER_LOST, said
        assert "rank 1 of attempt 1" in str(said["refused"]) and "serves attempt 2" in str(said["refused"])
        follower = rank(port, 1, attempt=2)
        assert finish(follower) == (0, {"rank": 1, "sum": 3.0})
        assert finish(leader) == (0, {"rank": 0, "sum": 3.0})
    finally:
        leader.kill()


def test_a_rank_of_a_newer_attempt_waits_for_its_own_rank_0() -> None:
    port = free_port()
    old_leader = rank(port, 0, attempt=4)  # an in-place restart's old rank 0, not stopped yet
    follower = rank(port, 1, attempt=5)
    try:
        time.sleep(8)  # the follower found attempt 4's store and keeps looking
        assert follower.poll() is None, follower.communicate()[0][-2000:]
        old_leader.kill()
        old_leader.wait()
        leader = rank(port, 0, attempt=5)
        assert finish(follower) == (0, {"rank": 1, "sum": 3.0})
        assert finish(leader) == (0, {"rank": 0, "sum": 3.0})
    finally:
        old_leader.kill()
        follower.kill()
