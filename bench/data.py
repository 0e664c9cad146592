"""Data benchmark (a benchmark, not a test): how much of a step waits for its batch when the
trainer streams tokenized shards from S3 instead of reading local files, and how much memory the
sampler takes at 1x and 10x corpus size.

    python bench/data.py [--model small] [--steps 20] [--batch 8] [--seq-len 256] [--documents 3000]

It starts the testbed's S3 server (versitygw) on loopback, has `prepare` tokenize a synthetic
corpus once (a BPE trained on it) and writes the same shards to a local directory and to S3, then
trains one process's plain model (no torch.distributed: the data path does not need one) with
the trainer's own BatchLoader (prefetching two steps ahead) over each in turn, in the same run.
Data-wait share = the seconds `next()` waited for its batch / the step seconds. Goal: under 1%.

The sampler's peak memory is traced (tracemalloc, which numpy reports to) while it maps one
global batch of counters, at a corpus of N and of 10N samples; the old per-epoch permutation
(8 bytes per sample) is shown beside it. Goal: the same at 1x and 10x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from topotrain_trainer.data import BatchLoader, TokenDataset, model_vocab, synthetic_sentences  # noqa: E402
from topotrain_trainer.model import Transformer, model_config  # noqa: E402
from topotrain_trainer.parallel import cross_entropy  # noqa: E402
from topotrain_trainer.sampler import Sampler  # noqa: E402
from topotrain_trainer.shards import DirStore, S3Store  # noqa: E402
from topotrain_trainer.tokens import prepare_dataset, train_bpe  # noqa: E402

from testbed.s3 import S3Server  # noqa: E402


def corpus(documents: int) -> list[str]:
    return [" ".join(synthetic_sentences(40, seed=i)) for i in range(documents)]


def train(dataset: TokenDataset, args: argparse.Namespace) -> tuple[float, float, int]:
    """(median step seconds, total wait / total step seconds, bytes read) over args.steps steps."""
    torch.manual_seed(0)
    model = Transformer(model_config(args.model, model_vocab(dataset.vocab_size)))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = BatchLoader(dataset, seed=1, global_batch=args.batch, data=1, dp_rank=0)
    loader.start(0)
    steps, waits = [], []
    for step in range(args.steps + 2):
        began = time.perf_counter()
        inputs, targets = loader.next(step * args.batch)
        cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:  # the first steps fill the prefetch queue and warm the allocator
            steps.append(time.perf_counter() - began)
            waits.append(loader.wait_seconds)
    loader.stop()
    return statistics.median(steps), sum(waits) / sum(steps), dataset.reader.stats.bytes


def sampler_peak(size: int, batch: int) -> int:
    tracemalloc.start()
    sampler = Sampler(size, seed=3)
    sampler.indices(size // 2, batch)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--documents", type=int, default=3000)
    parser.add_argument("--corpus-samples", type=int, default=500_000_000, help="N for the sampler's 1x")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as scratch:
        server = S3Server(Path(scratch) / "s3")
        server.start()
        try:
            docs = corpus(args.documents)
            tokenizer = train_bpe(docs, 4096)
            bucket = server.create_bucket("bench-data")
            remote = S3Store(f"s3://{bucket}/corpus", client=server.client())
            for store in (DirStore(Path(scratch) / "local"), remote):
                summary = prepare_dataset(store, lambda: docs, tokenizer=tokenizer, shard_tokens=1 << 16)
            rows = []
            for name, store in (("local files", DirStore(Path(scratch) / "local")),
                                ("S3 (versitygw, loopback)", S3Store(remote.uri, client=server.client()))):  # fmt: skip
                dataset = TokenDataset(store, args.seq_len)
                step, share, read = train(dataset, args)
                rows.append((name, step, share, read))
        finally:
            server.stop()
    print(f"model {args.model}, batch {args.batch} x {args.seq_len}, {args.steps} steps, "
          f"{len(dataset)} samples, vocab {summary['vocab_size']}")  # fmt: skip
    print("| source | median step s | data-wait share | bytes read |\n|---|---|---|---|")
    for name, step, share, read in rows:
        print(f"| {name} | {step:.4f} | {share:.3%} | {read} |")
    print("\n| corpus samples | sampler peak bytes | a materialised permutation |\n|---|---|---|")
    for size in (args.corpus_samples, 10 * args.corpus_samples):
        print(f"| {size:,} | {sampler_peak(size, args.batch * 128):,} | {8 * size:,} |")


if __name__ == "__main__":
    main()
