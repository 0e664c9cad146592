"""Pre-tokenized training data: binary shards read through np.memmap.

A dataset is a directory made by `python -m topotrain_trainer prepare`:

    index.json          {"dtype": "uint16", "vocab_size": 256, "shards": [{"file", "tokens"}]}
    shard-00000.bin     raw token ids

Tokens are bytes (vocab 256), so no tokenizer is downloaded; any corpus already
tokenized into uint16/uint32 ids can be dropped in with its own index.json.

Which samples a step trains on depends only on the global consumed-samples
counter: sample number c is position c % N of the permutation for epoch
c // N. A step takes the next `global_batch` numbers and data rank d takes a
contiguous slice of them, so a job resumed at any data degree continues the
same sample order.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from topotrain_trainer.config import ConfigError

INDEX = "index.json"
DEFAULT_SHARD_TOKENS = 1 << 22
SYNTHETIC_VOCAB = 256  # byte tokens


def write_dataset(
    out: Path, token_chunks: Iterable[npt.NDArray[np.uint16]], shard_tokens: int, vocab: int
) -> Path:
    """Write token chunks as shards + index.json; the index is renamed in last (atomic)."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, object]] = []
    buffer: list[npt.NDArray[np.uint16]] = []
    buffered = 0

    def flush() -> None:
        nonlocal buffer, buffered
        if not buffered:
            return
        name = f"shard-{len(shards):05d}.bin"
        np.concatenate(buffer).astype(np.uint16).tofile(out / name)
        shards.append({"file": name, "tokens": buffered})
        buffer, buffered = [], 0

    for chunk in token_chunks:
        buffer.append(chunk)
        buffered += len(chunk)
        if buffered >= shard_tokens:
            flush()
    flush()
    if not shards:
        raise ValueError("no tokens to write")
    tmp = out / f".{INDEX}.{os.getpid()}"
    tmp.write_text(json.dumps({"dtype": "uint16", "vocab_size": vocab, "shards": shards}, indent=1))
    tmp.replace(out / INDEX)
    return out


def byte_tokens(paths: Iterable[Path]) -> Iterator[npt.NDArray[np.uint16]]:
    for path in paths:
        yield np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16)


def synthetic_tokens(total: int, seed: int) -> Iterator[npt.NDArray[np.uint16]]:
    """Deterministic English-like arithmetic sentences: learnable, so loss visibly falls."""
    rng = np.random.default_rng(seed)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    produced = 0
    while produced < total:
        a, b = rng.integers(0, 10, size=2)
        op, value = ("plus", a + b) if rng.random() < 0.5 else ("times", a * b)
        sentence = f"{words[a]} {op} {words[b]} is {value}. ".encode()
        chunk = np.frombuffer(sentence, dtype=np.uint8).astype(np.uint16)
        produced += len(chunk)
        yield chunk


def ensure_synthetic(root: Path, seed: int, tokens: int = 1 << 20) -> Path:
    """The synthetic dataset for `seed` under `root`, written once per machine."""
    out = root / f"synthetic-{seed}-{tokens}"
    if not (out / INDEX).exists():
        tmp = root / f".synthetic-{seed}-{os.getpid()}"
        write_dataset(tmp, synthetic_tokens(tokens, seed), DEFAULT_SHARD_TOKENS, SYNTHETIC_VOCAB)
        with contextlib.suppress(OSError):  # another local rank won the race; same data
            tmp.replace(out)
    return out


def check_vocab(dataset: str, model: str, model_vocab: int) -> None:
    """Refuse a dataset whose token ids reach past the model's embedding (ConfigError).

    Otherwise the first out-of-range id is a device-side assert in the embedding,
    a crash the operator would retry until maxRestarts. An index.json that is not
    there (yet) is left to the ranks: a volume mounted late deserves a retry.
    """
    if dataset == "synthetic":
        vocab = SYNTHETIC_VOCAB
    else:
        try:
            vocab = int(json.loads((Path(dataset) / INDEX).read_text())["vocab_size"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"training.dataset={dataset!r}: unreadable {INDEX}: {err}") from None
    if vocab > model_vocab:
        raise ConfigError(
            f"training.dataset={dataset!r} has vocab_size {vocab}, but training.model={model!r} "
            f"embeds only {model_vocab} token ids: use a dataset tokenized for this model or a "
            "model with a vocabulary at least that large"
        )


class TokenDataset:
    """Fixed-length samples (seq_len + 1 tokens) cut from memory-mapped shards."""

    def __init__(self, path: Path, seq_len: int) -> None:
        index = json.loads((path / INDEX).read_text())
        self.vocab_size = int(index["vocab_size"])
        self.seq_len = seq_len
        self.shards = [
            np.memmap(
                path / s["file"],
                dtype=np.dtype(index["dtype"]),
                mode="r",
                shape=(int(s["tokens"]),),
            )
            for s in index["shards"]
        ]
        per_shard = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.offsets = np.cumsum([0, *per_shard])
        if self.offsets[-1] == 0:
            raise ValueError(f"{path}: no shard holds {seq_len + 1} tokens")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sample(self, index: int) -> npt.NDArray[np.int64]:
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        start = (index - int(self.offsets[shard])) * self.seq_len
        return np.asarray(self.shards[shard][start : start + self.seq_len + 1], dtype=np.int64)


@dataclass
class Sampler:
    """Maps the global consumed-samples counter to dataset indices, epoch by epoch."""

    size: int
    seed: int
    _epoch: int = -1
    _order: npt.NDArray[np.int64] | None = None

    def index(self, counter: int) -> int:
        epoch, position = divmod(counter, self.size)
        if epoch != self._epoch or self._order is None:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            self._epoch = epoch
        return int(self._order[position])


class BatchLoader:
    """This data rank's slice of each global batch, prepared ahead on a thread."""

    def __init__(
        self,
        dataset: TokenDataset,
        seed: int,
        global_batch: int,
        data: int,
        dp_rank: int,
        prefetch: int = 2,
    ) -> None:
        self.dataset = dataset
        self.sampler = Sampler(len(dataset), seed)
        self.global_batch = global_batch
        self.local_batch = global_batch // data
        self.dp_rank = dp_rank
        self._queue: queue.Queue[tuple[int, torch.Tensor, torch.Tensor]] = queue.Queue(prefetch)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def batch_at(self, consumed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (local_batch, seq_len) for the step starting at `consumed`."""
        first = consumed + self.dp_rank * self.local_batch
        rows = [self.dataset.sample(self.sampler.index(first + i)) for i in range(self.local_batch)]
        tokens = torch.from_numpy(np.stack(rows))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def start(self, consumed: int) -> None:
        def produce() -> None:
            counter = consumed
            while not self._stop.is_set():
                inputs, targets = self.batch_at(counter)
                while not self._stop.is_set():
                    try:
                        self._queue.put((counter, inputs, targets), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                counter += self.global_batch

        self._thread = threading.Thread(target=produce, name="topotrain-prefetch", daemon=True)
        self._thread.start()

    def next(self, consumed: int) -> tuple[torch.Tensor, torch.Tensor]:
        counter, inputs, targets = self._queue.get()
        if counter != consumed:  # the loop and the prefetcher disagree: a bug, not a race
            raise RuntimeError(f"prefetched batch for sample {counter}, expected {consumed}")
        return inputs, targets

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
