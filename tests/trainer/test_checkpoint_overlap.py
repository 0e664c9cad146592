"""The async checkpoint's state copy overlaps the next step, yet the checkpoint
holds exactly the state of the step it was taken at.

One trainer rank in this process (gloo, world size 1) and the testbed's real S3
server. The only stand-in is `GatedStager`, a test double at DCP's staging
boundary: the real stager, but its copy starts only once the next step's
forward and backward are done, so the optimizer update would come before the
copy unless the training loop waits for it as it must. The test asserts the
order of events, never a duration: a loaded machine cannot change the verdict.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
from topotrain.checkpoints import CheckpointStore
from topotrain_trainer.checkpoint import (
    AppState,
    Checkpointer,
    Progress,
    make_stager,
    staging_options,
)
from topotrain_trainer.config import TrainingConfig
from topotrain_trainer.model import model_config
from topotrain_trainer.parallel import build_mesh, build_stage, cross_entropy
from topotrain_trainer.train import make_optimizer
from torch.distributed.checkpoint.staging import DefaultStager

if TYPE_CHECKING:
    from testbed.s3 import S3Server

pytestmark = [pytest.mark.trainer]

GATE_TIMEOUT = 120.0  # seconds; only fails a copy that was never released, never a timing check


class GatedStager(DefaultStager):
    """Test double: DCP's own stager whose copy waits for `release()` and logs its end."""

    def __init__(self, order: list[str]) -> None:
        super().__init__(staging_options())
        self.order = order
        self._gate = threading.Event()

    def release(self) -> None:
        self._gate.set()

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        if not self._gate.wait(GATE_TIMEOUT):
            raise TimeoutError("the copy was never released: did save() wait for it?")
        copied = super()._stage(state_dict, **kwargs)
        self.order.append("copy finished")
        return copied


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Rank:
    def __init__(self, seed: int) -> None:
        mesh = build_mesh(torch.device("cpu"), 1, 1, 1, "tp-pp-dp")
        self.model = build_stage(model_config("tiny"), mesh, seed=seed, bf16=False,
                                 activation_checkpointing=False)  # fmt: skip
        self.optimizer, self.scheduler = make_optimizer(self.model, TrainingConfig(model="tiny"))
        self.progress = Progress()
        self.app = AppState(self.model, self.optimizer, self.scheduler, self.progress)

    def step(
        self,
        checkpointer: Checkpointer,
        *,
        computed: Callable[[], None] = lambda: None,
        order: list[str] | None = None,
    ) -> None:
        """One step as Job.train_step orders it: compute, wait for the copy, update."""
        tokens = torch.randint(0, 256, (2, 17))
        torch.autograd.backward(cross_entropy(self.model(tokens[:, :-1]), tokens[:, 1:]))
        computed()
        checkpointer.staged()
        if order is not None:
            order.append("update")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Parameters and AdamW moments, copied."""
        state = {f"param.{n}": p.detach().clone() for n, p in self.model.named_parameters()}
        for n, p in self.model.named_parameters():
            for key, value in self.optimizer.state[p].items():
                if isinstance(value, torch.Tensor):
                    state[f"optim.{n}.{key}"] = value.clone()
        return state


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    differing = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not differing, f"differ from the saved step: {differing[:5]}"


def test_async_copy_overlaps_the_next_step_and_saves_the_state_it_was_taken_at(
    one_rank: None, s3: S3Server, tmp_path: Path
) -> None:
    bucket = s3.create_bucket(f"overlap-{uuid.uuid4().hex[:8]}")
    store = CheckpointStore(f"s3://{bucket}/ns/job", client=s3.client())
    events: list[dict[str, Any]] = []
    order: list[str] = []
    stager = GatedStager(order)
    checkpointer = Checkpointer(store, tmp_path / "staging", {"tensor": 1, "pipeline": 1, "data": 1},
                                keep=3, on_event=events.append, stager=stager)  # fmt: skip
    torch.manual_seed(0)
    trained = Rank(seed=0)
    trained.step(checkpointer)
    trained.step(checkpointer)
    at_save = trained.snapshot()

    checkpointer.save(2, trained.app)  # returns with the copy not yet begun: it ran in the background
    assert order == [] and not [e for e in events if e["event"] == "checkpoint_saved"]
    # Step 3 computes while the copy is held back, then lets it go: its update must wait for it.
    trained.step(checkpointer, computed=stager.release, order=order)
    assert order == ["copy finished", "update"], "the optimizer update did not wait for the copy"
    saved = next(e for e in events if e["event"] == "checkpoint_saved")
    checkpointer.close()

    assert saved["step"] == 2 and saved["mode"] == "async"
    # The copy spans step 3's compute, the stall does not: that difference is the overlap.
    assert saved["copy_seconds"] > saved["stall_seconds"]
    committed = next(e for e in events if e["event"] == "checkpoint_committed")
    assert committed["step"] == 2
    commit = store.read_commit(2)  # the save wrote into a directory of its own, which COMMITTED names
    assert commit is not None and commit.shards.startswith("attempt-0-")
    assert all(n == "COMMITTED" or n.startswith(commit.shards + "/") for n in store.step_objects(2))
    after = trained.snapshot()
    assert any(not torch.equal(after[k], at_save[k]) for k in at_save), "step 3 changed nothing"

    restored = Rank(seed=1)  # different initial weights
    reader = Checkpointer(store, tmp_path / "restore", {"tensor": 1, "pipeline": 1, "data": 1}, keep=3)
    reader.restore(2, restored.app)
    reader.close()
    assert restored.progress.step == 2
    assert_same(restored.snapshot(), at_save)


def test_a_checkpointer_reuses_its_staging_buffers(one_rank: None, s3: S3Server, tmp_path: Path) -> None:
    """The second save copies into the first one's CPU buffers: no allocation per save."""
    bucket = s3.create_bucket(f"reuse-{uuid.uuid4().hex[:8]}")
    store = CheckpointStore(f"s3://{bucket}/ns/job", client=s3.client())
    stager = make_stager()
    checkpointer = Checkpointer(store, tmp_path / "staging", {"tensor": 1, "pipeline": 1, "data": 1},
                                keep=3, stager=stager)  # fmt: skip
    rank = Rank(seed=0)
    rank.step(checkpointer)
    staged_buffers: list[set[int]] = []
    for step in (1, 2):
        checkpointer.save(step, rank.app)
        checkpointer.wait()
        cache = stager._state_dict_stager._cached_storage_mapping  # DCP's buffer cache
        staged_buffers.append({s.data_ptr() for s in cache.values()})
        rank.step(checkpointer)
    checkpointer.close()
    assert staged_buffers[0] and staged_buffers[0] == staged_buffers[1]
    assert [c.step for c in store.list_committed()] == [1, 2]
