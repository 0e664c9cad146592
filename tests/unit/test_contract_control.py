"""The downwardAPI control file the trainer reads the operator's requests from."""

from __future__ import annotations

from pathlib import Path

import pytest
from topotrain.contract import CHECKPOINT_REQUEST, CONTROL_DIR, control_path, read_control


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        (f'{CHECKPOINT_REQUEST}="3"\n', {CHECKPOINT_REQUEST: "3"}),
        ('a="x=y"\nb="quote \\" and \\\\ back"\n', {"a": "x=y", "b": 'quote " and \\ back'}),
        ('a="1"\nno equals sign\n="orphan"\nb="2"', {"a": "1", "b": "2"}),
        ('odd="bell\\x07"\n', {"odd": "bell\\x07"}),  # a Go escape JSON lacks: kept raw
        ('multi="line\\none"\n', {"multi": "line\none"}),
    ],
)
def test_read_control_parses_kubelet_lines(tmp_path: Path, text: str, expected: dict[str, str]) -> None:
    path = tmp_path / "annotations"
    path.write_text(text)
    assert read_control(path) == expected


def test_missing_control_file_is_empty(tmp_path: Path) -> None:
    assert read_control(tmp_path / "absent") == {}


def test_control_path_default_and_override(tmp_path: Path) -> None:
    assert control_path({}) == Path(CONTROL_DIR) / "annotations"
    assert control_path({"TOPOTRAIN_CONTROL_DIR": str(tmp_path)}) == tmp_path / "annotations"
