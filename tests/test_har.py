"""HAPT loader (UCI RawData layout, on small generated files), the 1-D CNN and its splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from partialfl.build import make_model
from partialfl.data import DataFormatError
from partialfl.data.har import channel_mean_std, load_hapt, standardize, window_starts
from partialfl.split import make_split


def _write_session(raw: Path, e: int, u: int, sig: np.ndarray) -> None:
    for kind, cols in (("acc", sig[:, :3]), ("gyro", sig[:, 3:])):
        (raw / f"{kind}_exp{e:02d}_user{u:02d}.txt").write_text(
            "\n".join(" ".join(f"{v:.9e}" for v in row) for row in cols) + "\n")


def _make(tmp_path: Path, labels: list[tuple], sessions: dict[tuple[int, int], int],
          seed: int = 0) -> tuple[Path, dict]:
    """RawData/ with the given (exp, user) → number of samples and label rows; returns the
    root and the signals (sample j of channel c = 10·e + c + sin j + j/10)."""
    raw = tmp_path / "hapt" / "RawData"
    raw.mkdir(parents=True)
    sigs = {}
    for (e, u), n in sessions.items():
        j = np.arange(n)[:, None]
        sig = 10.0 * e + np.arange(6)[None, :] + np.sin(j) + j / 10.0
        _write_session(raw, e, u, sig)
        sigs[(e, u)] = sig
    (raw / "labels.txt").write_text("\n".join(" ".join(map(str, r)) for r in labels) + "\n")
    (tmp_path / "hapt" / "activity_labels.txt").write_text("1 WALKING\n")
    return tmp_path, sigs


def test_window_starts_inclusive_ends():
    assert window_starts(0, 9, 4, 2).tolist() == [0, 2, 4, 6]  # last window 6..9 fits
    assert window_starts(3, 5, 4, 2).tolist() == []  # segment shorter than a window


def test_windows_labels_and_session_split(tmp_path):
    labels = [(1, 3, 1, 0, 19), (1, 3, 4, 20, 29), (1, 3, 8, 30, 45),  # 8: a transition
              (2, 3, 2, 5, 14), (3, 5, 6, 0, 9), (4, 5, 6, 0, 12), (5, 5, 5, 2, 11)]
    root, sigs = _make(tmp_path, labels, {(1, 3): 50, (2, 3): 20, (3, 5): 10, (4, 5): 13,
                                          (5, 5): 12})
    ds = load_hapt(root, window=8, overlap=0.5)
    assert ds.client_ids == ("03", "05") and ds.num_classes == 6
    # subject 3: train = exp 1: segment [0,19] → starts 0,4,8,12; [20,29] → 20 (24+8>30)
    x, y = ds.train_x[0], ds.train_y[0]
    assert y.tolist() == [0, 0, 0, 0, 3] and x.shape == (5, 6, 8)
    np.testing.assert_allclose(x[4].numpy(), sigs[(1, 3)][20:28].T, rtol=1e-6)
    # test = exp 2 (the last session): [5, 14] → 5 only (9+8 = 17 > 15)
    assert ds.test_y[0].tolist() == [1]
    np.testing.assert_allclose(ds.test_x[0][0].numpy(), sigs[(2, 3)][5:13].T, rtol=1e-6)
    # subject 5 has three sessions: train = exp 3 and 4, test = exp 5
    assert ds.train_y[1].tolist() == [5, 5, 5] and ds.test_y[1].tolist() == [4]
    # all 12 activities: the transition segment [30, 45] gives windows at 30, 34, 38
    ds12 = load_hapt(root, window=8, overlap=0.5, activities="all")
    assert ds12.num_classes == 12 and ds12.train_y[0].tolist()[-3:] == [7, 7, 7]
    # no overlap: step 8
    assert load_hapt(root, window=8, overlap=0.0).train_y[0].tolist() == [0, 0, 3]


def test_reads_the_uci_folder_directly_and_standardises(tmp_path):
    labels = [(1, 1, 1, 0, 39), (2, 1, 2, 0, 39), (3, 2, 3, 0, 39), (4, 2, 1, 0, 39)]
    root, _ = _make(tmp_path, labels, {(1, 1): 40, (2, 1): 40, (3, 2): 40, (4, 2): 40})
    a = load_hapt(root / "hapt", window=16)  # the UCI download's folder holding RawData/
    b = load_hapt(root / "hapt" / "RawData", window=16)
    assert all(torch.equal(u, v) for u, v in zip(a.train_x, b.train_x))
    assert b.num_clients == 2 and b.train_x[0].shape[1:] == (6, 16)
    mean, std = channel_mean_std(b.subset([0]))
    x = torch.cat(list(b.subset([0]).train_x)).double()
    np.testing.assert_allclose(mean, x.mean(dim=(0, 2)).numpy(), rtol=1e-5)
    s = standardize(b, mean, std)
    z = torch.cat(list(s.subset([0]).train_x)).double()
    np.testing.assert_allclose(z.mean(dim=(0, 2)).numpy(), 0, atol=1e-3)
    np.testing.assert_allclose(z.std(dim=(0, 2), unbiased=False).numpy(), 1, atol=1e-3)
    # the held-out client is standardised with the training client's statistics
    np.testing.assert_allclose(s.test_x[1].numpy(), ((b.test_x[1] - torch.tensor(mean)[:, None])
                                                     / torch.tensor(std)[:, None]).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_subject_without_labelled_windows_is_skipped_with_reason(tmp_path):
    labels = [(1, 1, 1, 0, 39), (2, 1, 2, 0, 39), (3, 2, 3, 0, 5), (4, 2, 1, 0, 39),
              (5, 4, 1, 0, 39)]
    root, _ = _make(tmp_path, labels, {(1, 1): 40, (2, 1): 40, (3, 2): 40, (4, 2): 40,
                                       (5, 4): 40})
    ds = load_hapt(root, window=16)
    assert ds.client_ids == ("01",)
    assert "no labelled window" in ds.meta["skipped"]["02"]
    assert "single session" in ds.meta["skipped"]["04"]
    with pytest.raises(DataFormatError, match="no subject"):
        load_hapt(root, window=64)


@pytest.mark.parametrize("bad_row, match", [("1.0 2.0", "line 3: expected three"),
                                            ("1.0 x 2.0", "line 3: expected three"),
                                            ("1.0 nan 2.0", "line 3: expected three")])
def test_malformed_signal_row(tmp_path, bad_row, match):
    root, _ = _make(tmp_path, [(1, 1, 1, 0, 9), (2, 1, 1, 0, 9)], {(1, 1): 10, (2, 1): 10})
    f = root / "hapt" / "RawData" / "gyro_exp02_user01.txt"
    lines = f.read_text().splitlines()
    lines[2] = bad_row
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=f"gyro_exp02_user01.txt, {match}"):
        load_hapt(root, window=4)


def test_label_errors(tmp_path):
    root, _ = _make(tmp_path, [(1, 1, 1, 0, 10), (2, 1, 1, 0, 9)], {(1, 1): 10, (2, 1): 10})
    with pytest.raises(DataFormatError, match=r"line 1: segment \[0, 10\].*outside "
                                              r"acc_exp01_user01.txt \(10 samples\)"):
        load_hapt(root, window=4)
    lab = root / "hapt" / "RawData" / "labels.txt"
    lab.write_text("1 1 1 0 9\n2 1 1 zero 9\n")
    with pytest.raises(DataFormatError, match="line 2: expected five integers"):
        load_hapt(root, window=4)
    lab.write_text("1 1 1 5 2\n")
    with pytest.raises(DataFormatError, match="start 5 / end 2"):
        load_hapt(root, window=4)
    lab.write_text("1 1 1 0 9\n7 1 1 0 9\n")
    with pytest.raises(DataFormatError, match="experiment 7 of subject 1 has no acc/gyro"):
        load_hapt(root, window=4)
    (root / "hapt" / "RawData" / "gyro_exp02_user01.txt").write_text("1 2 3\n")
    lab.write_text("1 1 1 0 9\n")
    with pytest.raises(DataFormatError, match="10 rows but gyro_exp02_user01.txt has 1"):
        load_hapt(root, window=4)
    with pytest.raises(ValueError, match="activities must be one of"):
        load_hapt(root, activities="basic6")
    with pytest.raises(ValueError, match="overlap"):
        load_hapt(root, overlap=1.0)


def test_har_cnn_shapes_counts_and_splits():
    m = make_model("har_cnn", 6, seed=0)
    assert m(torch.randn(3, 6, 128)).shape == (3, 6)
    assert sum(p.numel() for p in m.parameters()) == 11878
    plain = make_model("har-cnn", 6, seed=0, norm=False)
    assert sum(p.numel() for p in plain.parameters()) == 11686
    assert make_split(m, "input").personal_names == ("conv1.weight", "conv1.bias")
    assert make_split(m, "output").personal_names == ("fc.weight", "fc.bias")
    assert make_split(m, "norm").counts()["personal_params"] == 192
    ad = make_split(m, "adapter", seed=0)
    # conv adapters 32·32+32 and 64·64+64; on the 6 logits a rank-6 adapter 6·6 + 6·6+6
    assert ad.counts()["personal_params"] == 1056 + 4160 + 78
    x = torch.randn(2, 6, 64)
    torch.testing.assert_close(ad.model(x), m(x))  # zero-initialised adapters: same function
