"""The trainer's data path without torch.distributed: the tokenizer `prepare` trains and writes
with, the shard stores (a directory, S3), the streaming reader and the sampler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from topotrain_trainer.config import ConfigError, TrainingConfig
from topotrain_trainer.data import (
    INDEX,
    BatchLoader,
    TokenDataset,
    model_vocab,
    synthetic_sentences,
)
from topotrain_trainer.sampler import (
    FeistelPermutation,
    Mixture,
    Sampler,
    length_at,
    parse_lengths,
    parse_mixture,
)
from topotrain_trainer.shards import DirStore, S3Store, ShardReader
from topotrain_trainer.tokens import END_OF_DOCUMENT, eod_id, prepare_dataset, train_bpe

from testbed.s3 import S3Server

DOCS = [f"document {i}: " + " ".join(synthetic_sentences(20, seed=i)) for i in range(40)]


@pytest.mark.parametrize("size", [1, 2, 7, 64, 1000, 4097])
def test_the_permutation_is_a_bijection(size: int) -> None:
    permuted = FeistelPermutation(size, key=99).take(np.arange(size))
    assert sorted(permuted.tolist()) == list(range(size))
    assert FeistelPermutation(size, key=99)[size - 1] == permuted[-1]


def test_epochs_and_seeds_shuffle_differently_and_globally() -> None:
    sampler = Sampler(10_000, seed=1)
    first, second = sampler.indices(0, 10_000), sampler.indices(10_000, 10_000)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(10_000))
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, Sampler(10_000, seed=2).indices(0, 10_000))
    # global: 100 consecutive positions land all over the corpus (not within one shard's range)
    assert np.ptp(first[:100]) > 9_000


def test_any_split_of_the_counters_reads_the_same_samples() -> None:
    """A step's samples depend only on the consumed counter: dp=4 ranks together read what dp=1
    reads, and a resume at counter c continues the order (so at a changed data degree too)."""
    sampler = Sampler(1234, seed=5)
    whole = sampler.indices(1200, 64)  # spans the epoch boundary at 1234
    split = np.concatenate([Sampler(1234, seed=5).indices(1200 + r * 16, 16) for r in range(4)])
    assert np.array_equal(whole, split)
    assert sampler.index(1233) == whole[33] and sampler.index(1234) == whole[34]


def test_the_sampler_holds_no_permutation() -> None:
    """Memory does not grow with the corpus: the sampler is a seed and a size, nothing else."""
    small, huge = Sampler(1000, seed=3), Sampler(500_000_000_000, seed=3)
    assert vars(small).keys() == vars(huge).keys() == {"size", "seed"}
    assert 0 <= huge.index(123_456_789_012) < 500_000_000_000


def test_a_mixture_draws_by_the_weights_of_each_steps_stage() -> None:
    stages = parse_mixture("0:0.7,0.3; 100:0,1", 2)
    mixture = Mixture([1000, 50], seed=9, global_batch=8, stages=stages)
    chosen, indices = mixture.pick(0, 800)  # steps 0-99: the first stage
    assert 0.65 < float(np.mean(chosen == 0)) < 0.75
    assert indices[chosen == 1].max() < 50 and len(set(indices[chosen == 0].tolist())) == int(np.sum(chosen == 0))
    later, _ = mixture.pick(800, 80)  # step 100 on: only the second dataset
    assert (later == 1).all()
    parts = [mixture.pick(400 + 10 * r, 10) for r in range(4)]  # any split of the counters
    whole = mixture.pick(400, 40)
    assert np.array_equal(np.concatenate([p[0] for p in parts]), whole[0])
    assert np.array_equal(np.concatenate([p[1] for p in parts]), whole[1])


@pytest.mark.parametrize("text", ["", "5:1,1", "0:1", "0:1,1;0:1,2", "0:0,0", "0:-1,2"])
def test_a_mixture_that_cannot_be_drawn_from_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"stage|step 0"):
        parse_mixture(text, 2)


def prepared(store: DirStore | S3Store, shard_tokens: int = 2048) -> dict[str, object]:
    return prepare_dataset(store, lambda: iter(DOCS), vocab_size=400, shard_tokens=shard_tokens)


def test_prepare_trains_a_bpe_and_writes_documents_ended_by_eod(tmp_path: Path) -> None:
    summary = prepared(DirStore(tmp_path / "ds"))
    index = json.loads((tmp_path / "ds" / INDEX).read_text())
    assert index["dtype"] == "uint32" and index["documents"] == len(DOCS) and len(index["shards"]) > 1
    assert summary["vocab_size"] == index["vocab_size"] <= 400 and index["eod"] == 0
    tokenizer = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))
    assert eod_id(tokenizer) == tokenizer.token_to_id(END_OF_DOCUMENT) == index["eod"]
    tokens = np.concatenate([np.fromfile(tmp_path / "ds" / s["file"], dtype=np.uint32) for s in index["shards"]])
    ends = np.flatnonzero(tokens == index["eod"])
    assert len(ends) == len(DOCS) and ends[-1] == len(tokens) - 1
    assert tokenizer.decode(tokens[: ends[0]].tolist()) == DOCS[0]
    assert len(tokens) < sum(map(len, DOCS)) / 2  # a BPE, not bytes
    assert model_vocab(index["vocab_size"]) % 128 == 0


def test_a_given_tokenizer_without_an_eod_token_is_refused(tmp_path: Path) -> None:
    tokenizer = train_bpe(iter(DOCS), 300)
    with pytest.raises(ValueError, match="no end-of-document token <sep>"):
        eod_id(tokenizer, "<sep>")


def test_samples_are_read_by_range_and_cached_within_bounds(tmp_path: Path) -> None:
    prepared(DirStore(tmp_path / "ds"))
    dataset = TokenDataset(tmp_path / "ds", seq_len=16)
    index = json.loads((tmp_path / "ds" / INDEX).read_text())
    first = np.fromfile(tmp_path / "ds" / index["shards"][1]["file"], dtype=np.uint32)
    shard1 = int(dataset.offsets[1])
    assert np.array_equal(dataset.sample(shard1 + 2), first[32:49])
    assert dataset.reader.stats.bytes == 17 * 4  # exactly the sample, not the shard
    dataset.samples([shard1 + 2, shard1 + 3])
    assert dataset.reader.stats.cache_hits == 1
    small = ShardReader(dataset.store, cache_bytes=100)
    small.read_many([dataset.extent(i) for i in range(10)])
    assert small.cached_bytes <= 100


def test_a_rank_reads_only_its_slice_and_middle_stages_read_nothing(tmp_path: Path) -> None:
    prepared(DirStore(tmp_path / "ds"))
    ranks = [BatchLoader(TokenDataset(tmp_path / "ds", 16), 7, 8, data=2, dp_rank=r) for r in range(2)]
    whole = BatchLoader(TokenDataset(tmp_path / "ds", 16), 7, 8, data=1, dp_rank=0)
    inputs = np.concatenate([loader.batch_at(40)[0].numpy() for loader in ranks])
    assert np.array_equal(inputs, whole.batch_at(40)[0].numpy())
    assert ranks[0].dataset.reader.stats.bytes == 4 * 17 * 4
    middle = BatchLoader(TokenDataset(tmp_path / "ds", 16), 7, 8, data=2, dp_rank=0, reads=False)
    assert middle.batch_at(40)[0].numel() == 0 and middle.dataset.reader.stats.requests == 0


def test_a_batch_of_a_mixture_reads_each_row_from_its_dataset(tmp_path: Path) -> None:
    prepared(DirStore(tmp_path / "a"))
    prepared(DirStore(tmp_path / "b"))
    datasets = [TokenDataset(tmp_path / name, 16) for name in ("a", "b")]
    loader = BatchLoader(datasets, 7, 8, data=1, dp_rank=0, stages=parse_mixture("0:1,1", 2))
    chosen, indices = loader.mixture.pick(16, 8)
    assert set(chosen.tolist()) == {0, 1}
    expected = np.stack([datasets[k].sample(i) for k, i in zip(chosen, indices, strict=True)])
    assert np.array_equal(loader.batch_at(16)[0].numpy(), expected[:, :-1])


def test_a_sequence_length_schedule_trains_the_same_tokens_as_windows_from_its_step(tmp_path: Path) -> None:
    """training.seqLenSchedule: from step 2 on (counters 16..), each 16-token sample trains as
    four windows of 4 tokens, the sample's windows together; the targets are the inputs'
    next tokens, so a step trains the same tokens and targets in shorter contexts. A loader
    started anywhere (a resume, at any data degree) cuts the same windows."""
    prepared(DirStore(tmp_path / "ds"))
    plain = BatchLoader(TokenDataset(tmp_path / "ds", 16), 7, 8, data=1, dp_rank=0)
    lengths = parse_lengths("0:16; 2:4", 16)
    loader = BatchLoader(TokenDataset(tmp_path / "ds", 16), 7, 8, data=1, dp_rank=0, lengths=lengths)
    for consumed in (0, 8):  # steps 0 and 1: whole samples
        assert all(torch.equal(a, b) for a, b in zip(loader.batch_at(consumed), plain.batch_at(consumed), strict=True))
    inputs, targets = loader.batch_at(16)
    whole_inputs, whole_targets = plain.batch_at(16)
    assert inputs.shape == targets.shape == (32, 4)
    assert torch.equal(inputs[4:8].flatten(), whole_inputs[1])  # sample 1's four windows
    assert torch.equal(targets.reshape(8, 16), whole_targets)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # each window predicts its next token
    ranks = [BatchLoader(TokenDataset(tmp_path / "ds", 16), 7, 8, data=2, dp_rank=r, lengths=lengths)
             for r in range(2)]  # fmt: skip
    assert torch.equal(torch.cat([r.batch_at(16)[0] for r in ranks]), inputs)


@pytest.mark.parametrize("text", ["", "1:8", "0:8;0:4", "0:8;4:3", "0:x", "0:0", "0:32"])
def test_a_sequence_length_schedule_that_cannot_be_trained_is_refused_by_name(text: str) -> None:
    raw = {"seqLen": 16, "seqLenSchedule": text or ";"}
    with pytest.raises(ConfigError, match=r"training\.seqLenSchedule="):
        TrainingConfig.from_mapping(raw)


def test_a_sequence_length_schedule_names_each_steps_length() -> None:
    config = TrainingConfig.from_mapping({"seqLen": 64, "seqLenSchedule": "0:16;100:32;200:64"})
    stages = config.length_stages()
    assert [length_at(stages, s, 64) for s in (0, 99, 100, 199, 200, 10**6)] == [16, 16, 32, 32, 64, 64]
    assert length_at(TrainingConfig.from_mapping({"seqLen": 64}).length_stages(), 5, 64) == 64


@pytest.mark.s3
def test_a_dataset_under_an_s3_prefix_reads_as_from_a_directory(
    tmp_path: Path, s3: S3Server, s3_bucket: str
) -> None:
    prepared(DirStore(tmp_path / "ds"))
    prepared(S3Store(f"s3://{s3_bucket}/data/tiny", client=s3.client()))
    local = TokenDataset(tmp_path / "ds", seq_len=16)
    remote = TokenDataset(S3Store(f"s3://{s3_bucket}/data/tiny", client=s3.client()), seq_len=16)
    assert len(local) == len(remote) and local.vocab_size == remote.vocab_size
    picks = Sampler(len(local), seed=1).indices(0, 32)
    assert np.array_equal(local.samples(picks), remote.samples(picks))
    assert remote.reader.stats.bytes == 32 * 17 * 4

