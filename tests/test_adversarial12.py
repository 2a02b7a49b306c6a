"""Adversarial round 12 (issue 21): regression tests for what the twelfth independent round
found (a reviewer who did not write the fixes), in the readers of received data folders.

Before: the ``folder`` data source crashed with ``BadZipFile`` / ``EOFError`` / ``TypeError``
tracebacks on a damaged ``CLIENT.npz`` or a text label array, silently truncated float labels
(1.7 → class 1), cast complex inputs to their real part and dropped the extra rows of an
``x`` longer than ``y``; a FIFO named ``femnist_leaf_subset.npz`` hung the FEMNIST loader for
good; a HAPT ``labels.txt`` integer past int64 and a deeply nested LEAF json file ended in
``OverflowError`` / ``RecursionError`` tracebacks, and LEAF pixels given as strings were
parsed as numbers; ``--set key=[[[…]]]`` crashed ``partialfl train``. Now each is one
:class:`~partialfl.data.DataFormatError` (or a ConfigError) naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from partialfl.cli import main
from partialfl.data.federated import DataFormatError


def _folder(root, **arrays):
    from partialfl.data.sources import ArrayOptions, DataContext, folder

    root.mkdir(exist_ok=True)
    np.savez(root / "a.npz", x=np.random.default_rng(0).random((6, 4)), y=np.arange(6) % 3)
    if arrays:
        np.savez(root / "b.npz", **arrays)
    spec = SimpleNamespace(path=str(root), num_clients=None, holdout=0, seed=0,
                           test_fraction=0.25)
    return folder(ArrayOptions(), DataContext(spec))


X4 = np.zeros((4, 3), np.float32)


@pytest.mark.parametrize("arrays, match", [
    (dict(x=X4, y=np.array([0.0, 1.7, 2.2, 0.0])), "whole numbers"),
    (dict(x=X4, y=np.array(["a", "b", "c", "d"])), "integer labels"),
    (dict(x=np.ones((4, 3), np.complex64), y=np.arange(4) % 3), "real numbers"),
    (dict(x=np.zeros((5, 3), np.float32), y=np.arange(4) % 3), "5 rows but 'y' has 4"),
    (dict(x=X4, y=np.array(2)), "integer labels"),
    (dict(x=np.zeros(4, [("a", "f4")]), y=np.arange(4) % 3), "real numbers"),
])
def test_folder_client_arrays_are_checked(tmp_path, arrays, match):
    with pytest.raises(DataFormatError, match=match):
        _folder(tmp_path / "c", **arrays)
    assert _folder(tmp_path / "ok")[0].num_clients == 1  # a good file still loads


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04junk"])
def test_folder_damaged_npz_is_one_error(tmp_path, content):
    root = tmp_path / "c"
    root.mkdir()
    (root / "b.npz").write_bytes(content)
    with pytest.raises(DataFormatError, match="b.npz"):
        _folder(root)


def test_femnist_npz_fifo_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "femnist_leaf_subset.npz")
    code = ("import sys\nfrom partialfl.data.femnist import load_femnist_npz\n"
            "try:\n    load_femnist_npz(sys.argv[1])\n"
            "except ValueError as e:\n    print(type(e).__name__, e)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60,
                             capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail("the FEMNIST loader blocked on a FIFO")
    assert "DataFormatError" in out.stdout and "not a regular file" in out.stdout


def test_hapt_label_past_int64_is_a_format_error(tmp_path):
    from partialfl.data.har import load_hapt

    raw = tmp_path / "RawData"
    raw.mkdir()
    for e in (1, 2):
        for kind in ("acc", "gyro"):
            (raw / f"{kind}_exp0{e}_user01.txt").write_text("0.1 0.2 0.3\n" * 300)
    (raw / "labels.txt").write_text("1 1 1 0 200\n2 1 1 0 " + "9" * 30 + "\n")
    with pytest.raises(DataFormatError, match="line 2"):
        load_hapt(tmp_path)


def _leaf(root, text: str):
    from partialfl.data.leaf import load_leaf_femnist

    for split in ("train", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        (root / split / "a.json").write_text(text)
    return load_leaf_femnist(root)


def test_leaf_deep_json_is_a_format_error(tmp_path):
    with pytest.raises(DataFormatError, match="nested too deeply"):
        _leaf(tmp_path, "[" * 100_000 + "]" * 100_000)


def test_leaf_pixels_given_as_text_are_refused(tmp_path):
    user = {"x": [["0.5"] * 784] * 2, "y": [1, 2]}
    obj = {"users": ["u"], "num_samples": [2], "user_data": {"u": user}}
    with pytest.raises(DataFormatError, match="non-numeric"):
        _leaf(tmp_path, json.dumps(obj))
    user["x"] = [[0.5] * 784] * 2
    assert _leaf(tmp_path, json.dumps(obj)).num_clients == 1


def test_deeply_nested_set_value_is_one_line(tmp_path, capsys):
    from test_adversarial import _LS

    cfg = tmp_path / "c.toml"
    cfg.write_text(_LS)
    deep = "[" * 5000 + "]" * 5000
    assert main(["train", str(cfg), "--dry-run", "--set", f"x={deep}"]) == 2
    assert "nested too deeply" in capsys.readouterr().err
