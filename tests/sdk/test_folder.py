"""The folder adapter against the real S3 server (versitygw): a trainer that writes DCP to a
local folder itself gets a committed checkpoint, and downloads it back before its own load.
One process (a gloo group of one), real torch.distributed.checkpoint."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from testbed.s3 import S3Server

torch = pytest.importorskip("torch")


@pytest.fixture
def sigterm_kept() -> Iterator[None]:
    """The session installs its SIGTERM handler; pytest's comes back afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.s3
def test_a_local_dcp_folder_is_uploaded_committed_and_downloaded(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigterm_kept: None
) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from topotrain_sdk.folder import download_folder, upload_folder
    from topotrain_sdk.job import job
    from topotrain_sdk.session import Session

    bucket = s3.create_bucket("folder-adapter")
    for key, value in (("AWS_ENDPOINT_URL_S3", s3.endpoint), ("AWS_ACCESS_KEY_ID", s3.access_key),
                       ("AWS_SECRET_ACCESS_KEY", s3.secret_key)):  # fmt: skip
        monkeypatch.setenv(key, value)
    session = Session(job({"TOPOTRAIN_JOB_NAME": "ft", "TOPOTRAIN_CHECKPOINT_KEEP": "1",
                           "TOPOTRAIN_CHECKPOINT_URI": f"s3://{bucket}/jobs/ns/ft"}),
                      staging=tmp_path / "staging")  # fmt: skip
    try:
        weights = {"w": torch.arange(12.0).reshape(3, 4)}
        for step in (5, 10):  # the trainer's own saves, each then uploaded and committed
            dcp.save({"w": weights["w"] * step}, checkpoint_id=str(tmp_path / f"own-{step}"))
            assert upload_folder(session, step, tmp_path / f"own-{step}")
        assert session.store is not None
        assert [c.step for c in session.store.list_committed()] == [10], "keep=1: retention ran"
        fetched = download_folder(session, 10, tmp_path / "fetched")
        loaded = {"w": torch.zeros(3, 4)}
        dcp.load(loaded, checkpoint_id=str(fetched))
        assert torch.equal(loaded["w"], weights["w"] * 10)
    finally:
        session.finish()
        if dist.is_initialized():
            dist.destroy_process_group()
