"""The testbed's S3 server (versitygw, posix backend) against boto3: what the
checkpoint store relies on, including objects surviving a server restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.s3 import S3Server

pytestmark = pytest.mark.s3


@pytest.fixture
def server(tmp_path: Path) -> Iterator[S3Server]:
    """A private server: these tests stop and restart it."""
    srv = S3Server(tmp_path / "data").start()
    yield srv
    srv.stop()


def test_put_get_list(server: S3Server) -> None:
    client = server.client()
    server.create_bucket("ckpt")
    for key in (
        "job/step-0000000001/COMMITTED",
        "job/step-0000000002/shard-0",
        "job/progress.json",
    ):
        client.put_object(Bucket="ckpt", Key=key, Body=key.encode())

    listed = client.list_objects_v2(Bucket="ckpt", Prefix="job/step-")
    keys = [obj["Key"] for obj in listed.get("Contents", [])]
    assert keys == ["job/step-0000000001/COMMITTED", "job/step-0000000002/shard-0"]

    delimited = client.list_objects_v2(Bucket="ckpt", Prefix="job/", Delimiter="/")
    prefixes = [p["Prefix"] for p in delimited.get("CommonPrefixes", [])]
    assert prefixes == ["job/step-0000000001/", "job/step-0000000002/"]

    body = client.get_object(Bucket="ckpt", Key="job/progress.json")["Body"].read()
    assert body == b"job/progress.json"


def test_multipart_upload(server: S3Server) -> None:
    client = server.client()
    server.create_bucket("big")
    parts = [bytes([i]) * (5 * 1024 * 1024) for i in range(2)] + [b"tail"]
    upload = client.create_multipart_upload(Bucket="big", Key="shard.distcp")
    etags = [
        client.upload_part(
            Bucket="big", Key="shard.distcp", UploadId=upload["UploadId"], PartNumber=n, Body=part
        )["ETag"]
        for n, part in enumerate(parts, start=1)
    ]
    client.complete_multipart_upload(
        Bucket="big",
        Key="shard.distcp",
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, 1)]},
    )
    got = client.get_object(Bucket="big", Key="shard.distcp")["Body"].read()
    assert got == b"".join(parts)


def test_objects_survive_restart(server: S3Server) -> None:
    server.create_bucket("durable")
    server.client().put_object(Bucket="durable", Key="k", Body=b"kept")
    endpoint = server.endpoint

    assert server.stop()
    assert not server.running()
    server.start()

    assert server.endpoint == endpoint
    assert server.client().get_object(Bucket="durable", Key="k")["Body"].read() == b"kept"


def test_second_handle_finds_running_server(server: S3Server) -> None:
    """Another process (the CLI's `down`) can find and stop a server by its data dir."""
    other = S3Server(server.data_dir)
    assert other.port == server.port
    assert other.running()
    assert other.stop()
    assert not server.running()
