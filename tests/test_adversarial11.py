"""Adversarial round 11 (issue 21): regression tests for what the eleventh independent round
found (a reviewer who did not write the fixes), in the data store and the files partialfl
reads and writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from partialfl.data.store import StoreWriter, open_store


def _write(path: Path, overwrite: bool = False) -> None:
    with StoreWriter(path, num_classes=2, overwrite=overwrite) as w:
        w.add("a", np.zeros((2, 3), np.float32), np.zeros(2, np.int64),
              np.zeros((1, 3), np.float32), np.zeros(1, np.int64))


def test_overwrite_never_deletes_a_folder_that_is_not_a_store(tmp_path):
    """``StoreWriter(overwrite=True)`` (``partialfl data convert ... --overwrite``) moved
    whatever ``path`` named aside and ``rmtree``-d it: a user's folder given as ``--out`` lost
    all its files, and a plain file there was left behind as ``.NAME.old-…``. Now only a
    client store (or an empty folder) is replaced; anything else is refused, untouched, in
    one line, and the CLI exits 2 naming it."""
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.txt").write_text("irreplaceable")
    with pytest.raises(FileExistsError, match="not a client store"):
        _write(mine, overwrite=True)
    assert (mine / "chapter1.txt").read_text() == "irreplaceable"
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    with pytest.raises(FileExistsError, match="not a folder"):
        _write(afile, overwrite=True)
    assert afile.read_text() == "mine"
    store = tmp_path / "store"
    _write(store)
    link = tmp_path / "link"
    link.symlink_to(store)
    with pytest.raises(FileExistsError, match="symlink"):
        _write(link, overwrite=True)
    assert link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "notes.txt", "store",
                                                          "thesis"]
    _write(store, overwrite=True)  # a store, and an empty folder, are still replaced
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty", overwrite=True)
    assert open_store(tmp_path / "empty").num_clients == 1
    leaf = tmp_path / "all_data"
    leaf.mkdir()
    users = {f"u{i}": {"x": [[0.5] * 784] * 4, "y": [i, 1, 2, 3]} for i in range(3)}
    (leaf / "d.json").write_text(json.dumps({"users": list(users), "num_samples": [4] * 3,
                                             "user_data": users}))
    r = subprocess.run([sys.executable, "-m", "partialfl", "data", "convert", "leaf-json",
                        str(leaf), str(mine), "--overwrite", "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert (mine / "chapter1.txt").read_text() == "irreplaceable"
    assert r.returncode == 2 and "not a client store" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "partialfl", "data", "convert", "leaf-json",
                        str(leaf), str(store), "--overwrite", "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and open_store(store).num_clients == 3, r.stderr
