"""The TFF StackOverflow h5 loader, on small files written in TFF's exact schema."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partialfl.data.federated import DataFormatError
from partialfl.data.paths import DataNotFoundError
from partialfl.data.stackoverflow import (
    FEATURES,
    HELD_OUT_FILE,
    TEST_FILE,
    TRAIN_FILE,
    WORD_COUNT_FILE,
    load_stackoverflow,
    load_stackoverflow_held_out,
    load_word_counts,
    select_clients,
)
from partialfl.data.text import BOS, EOS, NUM_SPECIAL, OOV, PAD

h5py = pytest.importorskip("h5py")

WORDS = [f"w{i}" for i in range(40)] + ["?", ".", "how", "do", "i"]


def _sentences(rng, n):
    return [" ".join(rng.choice(WORDS, size=rng.integers(1, 25))) for _ in range(n)]


def _write_client(group, cid, sents, dates=None, rng=None):
    """One client group with TFF's six datasets (vlen byte strings, int64 score)."""
    g = group.create_group(cid)
    n = len(sents)
    s = h5py.string_dtype(encoding="utf-8")
    dates = dates or ["2017-06-01 10:00:00.000 UTC"] * n
    g.create_dataset("creation_date", data=np.array(dates, dtype=object), dtype=s)
    g.create_dataset("score", data=np.arange(n, dtype=np.int64))
    g.create_dataset("tags", data=np.array(["python|numpy"] * n, dtype=object), dtype=s)
    g.create_dataset("title", data=np.array(["how to x"] * n, dtype=object), dtype=s)
    g.create_dataset("tokens", data=np.array(sents, dtype=object), dtype=s)
    g.create_dataset("type", data=np.array(["question", "answer"] * (n // 2) + ["answer"] *
                                           (n % 2), dtype=object), dtype=s)


#: client id -> (train sentences, test sentences); sizes straddle the thresholds used below
SIZES = {"00001": (12, 3), "00002": (11, 2), "00003": (9, 5), "00010": (30, 4),
         "00011": (12, 0), "00020": (15, 1), "00030": (20, 2), "00041": (25, 6)}


@pytest.fixture
def so_dir(tmp_path):
    rng = np.random.default_rng(0)
    data = {}
    with h5py.File(tmp_path / TRAIN_FILE, "w") as ftr, h5py.File(tmp_path / TEST_FILE, "w") as fte:
        gtr, gte = ftr.create_group("examples"), fte.create_group("examples")
        for cid, (ntr, nte) in SIZES.items():
            tr, te = _sentences(rng, ntr), _sentences(rng, nte)
            data[cid] = (tr, te)
            _write_client(gtr, cid, tr)
            if nte:
                _write_client(gte, cid, te)
        _write_client(gte, "99999", _sentences(rng, 4))      # a test-only client
    return tmp_path, data


def test_written_file_has_tff_schema(so_dir):
    d, _ = so_dir
    with h5py.File(d / TRAIN_FILE, "r") as f:
        assert list(f.keys()) == ["examples"]
        g = f["examples"]["00010"]
        assert sorted(g.keys()) == sorted(FEATURES)
        assert g["score"].dtype == np.int64 and isinstance(g["tokens"][0], bytes)


def test_filters_subsample_and_caps(so_dir):
    d, data = so_dir
    tf = load_stackoverflow(d, min_train=10, min_test=2, num_clients=None, max_train=20,
                            vocab_size=30, seq_len=8)
    ds = tf.dataset
    # eligible: >= 10 train and >= 2 test sentences
    eligible = sorted(c for c, (a, b) in SIZES.items() if a >= 10 and b >= 2)
    assert list(ds.client_ids) == eligible == ["00001", "00002", "00010", "00030", "00041"]
    np.testing.assert_array_equal(ds.train_sizes(), [min(SIZES[c][0], 20) for c in eligible])
    np.testing.assert_array_equal(ds.test_sizes(), [SIZES[c][1] for c in eligible])
    # max_train keeps the *first* sentences (TFF's take(n)): check the encoded words
    v = tf.vocab
    m = ds.client_ids.index("00041")
    for row, sent in zip(ds.train_x[m], data["00041"][0][:20]):
        words = sent.split()[:8]
        assert row[0] == BOS
        assert row[1:1 + len(words[:7])].tolist() == v.encode(words[:7])
    # vocabulary: 30 most frequent words of the selected clients' (capped) train sentences
    assert tf.vocab.num_words == 30 and ds.num_classes == 34
    assert tf.stats["vocab_source"].startswith("train sentences")
    # subsample: 3 of the 5 eligible, seeded and sorted; another seed gives another subset
    a = load_stackoverflow(d, min_train=10, min_test=2, num_clients=3, seed=0).dataset
    b = load_stackoverflow(d, min_train=10, min_test=2, num_clients=3, seed=0).dataset
    others = {load_stackoverflow(d, min_train=10, min_test=2, num_clients=3,
                                 seed=s).dataset.client_ids for s in range(1, 6)}
    assert a.client_ids == b.client_ids and len(a.client_ids) == 3
    assert set(a.client_ids) <= set(eligible) and list(a.client_ids) == sorted(a.client_ids)
    assert len(others | {a.client_ids}) > 1


def test_select_clients_is_uniform_without_replacement():
    tr = {f"c{i:03d}": 100 for i in range(50)}
    te = dict.fromkeys(tr, 10)
    picks = [select_clients(tr, te, min_train=100, min_test=10, num_clients=10, seed=s)
             for s in range(200)]
    assert all(len(set(p)) == 10 for p in picks)
    freq = np.array([sum(c in p for p in picks) for c in sorted(tr)]) / 200
    assert abs(freq.mean() - 0.2) < 1e-12 and freq.min() > 0.05 and freq.max() < 0.4


def test_paper_defaults_thresholds(so_dir):
    d, _ = so_dir
    with pytest.raises(ValueError, match=">= 100 train and >= 10 test"):
        load_stackoverflow(d)   # the tiny file has no client with 100 / 10 sentences


def test_word_count_file_sets_vocabulary(so_dir):
    d, _ = so_dir
    (d / WORD_COUNT_FILE).write_text("how 50\ndo 40\ni 30\nw1 20\nw2 10\n")
    assert list(load_word_counts(d / WORD_COUNT_FILE)) == ["how", "do", "i", "w1", "w2"]
    tf = load_stackoverflow(d, min_train=10, min_test=2, num_clients=None, vocab_size=4)
    assert tf.vocab.words == ("how", "do", "i", "w1")
    assert tf.stats["vocab_source"].endswith(WORD_COUNT_FILE)
    ids = torch.cat(tf.dataset.train_x).unique().tolist()
    assert set(ids) <= {PAD, OOV, BOS, EOS} | set(range(NUM_SPECIAL, NUM_SPECIAL + 4))
    (d / "bad.word_count").write_text("how 50\noops\n")
    with pytest.raises(DataFormatError, match="bad.word_count:2"):
        load_word_counts(d / "bad.word_count")


def test_explicit_clients_and_unknown_client(so_dir):
    d, _ = so_dir
    tf = load_stackoverflow(d, clients=["00011", "00003"])
    assert tf.dataset.client_ids == ("00011", "00003")
    assert tf.dataset.test_sizes().tolist() == [0, 5]       # 00011 has no test group
    with pytest.raises(KeyError, match="nobody"):
        load_stackoverflow(d, clients=["nobody"])


def test_missing_paths(tmp_path, so_dir):
    with pytest.raises(DataNotFoundError, match=TRAIN_FILE):
        load_stackoverflow(tmp_path / "empty_dir")
    d, _ = so_dir
    with pytest.raises(FileNotFoundError, match="nope.h5"):
        load_stackoverflow(train_path=d / "nope.h5", test_path=d / TEST_FILE)


def test_wrong_schema_errors(tmp_path, so_dir):
    d, _ = so_dir
    p = tmp_path / "noexamples.h5"
    with h5py.File(p, "w") as f:
        f.create_group("data")
    with pytest.raises(DataFormatError, match="no top-level group 'examples'"):
        load_stackoverflow(train_path=p, test_path=d / TEST_FILE)
    p = tmp_path / "notokens.h5"
    with h5py.File(p, "w") as f:
        f.create_group("examples").create_group("u1").create_dataset("title", data=[b"x"])
    with pytest.raises(DataFormatError, match="no 'tokens' dataset"):
        load_stackoverflow(train_path=p, test_path=d / TEST_FILE)
    p = tmp_path / "numeric.h5"
    with h5py.File(p, "w") as f:
        f.create_group("examples").create_group("u1").create_dataset("tokens",
                                                                     data=np.arange(3))
    with pytest.raises(DataFormatError, match="must hold strings"):
        load_stackoverflow(train_path=p, test_path=d / TEST_FILE)
    p = tmp_path / "notgroup.h5"
    with h5py.File(p, "w") as f:
        f.create_group("examples").create_dataset("u1", data=np.arange(3))
    with pytest.raises(DataFormatError, match="must be a group"):
        load_stackoverflow(train_path=p, test_path=d / TEST_FILE)


def test_corrupt_file(tmp_path, so_dir):
    d, _ = so_dir
    p = tmp_path / "corrupt.h5"
    p.write_bytes(b"this is not an HDF5 file" * 10)
    with pytest.raises(DataFormatError, match="not a readable HDF5"):
        load_stackoverflow(train_path=p, test_path=d / TEST_FILE)
    # a truncated copy of a real file
    good = (d / TRAIN_FILE).read_bytes()
    p.write_bytes(good[: len(good) // 3])
    with pytest.raises(DataFormatError):
        load_stackoverflow(train_path=p, test_path=d / TEST_FILE, min_train=10, min_test=2)


def test_held_out_users_split_by_date(tmp_path, so_dir):
    d, _ = so_dir
    rng = np.random.default_rng(1)
    with h5py.File(tmp_path / HELD_OUT_FILE, "w") as f:
        g = f.create_group("examples")
        for cid, (n_old, n_new) in {"00100": (12, 4), "00200": (5, 9), "00300": (15, 3)}.items():
            dates = (["2016-03-01 00:00:00 UTC"] * n_old + ["2018-02-01 00:00:00 UTC"] * n_new)
            order = rng.permutation(len(dates))
            sents = _sentences(rng, len(dates))
            _write_client(g, cid, [sents[i] for i in order], [dates[i] for i in order])
    vocab = load_stackoverflow(d, min_train=10, min_test=2, num_clients=None).vocab
    tf = load_stackoverflow_held_out(vocab, path=tmp_path / HELD_OUT_FILE, min_train=10,
                                     min_test=3, num_clients=None)
    assert tf.dataset.client_ids == ("00100", "00300")
    assert tf.dataset.train_sizes().tolist() == [12, 15]
    assert tf.dataset.test_sizes().tolist() == [4, 3]
    assert tf.vocab is vocab
