"""Which sample a step trains on: a seeded bijection over sample indices, epoch by epoch.

Sample number c of the run (the global consumed-samples counter) is position c % N of
epoch c // N's permutation of the N samples. The permutation is never materialised: it is a
Feistel network over the smallest even number of bits that covers N, with cycle walking
(a value that lands outside [0, N) is permuted again until it lands inside; the network is a
bijection on its 2^bits domain, so the walk ends and the restriction to [0, N) is a bijection
too). Memory is constant whatever N, and any position can be mapped on its own, so a rank
computes only its own samples and a job resumed at another data degree continues the same order.

The order is global: consecutive positions land anywhere in the corpus, across shards.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

ROUNDS = 6
_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """A 64-bit mixer (SplitMix64's finaliser): every output bit depends on every input bit."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _mix_array(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 over an array (uint64 arithmetic wraps, as the scalar version masks)."""
    with np.errstate(over="ignore"):
        v = values + np.uint64(0x9E3779B97F4A7C15)
        v = (v ^ (v >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        v = (v ^ (v >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return v ^ (v >> np.uint64(31))


@dataclass(frozen=True)
class FeistelPermutation:
    """A seeded bijection of [0, size): `self[i]` for one position, `take(positions)` for many."""

    size: int
    key: int

    @property
    def half_bits(self) -> int:
        return max(1, (max(1, self.size - 1).bit_length() + 1) // 2)

    def _round_keys(self) -> list[int]:
        return [splitmix64(self.key ^ splitmix64(r + 1)) for r in range(ROUNDS)]

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < self.size:
            raise IndexError(f"position {position} outside [0, {self.size})")
        return int(self.take(np.array([position], dtype=np.int64))[0])

    def take(self, positions: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The permuted index of each position (all in [0, size))."""
        values = np.asarray(positions, dtype=np.uint64)
        bits = self.half_bits
        mask = np.uint64((1 << bits) - 1)
        keys = [np.uint64(k) for k in self._round_keys()]
        pending = np.ones(values.shape, dtype=bool)
        while pending.any():
            v = values[pending]
            left, right = v >> np.uint64(bits), v & mask
            for key in keys:
                left, right = right, left ^ (_mix_array(right ^ key) & mask)
            v = (left << np.uint64(bits)) | right
            values[pending] = v
            pending[pending] = v >= np.uint64(self.size)
        return values.astype(np.int64)


class Sampler:
    """Maps the global consumed-samples counter to dataset indices: one permutation per epoch."""

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise ValueError("a sampler needs at least one sample")
        self.size, self.seed = size, seed

    def permutation(self, epoch: int) -> FeistelPermutation:
        return FeistelPermutation(self.size, splitmix64(splitmix64(self.seed) ^ epoch))

    def index(self, counter: int) -> int:
        return int(self.indices(counter, 1)[0])

    def indices(self, first: int, count: int) -> npt.NDArray[np.int64]:
        """Dataset indices of counters first .. first+count-1 (they may span an epoch boundary)."""
        counters = np.arange(first, first + count, dtype=np.int64)
        epochs, positions = np.divmod(counters, self.size)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self.permutation(int(epoch)).take(positions[chosen])
        return out


def _check_starts(starts: Sequence[int]) -> None:
    """A schedule by step (training.mixture, training.seqLenSchedule): its stages' first steps
    start at 0 and increase; ValueError otherwise."""
    if not starts or starts[0] != 0 or any(a >= b for a, b in itertools.pairwise(starts)):
        raise ValueError("stages must start at step 0 and increase")


@dataclass(frozen=True)
class MixStage:
    """From optimizer step `from_step` on, counters draw from the datasets with these weights."""

    from_step: int
    weights: tuple[float, ...]


def parse_mixture(text: str, datasets: int) -> tuple[MixStage, ...]:
    """`training.mixture`: "STEP:W1,W2,...;STEP:..." (the first stage at step 0), one weight per
    dataset; ValueError naming what is wrong."""
    stages: list[MixStage] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        step, _, weights = part.partition(":")
        values = tuple(float(w) for w in weights.split(","))
        if len(values) != datasets or min(values) < 0 or sum(values) <= 0:
            raise ValueError(f"stage {part!r}: {datasets} weights >= 0, not all 0")
        stages.append(MixStage(int(step), values))
    _check_starts([stage.from_step for stage in stages])
    return tuple(stages)


@dataclass(frozen=True)
class LengthStage:
    """From optimizer step `from_step` on, each sample trains as windows of `length` tokens."""

    from_step: int
    length: int


def parse_lengths(text: str, seq_len: int) -> tuple[LengthStage, ...]:
    """`training.seqLenSchedule`: "STEP:LENGTH;STEP:LENGTH" (the first stage at step 0), each
    length dividing seqLen, the samples' length; ValueError naming what is wrong."""
    stages: list[LengthStage] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        step, _, length = part.partition(":")
        try:
            stage = LengthStage(int(step), int(length))
        except ValueError:
            raise ValueError(f"stage {part!r}: STEP:LENGTH, two whole numbers") from None
        if stage.length < 1 or seq_len % stage.length:
            raise ValueError(f"stage {part!r}: the length must divide seqLen ({seq_len})")
        stages.append(stage)
    _check_starts([stage.from_step for stage in stages])
    return tuple(stages)


def length_at(stages: Sequence[LengthStage], step: int, seq_len: int) -> int:
    """The sequence length optimizer step `step` (0-based) trains at; seq_len without stages."""
    length = seq_len
    for stage in stages:
        if stage.from_step > step:
            break
        length = stage.length
    return length


class Mixture:
    """Which dataset, and which of its samples, each global counter trains on.

    With one dataset it is that dataset's Sampler. With several, counter c (in optimizer step
    c // global_batch) draws dataset k with the weights of the stage that step is in: a seeded
    hash of c against the cumulative weights, so the choice is a pure function of c too. The
    sample is position c of dataset k's own permutation (mod its size): no sample of k repeats
    before c has passed k's size, and a resume at any data degree draws the same samples.
    """

    def __init__(self, sizes: Sequence[int], seed: int, global_batch: int,
                 stages: Sequence[MixStage] = ()) -> None:  # fmt: skip
        self.samplers = [Sampler(size, seed + k) for k, size in enumerate(sizes)]
        self.seed, self.global_batch = seed, global_batch
        self.stages = tuple(stages) or (MixStage(0, (1.0,) * len(sizes)),)

    def choose(self, counters: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The dataset each counter draws from."""
        if len(self.samplers) == 1:
            return np.zeros(len(counters), dtype=np.int64)
        steps = counters // self.global_batch
        starts = np.array([s.from_step for s in self.stages])
        stage = np.searchsorted(starts, steps, side="right") - 1
        cumulative = np.array([np.cumsum(s.weights) / sum(s.weights) for s in self.stages])
        key = np.uint64(splitmix64(self.seed ^ 0x6D6978))  # "mix"
        uniform = (_mix_array(counters.astype(np.uint64) ^ key) >> np.uint64(11)).astype(np.float64) / 2.0**53
        chosen = (uniform[:, None] >= cumulative[stage]).sum(axis=1)
        out: npt.NDArray[np.int64] = np.minimum(chosen, len(self.samplers) - 1).astype(np.int64)
        return out

    def pick(self, first: int, count: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(dataset, sample index) of counters first .. first+count-1."""
        counters = np.arange(first, first + count, dtype=np.int64)
        datasets = self.choose(counters)
        indices = np.empty(count, dtype=np.int64)
        for k in np.unique(datasets):
            chosen = datasets == k
            sampler = self.samplers[int(k)]
            if len(self.samplers) == 1:
                indices[chosen] = sampler.indices(first, count)
            else:
                indices[chosen] = [sampler.index(int(c)) for c in counters[chosen]]
        return datasets, indices
