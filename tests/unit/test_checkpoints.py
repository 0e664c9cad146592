"""The shared checkpoint layout: what the operator may restore, and what retention keeps.

Pure tests run against `FakeS3Client`, an in-memory stand-in for the few boto3
calls the store makes (a unit-test boundary, named as such). The same behaviour
is checked against the testbed's real S3 server (versitygw) when it is built.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from topotrain.checkpoints import (
    COMMITTED,
    CheckpointStore,
    ServedRequest,
    attempt_dir,
    job_prefix,
    split_uri,
    step_dir,
)


class FakeS3Client:
    """In-memory fake of boto3's S3 client: put/get/list_objects_v2/delete_objects/
    upload_file/download_file, with small pages so pagination is exercised."""

    page_size = 3

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}

    def put_object(self, Bucket: str, Key: str, Body: bytes, **_: Any) -> dict[str, Any]:
        self.objects[(Bucket, Key)] = Body
        return {}

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        if (Bucket, Key) not in self.objects:
            raise ClientError({"Error": {"Code": "NoSuchKey", "Message": Key}}, "GetObject")
        return {"Body": io.BytesIO(self.objects[(Bucket, Key)])}

    def list_objects_v2(
        self, Bucket: str, Prefix: str, Delimiter: str = "", ContinuationToken: str = "0"
    ) -> dict[str, Any]:
        entries: list[tuple[str, str]] = []  # (kind, name), kind "key" or "prefix"
        for bucket, key in sorted(self.objects):
            if bucket != Bucket or not key.startswith(Prefix):
                continue
            rest = key[len(Prefix) :]
            if Delimiter and Delimiter in rest:
                entry = ("prefix", Prefix + rest.split(Delimiter)[0] + Delimiter)
            else:
                entry = ("key", key)
            if entry not in entries:
                entries.append(entry)
        start = int(ContinuationToken)
        page = entries[start : start + self.page_size]
        result: dict[str, Any] = {
            "Contents": [
                {"Key": n, "Size": len(self.objects[(Bucket, n)])} for k, n in page if k == "key"
            ],
            "CommonPrefixes": [{"Prefix": n} for k, n in page if k == "prefix"],
            "IsTruncated": start + self.page_size < len(entries),
        }
        if result["IsTruncated"]:
            result["NextContinuationToken"] = str(start + self.page_size)
        return result

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:
        for obj in Delete["Objects"]:
            self.objects.pop((Bucket, obj["Key"]), None)
        return {}

    def upload_file(self, Filename: str, Bucket: str, Key: str) -> None:
        self.objects[(Bucket, Key)] = Path(Filename).read_bytes()

    def download_file(self, Bucket: str, Key: str, Filename: str) -> None:
        Path(Filename).write_bytes(self.objects[(Bucket, Key)])


def _real_s3_store(tmp_path: Path) -> Iterator[CheckpointStore]:
    try:
        from testbed.s3 import S3Server
    except ImportError:
        pytest.skip("testbed.s3 is not available")
    server = S3Server(tmp_path / "s3")
    try:
        server.start()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    try:
        server.create_bucket("ckpt")
        yield CheckpointStore("s3://ckpt/team/job", client=server.client())
    finally:
        server.stop()


@pytest.fixture(params=["fake", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    if request.param == "fake":
        yield CheckpointStore("s3://ckpt/team/job", client=FakeS3Client())  # type: ignore[arg-type]
    else:
        yield from _real_s3_store(tmp_path)


MESH = {"tensor": 2, "pipeline": 2, "data": 2}


def _write_shards(store: CheckpointStore, step: int, tmp_path: Path, count: int = 2) -> None:
    for i in range(count):
        shard = tmp_path / f"shard-{step}-{i}"
        shard.write_bytes(b"x" * (i + 1))
        store.upload_file(step, f"__{i}_0.distcp", shard)
    meta = tmp_path / f"meta-{step}"
    meta.write_bytes(b"{}")
    store.upload_file(step, ".metadata", meta)


@pytest.mark.parametrize(
    ("uri", "namespace", "name", "expected"),
    [
        ("s3://ckpt", "team", "llama", "s3://ckpt/team/llama"),
        ("s3://ckpt/", "team", "llama", "s3://ckpt/team/llama"),
        ("s3://ckpt/runs/2026", "ns", "j", "s3://ckpt/runs/2026/ns/j"),
    ],
)
def test_job_prefix(uri: str, namespace: str, name: str, expected: str) -> None:
    assert job_prefix(uri, namespace, name) == expected


@pytest.mark.parametrize(
    ("prefix", "step", "expected"),
    [
        ("s3://b/ns/j", 0, "s3://b/ns/j/step-0000000000"),
        ("s3://b/ns/j/", 42, "s3://b/ns/j/step-0000000042"),
    ],
)
def test_step_dir(prefix: str, step: int, expected: str) -> None:
    assert step_dir(prefix, step) == expected


@pytest.mark.parametrize("uri", ["ckpt/team", "http://x/y", "s3://", "s3:///key"])
def test_rejects_uris_that_are_not_s3(uri: str) -> None:
    with pytest.raises(ValueError, match=r"s3://|bucket"):
        split_uri(uri)


def test_partial_checkpoint_is_never_latest(store: CheckpointStore, tmp_path: Path) -> None:
    _write_shards(store, 100, tmp_path)
    store.write_commit(100, MESH, 3)
    _write_shards(store, 200, tmp_path)  # shards uploaded, COMMITTED not yet written

    latest = store.latest_committed()
    assert latest is not None
    assert latest.step == 100
    assert latest.uri == "s3://ckpt/team/job/step-0000000100"
    assert latest.mesh == MESH and latest.bytes == 3
    assert [c.step for c in store.list_committed()] == [100]
    assert store.step_dirs() == [100, 200]


def test_empty_store_has_no_checkpoint_or_progress(store: CheckpointStore) -> None:
    assert store.latest_committed() is None
    assert store.list_committed() == []
    assert store.read_progress() is None
    assert store.apply_retention(3) == []


def test_commit_round_trips_time_and_mesh(store: CheckpointStore, tmp_path: Path) -> None:
    when = datetime(2026, 11, 30, 8, 0, 5, tzinfo=UTC)
    _write_shards(store, 7, tmp_path)
    store.write_commit(7, MESH, 123, time=when)
    commit = store.read_commit(7)
    assert commit is not None
    assert (commit.step, commit.time, dict(commit.mesh), commit.bytes) == (7, when, MESH, 123)


def test_progress_heartbeat_round_trips(store: CheckpointStore) -> None:
    when = datetime(2026, 11, 30, 9, 30, tzinfo=UTC)
    store.write_progress(17, attempt=2, time=when)
    progress = store.read_progress()
    assert progress is not None
    assert (progress.step, progress.time, progress.attempt) == (17, when, 2)


def test_served_checkpoint_request_round_trips(store: CheckpointStore, tmp_path: Path) -> None:
    """The operator learns a request was honoured, and at which step, from both records."""
    _write_shards(store, 12, tmp_path)
    store.write_commit(12, MESH, 3, request="resize-4")
    store.write_progress(12, attempt=1, request=ServedRequest("resize-4", 12))
    commit, progress = store.read_commit(12), store.read_progress()
    assert commit is not None and commit.request == "resize-4"
    assert progress is not None and progress.checkpoint_request == ServedRequest("resize-4", 12)
    store.write_commit(13, MESH, 3)
    plain = store.read_commit(13)
    assert plain is not None and plain.request == ""


def test_retention_keeps_newest_commits_and_in_flight_uploads(
    store: CheckpointStore, tmp_path: Path
) -> None:
    for step in (10, 20, 30, 40):
        _write_shards(store, step, tmp_path)
        store.write_commit(step, MESH, 3)
    _write_shards(store, 25, tmp_path)  # a failed upload older than the newest commit
    _write_shards(store, 50, tmp_path)  # an upload still in flight

    deleted = store.apply_retention(keep=2)

    assert deleted == [10, 20, 25]
    assert [c.step for c in store.list_committed()] == [30, 40]
    assert store.step_dirs() == [30, 40, 50]
    assert store.latest_committed() is not None


def test_download_step_restores_every_shard(store: CheckpointStore, tmp_path: Path) -> None:
    _write_shards(store, 5, tmp_path, count=4)
    store.write_commit(5, MESH, 10)
    names = store.download_step(5, tmp_path / "restore")
    assert names == sorted([".metadata", COMMITTED, *(f"__{i}_0.distcp" for i in range(4))])
    assert (tmp_path / "restore" / "__3_0.distcp").read_bytes() == b"xxxx"


def test_retention_never_deletes_the_step_that_served_the_newest_request(
    store: CheckpointStore, tmp_path: Path
) -> None:
    # make demo: a resize's request served at step 9; the old gang then committed 10 (periodic)
    # and 11 (its SIGTERM save), and keep=2 deleted 9, the step the new attempt was to load.
    for step, request in ((5, ""), (9, "resize-2"), (10, "resize-2"), (11, "resize-2")):
        _write_shards(store, step, tmp_path)
        store.write_commit(step, MESH, 3, request=request)
    assert store.apply_retention(keep=2) == [5]
    assert [c.step for c in store.list_committed()] == [9, 10, 11]


def test_retention_rejects_keep_below_one(store: CheckpointStore) -> None:
    with pytest.raises(ValueError, match="keep"):
        store.apply_retention(0)


def _save(store: CheckpointStore, step: int, shards: str, tmp_path: Path, fill: bytes, ranks: range) -> None:
    """One attempt's uploads of `ranks`' shard files into its own directory of `step`."""
    for rank in ranks:
        shard = tmp_path / f"{shards}-{step}-{rank}"
        shard.write_bytes(fill * (rank + 1))
        store.upload_file(step, f"__{rank}_0.distcp", shard, shards=shards)


def test_a_late_writer_never_mixes_its_shards_into_a_committed_step(
    store: CheckpointStore, tmp_path: Path
) -> None:
    """Attempt 0, still shutting down, writes step 200 before and after attempt 1 commits it."""
    old, new = attempt_dir(0, "aaaa0000"), attempt_dir(1, "bbbb1111")
    _save(store, 200, old, tmp_path, b"o", range(0, 2))
    _save(store, 200, new, tmp_path, b"n", range(0, 4))
    store.write_commit(200, MESH, 10, shards=new)
    _save(store, 200, old, tmp_path, b"o", range(2, 4))  # the old attempt's remaining ranks

    commit = store.latest_committed()
    assert commit is not None and (commit.step, commit.shards) == (200, new)
    names = store.download_step(200, tmp_path / "restore")
    assert names == [f"__{r}_0.distcp" for r in range(4)]
    assert {(tmp_path / "restore" / n).read_bytes()[:1] for n in names} == {b"n"}, "mixed shards"


def test_an_old_layout_checkpoint_still_restores(store: CheckpointStore, tmp_path: Path) -> None:
    _write_shards(store, 7, tmp_path)  # shards straight in step-0000000007/, COMMITTED without "shards"
    store.write_commit(7, MESH, 4)
    assert store.read_commit(7).shards == ""  # type: ignore[union-attr]
    assert store.download_step(7, tmp_path / "r") == sorted([".metadata", COMMITTED, "__0_0.distcp", "__1_0.distcp"])


def test_retention_collects_other_attempts_shards_except_in_the_newest_step(
    store: CheckpointStore, tmp_path: Path
) -> None:
    for step in (10, 20):
        _save(store, step, attempt_dir(0, "aaaa0000"), tmp_path, b"o", range(1))  # never committed
        _save(store, step, attempt_dir(1, "bbbb1111"), tmp_path, b"n", range(2))
        store.write_commit(step, MESH, 3, shards=attempt_dir(1, "bbbb1111"))

    assert store.apply_retention(keep=2) == []
    assert sorted(store.step_objects(10)) == [COMMITTED, "attempt-1-bbbb1111/__0_0.distcp",
                                              "attempt-1-bbbb1111/__1_0.distcp"]  # fmt: skip
    # the newest step keeps a slower attempt's files: it may still be writing them
    assert "attempt-0-aaaa0000/__0_0.distcp" in store.step_objects(20)
    assert store.download_step(10, tmp_path / "r10") == ["__0_0.distcp", "__1_0.distcp"]


def test_the_served_request_is_found_under_a_newer_stale_commit(
    store: CheckpointStore, tmp_path: Path
) -> None:
    """A gang replaced by a resize saved step 26 on its SIGTERM (naming its own request) after the
    new gang had resumed from 13; the new gang's requested save is step 24. The operator still
    learns its request was served, at step 24."""
    from topotrain.controller.observe import _served_request

    for step, request in ((13, "resize-0"), (24, "resize-1"), (26, "resize-0")):
        _write_shards(store, step, tmp_path)
        store.write_commit(step, MESH, 3, request=request)
    store.write_progress(25, attempt=1, request=ServedRequest("resize-1", 24))
    assert _served_request(store, store.latest_committed(), store.read_progress()) == ("resize-1", 24)
    # A heartbeat naming a save that has not committed yet: only the newest commit's request.
    store.write_progress(31, attempt=1, request=ServedRequest("resize-2", 30))
    assert _served_request(store, store.latest_committed(), store.read_progress()) == ("resize-0", 26)
