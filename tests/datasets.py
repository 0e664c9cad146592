"""The tokenized dataset the end-to-end and kind suites' jobs train from (issue 34).

Every job of those suites reads its samples from S3 as a real workload would: uint32 token
shards of a BPE that `prepare` trains on a synthetic corpus (tokens.py), under one prefix of the
session's bucket, written once per session before the first job. So the suites' kill, resume and
shrink tests hold the streaming reader and the sampler to the uninterrupted run's losses.
"""

from __future__ import annotations

from typing import Any

from topotrain_trainer.data import synthetic_sentences
from topotrain_trainer.shards import S3Store
from topotrain_trainer.tokens import prepare_dataset

# 400 documents of 20 sentences: about 50,000 tokens in 7 shards, some 800 samples of 64 tokens,
# so the 12 steps of 8 samples a job trains shuffle across shards
DOCUMENTS, SENTENCES, VOCAB, SHARD_TOKENS = 400, 20, 512, 8192
PREFIX = "datasets/arithmetic"


# The S3 client that wrote each bucket's dataset: the in-process reference runs
# (tests/trainer/reference.py) read the same shards with it (this process has no AWS_* credentials).
_CLIENTS: dict[str, Any] = {}


def dataset_uri(bucket: str) -> str:
    return f"s3://{bucket}/{PREFIX}"


def client_for(uri: str) -> Any | None:
    """The client `prepare` wrote `uri`'s bucket with, if this process wrote it."""
    if not uri.startswith("s3://"):
        return None
    return _CLIENTS.get(uri[len("s3://"):].split("/", 1)[0])


def prepare(client: Any, bucket: str) -> dict[str, Any]:
    """Write the dataset under `bucket` with `client` (a boto3 S3 client); returns its summary."""

    def docs() -> list[str]:
        return [" ".join(synthetic_sentences(SENTENCES, seed=i)) for i in range(DOCUMENTS)]

    _CLIENTS[bucket] = client
    store = S3Store(dataset_uri(bucket), client=client)
    return prepare_dataset(store, docs, vocab_size=VOCAB, shard_tokens=SHARD_TOKENS)
