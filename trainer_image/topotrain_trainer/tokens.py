"""`prepare`'s tokenizer: Hugging Face `tokenizers`, trained on the user's corpus or loaded from a
`tokenizer.json` the user gives. Nothing is downloaded.

A trained tokenizer is a byte-level BPE (every byte is in its alphabet, so no text is unknown)
with one special token, END_OF_DOCUMENT, which ends every document in the shards. A given
tokenizer keeps its own vocabulary; its end-of-document token is the first of EOD_CANDIDATES it
knows, or the one `--eod-token` names.

Documents: a `.jsonl` file holds one per line (its "text" field); any other file is one document.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from topotrain_trainer.data import DEFAULT_SHARD_TOKENS, write_dataset
from topotrain_trainer.shards import DatasetStore

END_OF_DOCUMENT = "<|endoftext|>"
# what the common tokenizers call their end-of-document token (GPT-2/NeoX, Llama 3, Llama 2/T5, Gemma)
EOD_CANDIDATES = (END_OF_DOCUMENT, "<|end_of_text|>", "</s>", "<eos>")
ENCODE_BATCH = 256  # documents per encode_batch call (the library encodes a batch in parallel)


def documents(paths: Iterable[Path]) -> Iterator[str]:
    for path in paths:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as lines:
                for line in lines:
                    if line.strip():
                        yield str(json.loads(line)["text"])
        else:
            yield path.read_text(encoding="utf-8")


def train_bpe(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` ids (END_OF_DOCUMENT is id 0) learnt from `corpus`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_DOCUMENT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def eod_id(tokenizer: Tokenizer, name: str | None = None) -> int:
    """The id of the end-of-document token: `name`, or the first of EOD_CANDIDATES known."""
    for candidate in (name,) if name else EOD_CANDIDATES:
        found = tokenizer.token_to_id(candidate)
        if found is not None:
            return int(found)
    wanted = name or " or ".join(EOD_CANDIDATES)
    raise ValueError(f"the tokenizer has no end-of-document token {wanted} (name one: --eod-token)")


def encode(tokenizer: Tokenizer, docs: Iterable[str], eod: int) -> Iterator[npt.NDArray[np.uint32]]:
    """Each document's ids followed by `eod`, a batch of documents per array."""
    batch: list[str] = []

    def flush() -> npt.NDArray[np.uint32]:
        encoded = tokenizer.encode_batch(batch, add_special_tokens=False)
        ids = [np.append(np.asarray(e.ids, dtype=np.uint32), np.uint32(eod)) for e in encoded]
        batch.clear()
        return np.concatenate(ids)

    for doc in docs:
        batch.append(doc)
        if len(batch) >= ENCODE_BATCH:
            yield flush()
    if batch:
        yield flush()


def prepare_dataset(
    store: DatasetStore,
    docs: Callable[[], Iterable[str]],
    *,
    tokenizer: Tokenizer | None = None,
    vocab_size: int = 32000,
    eod_token: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> dict[str, Any]:
    """Tokenize `docs()` (called once more to train a BPE when no tokenizer is given) into
    uint32 shards + tokenizer.json + index.json in `store`; returns a summary."""
    if tokenizer is None:
        tokenizer = train_bpe(docs(), vocab_size)
    eod = eod_id(tokenizer, eod_token)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    write_dataset(store, encode(tokenizer, docs(), eod), shard_tokens, vocab, dtype="uint32",
                  eod=eod, tokenizer_json=tokenizer.to_str())  # fmt: skip
    return {"dataset": store.uri, "vocab_size": vocab, "eod": eod}
