"""FEMNIST npz loader: format, per-writer grouping, normalisations and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partialfl.data import DataFormatError, DataNotFoundError, default_data_dir, load_femnist_npz
from partialfl.data.femnist import FEMNIST_NPZ, normalize_pixels, pixel_mean_std

WRITERS = np.array(["f0000_01", "f0123_45", "f9999_99"])  # numpy '<U8', like the real file


def _fake_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Arrays with the exact keys and dtypes of femnist_leaf_subset.npz, clients interleaved."""
    rng = np.random.default_rng(seed)
    n_tr, n_te = 23, 7
    return {
        "train_x": rng.integers(0, 256, size=(n_tr, 28, 28)).astype(np.uint8),
        "train_y": rng.integers(0, 62, size=n_tr).astype(np.int16),
        "train_client": rng.permutation(np.arange(n_tr) % 3).astype(np.int32),
        "test_x": rng.integers(0, 256, size=(n_te, 28, 28)).astype(np.uint8),
        "test_y": rng.integers(0, 62, size=n_te).astype(np.int16),
        "test_client": (np.arange(n_te)[::-1] % 3).astype(np.int32),
        "writers": WRITERS.copy(),
    }


def _write(tmp_path, arrays) -> None:
    np.savez(tmp_path / FEMNIST_NPZ, **arrays)


@pytest.mark.data
def test_fake_file_matches_real_schema_when_available():
    d = default_data_dir()
    if d is None or not (d / FEMNIST_NPZ).exists():
        pytest.skip("shared FEMNIST npz not available; cannot compare schemas")
    real, fake = np.load(d / FEMNIST_NPZ), _fake_arrays()
    assert sorted(real.files) == sorted(fake)
    for k in fake:
        assert real[k].dtype.kind == fake[k].dtype.kind and real[k].ndim == fake[k].ndim, k
        if k != "writers":
            assert real[k].dtype == fake[k].dtype, k


@pytest.mark.parametrize("normalize", ["leaf", "inverted", "emnist"])
def test_grouping_by_writer_and_normalisation(tmp_path, normalize):
    a = _fake_arrays()
    _write(tmp_path, a)
    ds = load_femnist_npz(tmp_path, normalize=normalize)
    assert ds.client_ids == tuple(WRITERS)
    assert ds.num_classes == 62
    np.testing.assert_array_equal(ds.train_sizes(), np.bincount(a["train_client"], minlength=3))
    np.testing.assert_array_equal(ds.test_sizes(), np.bincount(a["test_client"], minlength=3))
    p_tr = a["train_x"].astype(np.float64) / 255
    mean, std = p_tr.mean(0), p_tr.std(0)
    for split in ("train", "test"):
        for m in range(3):
            x, y = ds.client(m, split)
            rows = np.flatnonzero(a[f"{split}_client"] == m)  # original order inside a writer
            assert x.dtype == torch.float32 and x.shape == (len(rows), 1, 28, 28)
            assert y.dtype == torch.int64
            np.testing.assert_array_equal(y.numpy(), a[f"{split}_y"][rows])
            p = a[f"{split}_x"][rows].astype(np.float64) / 255
            want = {"leaf": p, "inverted": 1 - p,
                    "emnist": (p - mean) / np.maximum(std, 0.1)}[normalize]
            np.testing.assert_allclose(x[:, 0].numpy(), want, atol=2e-5)
    assert ds.meta["normalize"] == normalize
    if normalize == "emnist":
        np.testing.assert_allclose(ds.meta["pixel_mean"], mean, atol=1e-6)
        np.testing.assert_allclose(ds.meta["pixel_std"], std, atol=1e-6)
    else:
        assert ds.meta["pixel_mean"] is None


def test_emnist_stats_come_from_train_only_and_can_be_given(tmp_path):
    a = _fake_arrays()
    _write(tmp_path, a)
    base = load_femnist_npz(tmp_path)  # default is "emnist"
    a2 = dict(a, test_x=np.zeros_like(a["test_x"]))  # changing test pixels must not move stats
    _write(tmp_path, a2)
    ds2 = load_femnist_npz(tmp_path)
    np.testing.assert_array_equal(ds2.meta["pixel_mean"], base.meta["pixel_mean"])
    # given stats override the computed ones: mean 0.5 and std 0.25 everywhere
    stats = (np.full((28, 28), 0.5, np.float32), np.full((28, 28), 0.25, np.float32))
    ds3 = load_femnist_npz(tmp_path, pixel_stats=stats)
    x, _ = ds3.client(0, "train")
    rows = np.flatnonzero(a["train_client"] == 0)
    want = (a["train_x"][rows] / 255 - 0.5) / 0.25
    np.testing.assert_allclose(x[:, 0].numpy(), want, atol=1e-5)


def test_std_floor_bounds_constant_pixels():
    x = np.ones((5, 2, 2), np.float32)
    x[:, 0, 0] = np.linspace(0, 1, 5)
    stats = pixel_mean_std(x)
    assert stats[1][1, 1] == 0
    test = np.zeros((1, 2, 2), np.float32)  # ink where training was always white
    out = normalize_pixels(test, "emnist", stats, min_std=0.1)
    assert out[0, 1, 1] == pytest.approx(-10.0)
    with pytest.raises(ValueError, match="unknown normalize"):
        normalize_pixels(test, "zscore", stats)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs stats"):
        normalize_pixels(test, "emnist")


def test_errors(tmp_path):
    with pytest.raises(DataNotFoundError, match=FEMNIST_NPZ):
        load_femnist_npz(tmp_path)
    a = _fake_arrays()
    _write(tmp_path, a)
    with pytest.raises(ValueError, match="unknown normalize.*leaf"):
        load_femnist_npz(tmp_path, normalize="zscore")  # type: ignore[arg-type]
    (tmp_path / FEMNIST_NPZ).write_bytes(b"PK\x03\x04 this is not really a zip file")
    with pytest.raises(DataFormatError, match="not a readable npz"):
        load_femnist_npz(tmp_path)
    bad_cases = {
        "missing key": ({k: v for k, v in a.items() if k != "test_client"}, "test_client"),
        "float pixels": (dict(a, train_x=a["train_x"].astype(np.float32)), "uint8"),
        "bad image size": (dict(a, test_x=a["test_x"][:, :27]), r"\[N, 28, 28\]"),
        "label range": (dict(a, train_y=a["train_y"] + 62), "outside 0..61"),
        "client range": (dict(a, test_client=a["test_client"] + 3), "writers"),
        "length": (dict(a, train_y=a["train_y"][:-1]), "train_y"),
    }
    for case, (arrays, msg) in bad_cases.items():
        _write(tmp_path, arrays)
        with pytest.raises(DataFormatError, match=msg):
            load_femnist_npz(tmp_path)
        print("ok", case)


@pytest.mark.data
def test_real_femnist_subset():
    d = default_data_dir()
    if d is None or not (d / FEMNIST_NPZ).exists():
        pytest.skip(f"{FEMNIST_NPZ} not found (set PARTIALFL_DATA_DIR to ../shared/data)")
    ds = load_femnist_npz(d, normalize="leaf")
    # the figures documented in shared/data/README.md
    assert ds.num_clients == 84
    assert int(ds.train_sizes().sum()) == 11728 and int(ds.test_sizes().sum()) == 1345
    assert (ds.train_sizes() > 0).all() and (ds.test_sizes() > 0).all()
    x, y, owner = ds.pooled("train")
    assert x.shape == (11728, 1, 28, 28) and x.dtype == torch.float32
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert float(x.mean()) > 0.9  # mostly white background (255 = white)
    assert int(y.min()) >= 0 and int(y.max()) <= 61 and len(torch.unique(y)) > 50
    assert torch.equal(owner, torch.repeat_interleave(torch.arange(84),
                                                      torch.as_tensor(ds.train_sizes())))
    em = load_femnist_npz(d, normalize="emnist")
    xe, _, _ = em.pooled("train")
    # per-pixel standardisation: each pixel's train mean is 0
    assert float(xe.mean(0).abs().max()) < 1e-4
