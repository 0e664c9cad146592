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


def dataset_uri(bucket: str) -> str:
    return f"s3://{bucket}/{PREFIX}"


def prepare(client: Any, bucket: str) -> dict[str, Any]:
    """Write the dataset under `bucket` with `client` (a boto3 S3 client); returns its summary."""

    def docs() -> list[str]:
        return [" ".join(synthetic_sentences(SENTENCES, seed=i)) for i in range(DOCUMENTS)]

    store = S3Store(dataset_uri(bucket), client=client)
    return prepare_dataset(store, docs, vocab_size=VOCAB, shard_tokens=SHARD_TOKENS)
