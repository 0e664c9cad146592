"""Tokenized training data: token shards and an index, in a directory or under an S3 prefix.

A dataset is what `python -m topotrain_trainer prepare` writes (tokens.py):

    index.json          {"format": 2, "dtype": "uint32", "vocab_size": 50304, "eod": 0,
                         "tokenizer": "tokenizer.json", "documents": 1234,
                         "shards": [{"file": "shard-00000.bin", "tokens": 4194304}, ...]}
    tokenizer.json      the tokenizer the shards were made with (Hugging Face `tokenizers`)
    shard-00000.bin     raw token ids, documents concatenated, each ended by the `eod` id

`index.json` is written last, so a dataset without one is incomplete. Older datasets (uint16,
no `eod`, no tokenizer) read unchanged; `dataset: synthetic` is byte tokens (vocab 256).

A sample is seq_len + 1 consecutive tokens of one shard (inputs and their shifted targets);
sample k of a shard starts at token k * seq_len. Which samples a step trains on depends only on
the global consumed-samples counter (sampler.py): counter c is position c % N of epoch c // N's
permutation. A step takes the next `global_batch` counters and data rank d a contiguous slice of
them, so a job resumed at any data degree continues the same sample order, and a rank reads only
its own samples (shards.py: ranged reads of exactly those bytes).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from topotrain_trainer.config import ConfigError
from topotrain_trainer.sampler import LengthStage, MixStage, Mixture, length_at
from topotrain_trainer.shards import (
    DatasetStore,
    DirStore,
    Extent,
    ShardReader,
    decode,
    missing,
    open_store,
)

if TYPE_CHECKING:  # imported where batches are made: the pod's supervisor (check_vocab) never loads torch
    import torch

INDEX = "index.json"
FORMAT = 2
DEFAULT_SHARD_TOKENS = 1 << 22
SYNTHETIC_VOCAB = 256  # byte tokens
VOCAB_MULTIPLE = 128  # the model's vocabulary is the tokenizer's rounded up to this (tensor shards)
DTYPES = {"uint16": 1 << 16, "uint32": 1 << 32}


def model_vocab(dataset_vocab: int) -> int:
    """The embedding rows a model needs for a tokenizer of `dataset_vocab` ids."""
    return -(-dataset_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def write_dataset(
    store: DatasetStore | Path,
    token_chunks: Iterable[npt.NDArray[np.integer[Any]]],
    shard_tokens: int,
    vocab: int,
    *,
    dtype: str = "uint32",
    eod: int | None = None,
    tokenizer_json: str | None = None,
) -> DatasetStore:
    """Write token chunks as shards, then the tokenizer, then index.json (last: the commit)."""
    target = DirStore(store) if isinstance(store, Path) else store
    if vocab > DTYPES[dtype]:
        raise ValueError(f"vocab_size {vocab} does not fit {dtype}")
    shards: list[dict[str, object]] = []
    buffer: list[npt.NDArray[np.integer[Any]]] = []
    buffered = documents = 0

    def flush(tokens: npt.NDArray[np.integer[Any]]) -> None:
        name = f"shard-{len(shards):05d}.bin"
        target.write(name, tokens.tobytes())
        shards.append({"file": name, "tokens": len(tokens)})

    for chunk in token_chunks:
        documents += 0 if eod is None else int(np.count_nonzero(chunk == eod))
        buffer.append(chunk)
        buffered += len(chunk)
        if buffered < shard_tokens:
            continue
        pending = np.concatenate(buffer).astype(dtype)
        while len(pending) >= shard_tokens:  # shards of exactly shard_tokens, the last shorter
            flush(pending[:shard_tokens])
            pending = pending[shard_tokens:]
        buffer, buffered = [pending], len(pending)
    if buffered:
        flush(np.concatenate(buffer).astype(dtype))
    if not shards:
        raise ValueError("no tokens to write")
    index: dict[str, Any] = {"format": FORMAT, "dtype": dtype, "vocab_size": vocab, "eod": eod,
                             "tokenizer": None, "documents": documents if eod is not None else None,
                             "shards": shards}  # fmt: skip
    if tokenizer_json is not None:
        target.write("tokenizer.json", tokenizer_json.encode())
        index["tokenizer"] = "tokenizer.json"
    target.write(INDEX, json.dumps(index, indent=1).encode())
    return target


def byte_tokens(paths: Iterable[Path]) -> Iterator[npt.NDArray[np.uint16]]:
    for path in paths:
        yield np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16)


def synthetic_sentences(count: int, seed: int) -> Iterator[str]:
    """Deterministic English-like arithmetic sentences: learnable, so loss visibly falls."""
    rng = np.random.default_rng(seed)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    for _ in range(count):
        a, b = rng.integers(0, 10, size=2)
        op, value = ("plus", a + b) if rng.random() < 0.5 else ("times", a * b)
        yield f"{words[a]} {op} {words[b]} is {value}. "


def synthetic_tokens(total: int, seed: int) -> Iterator[npt.NDArray[np.uint16]]:
    """The synthetic sentences as byte tokens, until `total` tokens."""
    produced = 0
    for sentence in synthetic_sentences(total, seed):
        if produced >= total:
            return
        chunk = np.frombuffer(sentence.encode(), dtype=np.uint8).astype(np.uint16)
        produced += len(chunk)
        yield chunk


def ensure_synthetic(root: Path, seed: int, tokens: int = 1 << 20) -> Path:
    """The synthetic dataset for `seed` under `root`, written once per machine."""
    out = root / f"synthetic-{seed}-{tokens}"
    if not (out / INDEX).exists():
        tmp = root / f".synthetic-{seed}-{os.getpid()}"
        write_dataset(tmp, synthetic_tokens(tokens, seed), DEFAULT_SHARD_TOKENS, SYNTHETIC_VOCAB,
                      dtype="uint16")  # fmt: skip
        with contextlib.suppress(OSError):  # another local rank won the race; same data
            tmp.replace(out)
    return out


def read_index(store: DatasetStore) -> dict[str, Any]:
    index: dict[str, Any] = json.loads(store.read(INDEX))
    return index


def check_vocab(dataset: str, model: str, model_vocab: int | None = None) -> int | None:
    """The dataset's vocab_size; ConfigError for an index that cannot be trained on.

    `model_vocab`: the embedding rows the model is fixed to (initial weights); None when the
    model takes its vocabulary from the dataset's tokenizer. A dataset whose ids reach past a
    fixed embedding is refused: otherwise the first out-of-range id is a device-side assert, a
    crash the operator would retry until maxRestarts. An index.json that is not there (yet) in a
    directory is left to the ranks (a volume mounted late deserves a retry); one missing under
    an S3 prefix is a bad config. A store that does not answer is left to the ranks too.
    """
    if dataset == "synthetic":
        vocab = SYNTHETIC_VOCAB
    else:
        try:
            index = read_index(open_store(dataset))
            vocab, dtype = int(index["vocab_size"]), str(index["dtype"])
        except Exception as err:
            if missing(err) and not dataset.startswith("s3://"):
                return None
            if missing(err):
                raise ConfigError(f"training.dataset={dataset!r}: no {INDEX} there (run prepare)") from None
            if isinstance(err, (OSError, ValueError, KeyError, TypeError)):
                raise ConfigError(f"training.dataset={dataset!r}: unreadable {INDEX}: {err}") from None
            return None  # the store is down or refuses: the ranks retry, the operator restarts
        if dtype not in DTYPES or vocab > DTYPES[dtype]:
            raise ConfigError(f"training.dataset={dataset!r}: vocab_size {vocab} with dtype {dtype!r}")
    if model_vocab is not None and vocab > model_vocab:
        raise ConfigError(
            f"training.dataset={dataset!r} has vocab_size {vocab}, but training.model={model!r} "
            f"embeds only {model_vocab} token ids: use a dataset tokenized for this model or a "
            "model with a vocabulary at least that large"
        )
    return vocab


class TokenDataset:
    """Fixed-length samples (seq_len + 1 tokens) cut from the shards of a store."""

    def __init__(self, store: DatasetStore | Path, seq_len: int, *, workers: int = 8) -> None:
        self.store = DirStore(store) if isinstance(store, Path) else store
        index = read_index(self.store)
        self.vocab_size = int(index["vocab_size"])
        self.eod: int | None = index.get("eod")
        self.dtype = np.dtype(index["dtype"])
        self.seq_len = seq_len
        self.files = [str(s["file"]) for s in index["shards"]]
        per_shard = [max(0, (int(s["tokens"]) - 1) // seq_len) for s in index["shards"]]
        self.offsets = np.cumsum([0, *per_shard])
        if self.offsets[-1] == 0:
            raise ValueError(f"{self.store.uri}: no shard holds {seq_len + 1} tokens")
        self.reader = ShardReader(self.store, workers=workers)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def extent(self, index: int) -> Extent:
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        start = (index - int(self.offsets[shard])) * self.seq_len * self.dtype.itemsize
        return Extent(self.files[shard], start, (self.seq_len + 1) * self.dtype.itemsize)

    def samples(self, indices: Iterable[int]) -> npt.NDArray[np.int64]:
        """Rows of seq_len + 1 token ids, one per index, read in parallel."""
        return decode(self.reader.read_many([self.extent(int(i)) for i in indices]), self.dtype)

    def sample(self, index: int) -> npt.NDArray[np.int64]:
        row: npt.NDArray[np.int64] = self.samples([index])[0]
        return row


def windows(tokens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of seq_len + 1 tokens, one a row, as (inputs, targets) of `length` tokens: each
    sample's seq_len / length consecutive windows, a row each, the sample's windows together (so
    a microbatch of rows is still a set of whole samples). Window j trains on tokens
    j*length .. (j+1)*length - 1 and predicts the token after each: the same tokens and targets
    as the whole sample, in shorter attention contexts."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if length != inputs.shape[1]:
        inputs, targets = inputs.reshape(-1, length), targets.reshape(-1, length)
    return inputs.contiguous(), targets.contiguous()


@dataclass
class Batch:
    counter: int
    inputs: torch.Tensor
    targets: torch.Tensor


class BatchLoader:
    """This data rank's slice of each global batch, prepared `prefetch` steps ahead on a thread.

    `reads`: False on a pipeline's middle stages, which take activations, not tokens (their
    batches are empty and nothing is read). `pin`: page-locked host tensors, so that the copy to
    a GPU can be asynchronous (`non_blocking=True`). `lengths`: training.seqLenSchedule, each
    sample cut into windows of the step's length (`windows`).
    """

    def __init__(self, dataset: TokenDataset | Sequence[TokenDataset], seed: int, global_batch: int,
                 data: int, dp_rank: int, prefetch: int = 2, *, reads: bool = True, pin: bool = False,
                 stages: Sequence[MixStage] = (), lengths: Sequence[LengthStage] = ()) -> None:  # fmt: skip
        self.datasets = [dataset] if isinstance(dataset, TokenDataset) else list(dataset)
        self.dataset = self.datasets[0]
        self.mixture = Mixture([len(d) for d in self.datasets], seed, global_batch, stages)
        self.global_batch = global_batch
        self.lengths = tuple(lengths)
        self.local_batch = global_batch // data
        self.dp_rank = dp_rank
        self.reads, self.pin = reads, pin
        self.wait_seconds = 0.0  # how long the last `next` waited for its batch
        self._queue: queue.Queue[Batch] = queue.Queue(prefetch)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def rows(self, first: int) -> npt.NDArray[np.int64]:
        """Tokens of counters first .. first+local_batch-1, one row each, from their datasets."""
        chosen, indices = self.mixture.pick(first, self.local_batch)
        if len(self.datasets) == 1:
            return self.dataset.samples(indices)
        rows = np.empty((self.local_batch, self.dataset.seq_len + 1), dtype=np.int64)
        for k in np.unique(chosen):
            rows[chosen == k] = self.datasets[int(k)].samples(indices[chosen == k])
        return rows

    def batch_at(self, consumed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (local_batch, seq_len) for the step starting at `consumed`;
        (local_batch * seq_len / length, length) in a stage of training.seqLenSchedule."""
        import torch

        if not self.reads:
            return torch.empty((0, 0), dtype=torch.int64), torch.empty((0, 0), dtype=torch.int64)
        tokens = torch.from_numpy(self.rows(consumed + self.dp_rank * self.local_batch))
        length = length_at(self.lengths, consumed // self.global_batch, self.dataset.seq_len)
        inputs, targets = windows(tokens, length)
        if self.pin:
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs, targets

    def start(self, consumed: int) -> None:
        def produce() -> None:
            counter = consumed
            try:
                while not self._stop.is_set():
                    batch = Batch(counter, *self.batch_at(counter))
                    while not self._stop.is_set():
                        with contextlib.suppress(queue.Full):
                            self._queue.put(batch, timeout=0.1)
                            break
                    counter += self.global_batch
            except BaseException as err:  # handed to the training loop, which raises it
                import torch

                self._error = err
                self._queue.put(Batch(-1, torch.empty(0), torch.empty(0)))

        self._thread = threading.Thread(target=produce, name="topotrain-prefetch", daemon=True)
        self._thread.start()

    def next(self, consumed: int) -> tuple[torch.Tensor, torch.Tensor]:
        began = time.perf_counter()
        batch = self._queue.get()
        self.wait_seconds = time.perf_counter() - began
        if self._error is not None:
            raise RuntimeError(f"reading training.dataset failed: {self._error}") from self._error
        if batch.counter != consumed:  # the loop and the prefetcher disagree: a bug, not a race
            raise RuntimeError(f"prefetched batch for sample {batch.counter}, expected {consumed}")
        return batch.inputs, batch.targets

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for dataset in self.datasets:
            dataset.reader.close()
