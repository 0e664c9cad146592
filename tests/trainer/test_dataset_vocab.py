"""A dataset tokenized for a larger vocabulary than the model's is a bad config (exit 78),
not an out-of-range embedding lookup that crashes every restart.

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


def dataset(root: Path, vocab: int) -> Path:
    tokens = (np.arange(4096) % vocab).astype(np.uint16)
    return write_dataset(root / f"vocab-{vocab}", [tokens], 1 << 12, vocab)


def test_a_dataset_with_a_larger_vocab_exits_with_ex_config(tmp_path: Path) -> None:
    training = {"model": "tiny", "seq_len": 32, "global_batch": 2, "micro_batch": 1,
                "steps": 2, "metrics_port": 0, "dataset": str(dataset(tmp_path, 32000))}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "topotrain_trainer"], env=trainer_env(training=training),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == EXIT_BAD_CONFIG, done.stdout + done.stderr
    message = json.loads(done.stdout.strip().splitlines()[-1])
    assert message["event"] == "bad_config"
    assert "vocab_size 32000" in message["error"] and "'tiny'" in message["error"]
    assert "embeds only 256" in message["error"]


@pytest.mark.parametrize("vocab", [200, 256])
def test_a_dataset_within_the_models_vocab_is_accepted(tmp_path: Path, vocab: int) -> None:
    check_vocab(str(dataset(tmp_path, vocab)), "tiny", 256)
    check_vocab("synthetic", "tiny", 256)


def test_an_unreadable_index_is_a_bad_config_and_a_missing_one_is_left_to_the_ranks(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "index.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"training\.dataset=.*unreadable index\.json"):
        check_vocab(str(tmp_path / "broken"), "tiny", 256)
    check_vocab(str(tmp_path / "not-mounted-yet"), "tiny", 256)
