"""The boto3 S3 client of the checkpoint store: timeouts, retries and signing.

One place decides how long a request to a checkpoint endpoint may hang and
whose identity signs it; `topotrain_sdk.checkpoints` builds its stores with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


@dataclass(frozen=True)
class Timeouts:
    """Bounds of one S3 request: seconds to connect, seconds per socket read, attempts in all.

    A request gives up after at most about `attempts * (connect + read)` seconds plus
    botocore's backoff between attempts (under a second, then two, ...).
    """

    connect: float = 5.0
    read: float = 30.0
    attempts: int = 4


TRAINER_TIMEOUTS = Timeouts()  # uploads of large shards: patient, the training goes on meanwhile
# The operator reads a few small objects per pass: a dead store is reported within ~30 s. Three
# attempts with botocore's backoff: a store that fails a share of its requests (503s) still
# answers most reads (the status condition adds a grace on top: core/reconcile_status.py).
OPERATOR_TIMEOUTS = Timeouts(connect=3.0, read=10.0, attempts=3)


def make_client(
    endpoint: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    *,
    unsigned: bool = False,
    timeouts: Timeouts = TRAINER_TIMEOUTS,
) -> S3Client:
    """A boto3 S3 client; unset arguments fall back to the AWS_* environment.

    `unsigned`: send anonymous requests, never credentials found in the
    environment, a config file or an instance role.
    """
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"},
        retries={"total_max_attempts": timeouts.attempts, "mode": "standard"},
        connect_timeout=timeouts.connect,
        read_timeout=timeouts.read,
    )
    if unsigned:
        config = config.merge(Config(signature_version=UNSIGNED))
    client: S3Client = boto3.client(
        "s3",
        endpoint_url=endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or None,
        aws_access_key_id=None if unsigned else access_key or None,
        aws_secret_access_key=None if unsigned else secret_key or None,
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        config=config,
    )
    return client
