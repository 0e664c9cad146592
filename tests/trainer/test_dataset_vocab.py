"""A dataset tokenized for a larger vocabulary than a model's fixed embedding is a bad config
(exit 78), not an out-of-range embedding lookup that crashes every restart; a model without
fixed weights takes its vocabulary from the dataset's tokenizer, whatever its size.

The launcher process checks it before starting any rank, so no torch.distributed runs here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from topotrain_trainer.config import EXIT_BAD_CONFIG, ConfigError
from topotrain_trainer.data import check_vocab, write_dataset

from .harness import REPO_ROOT, trainer_env

pytestmark = [pytest.mark.trainer]


def dataset(root: Path, vocab: int, dtype: str = "uint32") -> Path:
    tokens = (np.arange(4096) % vocab).astype(np.uint32)
    write_dataset(root / f"vocab-{vocab}", [tokens], 1 << 12, vocab, dtype=dtype)
    return root / f"vocab-{vocab}"


def test_an_index_that_cannot_hold_its_vocab_exits_with_ex_config(tmp_path: Path) -> None:
    path = dataset(tmp_path, 1000)
    index = json.loads((path / "index.json").read_text())
    (path / "index.json").write_text(json.dumps({**index, "dtype": "uint16", "vocab_size": 70000}))
    training = {"model": "tiny", "seq_len": 32, "global_batch": 2, "micro_batch": 1,
                "steps": 2, "metrics_port": 0, "dataset": str(path)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "topotrain_trainer"], env=trainer_env(training=training),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == EXIT_BAD_CONFIG, done.stdout + done.stderr
    message = json.loads(done.stdout.strip().splitlines()[-1])
    assert message["event"] == "bad_config"
    assert "vocab_size 70000 with dtype 'uint16'" in message["error"]


def test_a_fixed_embedding_refuses_a_larger_vocab_and_a_free_one_takes_any(tmp_path: Path) -> None:
    big = str(dataset(tmp_path, 128256 + 1))
    with pytest.raises(ConfigError, match=r"vocab_size 128257, but training.model='1B' embeds only 128256"):
        check_vocab(big, "1B", 128256)
    assert check_vocab(big, "tiny") == 128257  # a real tokenizer's dataset trains the tiny model
    assert check_vocab(str(dataset(tmp_path, 200)), "tiny", 256) == 200
    assert check_vocab("synthetic", "tiny") == 256


def test_an_unreadable_index_is_a_bad_config_and_a_missing_one_is_left_to_the_ranks(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "index.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"training\.dataset=.*unreadable index\.json"):
        check_vocab(str(tmp_path / "broken"), "tiny")
    assert check_vocab(str(tmp_path / "not-mounted-yet"), "tiny") is None
