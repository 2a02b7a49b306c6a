"""``partialfl data convert``: every loader's files → a store that loads the same clients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_data_femnist import _fake_arrays, _write
from test_data_loaders import _gld, _h5, _img, _leaf_file, _tff_clients
from test_stackoverflow import so_dir  # noqa: F401  (fixture)
from test_text_data import _write_corpus

from partialfl.cli import main
from partialfl.data.femnist import FEMNIST_NPZ, load_femnist_npz
from partialfl.data.gldv2 import load_gldv2
from partialfl.data.leaf import load_leaf_femnist
from partialfl.data.shakespeare import load_shakespeare
from partialfl.data.stackoverflow import load_stackoverflow
from partialfl.data.store import StoreError, open_store
from partialfl.data.tff_emnist import load_tff_emnist_h5


def _same(a, b):
    assert list(a.client_ids) == list(b.client_ids) and a.num_classes == b.num_classes
    for f in ("train_x", "train_y", "test_x", "test_y"):
        for m in range(a.num_clients):
            assert torch.equal(getattr(a, f)[m], getattr(b, f)[m]), (f, m)


def _convert(*argv):
    assert main(["data", "convert", *map(str, argv), "--no-progress"]) == 0


def test_convert_femnist_npz_keeps_normalisation(tmp_path):
    _write(tmp_path, _fake_arrays())
    _convert("femnist-npz", tmp_path / FEMNIST_NPZ, tmp_path / "store")
    ref = load_femnist_npz(tmp_path)
    got = open_store(tmp_path / "store")
    _same(got, ref)
    assert np.array_equal(got.meta["pixel_mean"], ref.meta["pixel_mean"])


def test_convert_leaf_and_tff(tmp_path):
    rng = np.random.default_rng(0)
    users = {"f1": (_img(rng, 4), [0, 61, 5, 5]), "f2": (_img(rng, 3), [9, 10, 1])}
    _leaf_file(tmp_path / "leaf" / "all_data_0.json", users)
    _convert("leaf-json", tmp_path / "leaf", tmp_path / "s1")
    _same(open_store(tmp_path / "s1"), load_leaf_femnist(tmp_path / "leaf"))
    _h5(tmp_path / "fed_emnist_train.h5", _tff_clients(rng, ["a", "b", "c"], 5))
    _h5(tmp_path / "fed_emnist_test.h5", _tff_clients(rng, ["a", "c"], 2))
    _convert("tff-emnist", tmp_path, tmp_path / "s2", "--max-clients", 2)
    _same(open_store(tmp_path / "s2"), load_tff_emnist_h5(tmp_path, max_clients=2))


def test_convert_text_formats_record_the_vocabulary(tmp_path, so_dir):  # noqa: F811
    p, _ = _write_corpus(tmp_path)
    opts = dict(seq_len=8, min_train=20, min_test=6)
    _convert("shakespeare", p, tmp_path / "sh", *sum((["--option", f"{k}={v}"]
                                                      for k, v in opts.items()), []))
    ref = load_shakespeare(path=p, **opts)
    got = open_store(tmp_path / "sh")
    _same(got, ref.dataset)
    assert got.meta["vocab"] == list(ref.vocab.words) and got.meta["seq_len"] == 8
    d, _ = so_dir
    _convert("stackoverflow", d, tmp_path / "so", "--max-clients", 3, "--option",
             "min_train=10", "--option", "min_test=1")
    ref = load_stackoverflow(d, num_clients=3, min_train=10, min_test=1)
    got = open_store(tmp_path / "so")
    _same(got, ref.dataset)
    assert got.meta["vocab"] == list(ref.vocab.words)


def test_convert_gldv2_and_errors(tmp_path, capsys):
    pytest.importorskip("PIL")
    rows = [("7", "img_r", 3), ("12", "img_g", 0), ("7", "img_b", 3), ("7", "img_w", 1)]
    csv, img = _gld(tmp_path, rows)
    _convert("gldv2", csv, tmp_path / "g", "--images", img, "--option", "image_size=8")
    _same(open_store(tmp_path / "g"), load_gldv2(csv, img, image_size=8))
    assert main(["data", "convert", "gldv2", str(csv), str(tmp_path / "g2")]) == 2
    assert "--images" in capsys.readouterr().err
    assert main(["data", "convert", "gldv2", str(csv), str(tmp_path / "g"), "--images",
                 str(img)]) == 2  # exists, no --overwrite
    # the CLI's own flag, not the Python keyword (it said 'pass overwrite=True')
    assert "exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert main(["data", "convert", "gldv2", str(csv), str(tmp_path / "g3"), "--images",
                 str(img), "--option", "colour=1"]) == 2
    assert "colour" in capsys.readouterr().err
    for opt, says in (("image_size=abc", "wrong type"), ("max_clients=3", "multiple values"),
                      ("image_size=1e999", "wrong type")):  # issue 21: were tracebacks
        assert main(["data", "convert", "gldv2", str(csv), str(tmp_path / "g3"), "--images",
                     str(img), "--option", opt]) == 2, opt
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "g3").exists()
    (tmp_path / "g" / "train_y.bin").write_bytes(b"")
    with pytest.raises(StoreError, match="train_y.bin"):
        open_store(tmp_path / "g")


# ----------------------------------------------------------------------------- cleanup
_KILLED = """
import os, signal, sys
import numpy as np
from partialfl.data.store import StoreWriter
w = StoreWriter(sys.argv[1], num_classes=2)
w.add("a", np.zeros((2, 3), np.float32), np.zeros(2, np.int64), np.zeros((1, 3), np.float32),
      np.zeros(1, np.int64))
os.kill(os.getpid(), signal.SIGKILL)
"""

_TERMINATED = """
import sys, time
from pathlib import Path
import numpy as np
from partialfl.data.convert import convert
from partialfl.registry import register

class Slow(list):
    def __getitem__(self, i):
        if i == 1:
            Path(sys.argv[2]).write_text("writing")
            time.sleep(60)
        return super().__getitem__(i)

class Data:
    num_clients, num_classes, description, meta = 3, 2, "", {}
    client_ids = ["a", "b", "c"]
    train_x = test_x = Slow([np.zeros((2, 3), np.float32)] * 3)
    train_y = test_y = [np.zeros(2, np.int64)] * 3

register("data-format", "slow-test")(lambda opts, ctx: Data())
convert("slow-test", "in", sys.argv[1])
"""


def _env():
    import os
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}, \
        sys.executable


def _left(folder, name="store"):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}."))


def test_a_killed_convert_is_cleaned_up_by_the_next_one(tmp_path):
    import subprocess

    env, py = _env()
    out = tmp_path / "store"
    r = subprocess.run([py, "-c", _KILLED, str(out)], env=env, capture_output=True, timeout=120)
    assert r.returncode == -9
    (tmp_path / ".store.tmp-0123456789ab").mkdir()  # an older writer's leftover (no pid)
    assert len(_left(tmp_path)) == 2 and not out.exists()
    _write(tmp_path, _fake_arrays())
    _convert("femnist-npz", tmp_path / FEMNIST_NPZ, out)
    assert _left(tmp_path) == [] and open_store(out).num_clients == 3


def test_a_live_writer_is_not_cleaned_up(tmp_path):
    d = _fake_arrays()
    _write(tmp_path, d)
    from partialfl.data.store import StoreWriter, clean_stale

    live = StoreWriter(tmp_path / "store", num_classes=62)
    live.add("w", d["train_x"][:2], d["train_y"][:2], d["test_x"][:1], d["test_y"][:1])
    _convert("femnist-npz", tmp_path / FEMNIST_NPZ, tmp_path / "store")
    assert _left(tmp_path) == [live.tmp.name]
    assert clean_stale(tmp_path / "store") == []
    with pytest.raises(FileExistsError, match="appeared while writing"):
        live.close()
    assert _left(tmp_path) == [] and open_store(tmp_path / "store").num_clients == 3


def test_a_writer_killed_mid_swap_keeps_the_old_store(tmp_path):
    from partialfl.data.store import clean_stale

    _write(tmp_path, _fake_arrays())
    _convert("femnist-npz", tmp_path / FEMNIST_NPZ, tmp_path / "store")
    moved = tmp_path / ".store.old-99999999-0123456789ab"  # a dead writer's pid
    (tmp_path / "store").rename(moved)
    assert clean_stale(tmp_path / "store") == [moved]
    assert _left(tmp_path) == [] and open_store(tmp_path / "store").num_clients == 3
    _convert("femnist-npz", tmp_path / FEMNIST_NPZ, tmp_path / "other")
    (tmp_path / "other").rename(moved)  # the new store did land: the old one goes
    assert clean_stale(tmp_path / "store") == [moved] and _left(tmp_path) == []


def test_sigterm_during_a_convert_leaves_nothing(tmp_path):
    import signal
    import subprocess
    import time

    env, py = _env()
    ready = tmp_path / "ready"
    p = subprocess.Popen([py, "-c", _TERMINATED, str(tmp_path / "store"), str(ready)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), p.communicate(timeout=5)
        assert _left(tmp_path) != []  # the writer's temporary folder exists now
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 143
    finally:
        if p.poll() is None:
            p.kill()
    assert _left(tmp_path) == [] and not (tmp_path / "store").exists()
