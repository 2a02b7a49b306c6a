"""FederatedDataset container and the LEAF json, TFF EMNIST h5 and GLDv2 loaders.

Every loader is run on small files written here in the exact real format.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from partialfl.data import (
    DataFormatError,
    DataNotFoundError,
    FederatedDataset,
    load_gldv2,
    load_leaf_femnist,
    load_tff_emnist_h5,
)
from partialfl.data.gldv2 import IMAGENET_MEAN, IMAGENET_STD


def _h5py():
    return pytest.importorskip("h5py", reason="the TFF EMNIST loader needs h5py")


def _pil_image():
    return pytest.importorskip("PIL.Image", reason="the GLDv2 loader needs Pillow")


# ============================================================== FederatedDataset
def _flat(seed=0, m=4, n_tr=30, n_te=9):
    rng = np.random.default_rng(seed)
    return dict(
        train_x=rng.normal(size=(n_tr, 3)).astype(np.float32),
        train_y=rng.integers(0, 5, n_tr),
        train_client=rng.integers(0, m, n_tr),
        test_x=rng.normal(size=(n_te, 3)).astype(np.float32),
        test_y=rng.integers(0, 5, n_te),
        test_client=rng.integers(0, m, n_te),
        client_ids=[f"c{i}" for i in range(m)],
        num_classes=5,
    )


def test_from_arrays_groups_like_brute_force():
    a = _flat()
    ds = FederatedDataset.from_arrays(**a, description="toy", meta={"k": 1})
    assert ds.num_clients == 4 and ds.client_ids == ("c0", "c1", "c2", "c3")
    for split in ("train", "test"):
        for m in range(4):
            rows = [i for i in range(len(a[f"{split}_y"])) if a[f"{split}_client"][i] == m]
            x, y = ds.client(m, split)
            np.testing.assert_array_equal(x.numpy(), a[f"{split}_x"][rows])
            np.testing.assert_array_equal(y.numpy(), a[f"{split}_y"][rows])
            assert y.dtype == torch.int64
    np.testing.assert_array_equal(ds.train_sizes(), np.bincount(a["train_client"], minlength=4))
    x, y, owner = ds.pooled("test")
    assert x.shape == (9, 3) and owner.tolist() == sorted(a["test_client"].tolist())
    assert "4 clients, 30 train / 9 test" in ds.summary() and "toy" in ds.summary()


def test_client_folds_cover_every_client_once():
    ds = FederatedDataset.from_arrays(**_flat(m=10, n_tr=100))
    folds = ds.client_folds(3, seed=2)
    assert [len(f) for f in folds] == [4, 3, 3]
    assert sorted(np.concatenate(folds).tolist()) == list(range(10))
    assert all(list(f) == sorted(f) for f in folds)
    assert all((a == b).all() for a, b in zip(folds, ds.client_folds(3, seed=2)))
    assert any((a != b).any() for a, b in zip(folds, ds.client_folds(3, seed=3)))
    for bad in (1, 11, 2.5):
        with pytest.raises(ValueError, match="folds must be an integer in 2..10"):
            ds.client_folds(bad, seed=0)


def test_subset_and_split_clients():
    ds = FederatedDataset.from_arrays(**_flat(m=10, n_tr=100), meta={"k": 1})
    sub = ds.subset([7, 2])
    assert sub.client_ids == ("c7", "c2") and sub.meta == {"k": 1}
    assert torch.equal(sub.train_x[0], ds.train_x[7])
    seen, new = ds.split_clients(0.3, seed=5)
    assert new.num_clients == 3 and seen.num_clients == 7
    assert set(seen.client_ids) | set(new.client_ids) == set(ds.client_ids)
    assert not set(seen.client_ids) & set(new.client_ids)
    assert list(seen.client_ids) == sorted(seen.client_ids)  # original relative order kept
    again, _ = ds.split_clients(0.3, seed=5)
    assert again.client_ids == seen.client_ids
    others = {ds.split_clients(3, seed=s)[1].client_ids for s in range(8)}
    assert len(others) > 1  # the seed matters
    assert ds.index_of("c4") == 4
    with pytest.raises(KeyError, match="zz"):
        ds.index_of("zz")
    with pytest.raises(ValueError, match="no client on one side"):
        ds.split_clients(10, seed=0)
    with pytest.raises(ValueError, match="fraction"):
        ds.split_clients(1.5, seed=0)
    with pytest.raises(IndexError, match="outside"):
        ds.subset([11])
    with pytest.raises(ValueError, match="repeat"):
        ds.subset([1, 1])
    with pytest.raises(ValueError, match="'train' or 'test'"):
        ds.pooled("val")  # type: ignore[arg-type]


def test_container_accepts_token_sequences_and_validates():
    g = torch.Generator().manual_seed(0)
    x = [torch.randint(0, 30, (n, 8), generator=g) for n in (3, 0)]
    y = [torch.randint(0, 30, (n, 8), generator=g) for n in (3, 0)]
    y[0][0, 0] = 29  # a label >= 10 for the range check below
    ds = FederatedDataset(x, y, x, y, ["a", "b"], num_classes=30)
    assert ds.train_sizes().tolist() == [3, 0]
    good = dict(train_x=x, train_y=y, test_x=x, test_y=y, client_ids=["a", "b"], num_classes=30)
    bad = {
        "int64": dict(good, train_y=[t.int() for t in y]),
        "share the first": dict(good, test_x=[x[0][:2], x[1]]),
        "unique": dict(good, client_ids=["a", "a"]),
        "outside 0..9": dict(good, num_classes=10),
        "per-example shape": dict(good, test_x=[x[0][:, :4], x[1][:, :4]]),
        "entries": dict(good, train_x=x[:1]),
    }
    for msg, kw in bad.items():
        with pytest.raises((ValueError, TypeError), match=msg):
            FederatedDataset(**kw)


# ============================================================== LEAF json
def _img(rng, n):
    return np.round(rng.uniform(0, 1, size=(n, 784)), 3)


def _leaf_file(path, users: dict[str, tuple[np.ndarray, list[int]]], extra_empty=()):
    data = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x.tolist(), "y": list(y)} for u, (x, y) in users.items()},
    }
    for u in extra_empty:  # LEAF's split script leaves dropped users with empty lists
        data["user_data"][u] = {"x": [], "y": []}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_leaf_train_test_folders(tmp_path):
    rng = np.random.default_rng(0)
    tr = {"f0001_10": (_img(rng, 4), [0, 61, 5, 5]), "f0002_20": (_img(rng, 2), [9, 10]),
          "f0003_30": (_img(rng, 3), [1, 2, 3])}
    te = {"f0001_10": (_img(rng, 1), [7]), "f0002_20": (_img(rng, 2), [36, 35]),
          "f0003_30": (_img(rng, 1), [4])}
    # users spread over two files, as LEAF writes them
    _leaf_file(tmp_path / "train" / "all_data_0_niid_05_keep_0_train_9.json",
               dict(list(tr.items())[:2]), extra_empty=["f0009_99"])
    _leaf_file(tmp_path / "train" / "all_data_1_niid_05_keep_0_train_9.json",
               dict(list(tr.items())[2:]))
    _leaf_file(tmp_path / "test" / "all_data_0_niid_05_keep_0_test_9.json", te)
    ds = load_leaf_femnist(tmp_path, normalize="leaf")
    assert ds.client_ids == ("f0001_10", "f0002_20", "f0003_30") and ds.num_classes == 62
    for m, u in enumerate(ds.client_ids):
        for split, src in (("train", tr), ("test", te)):
            x, y = ds.client(m, split)
            assert x.shape == (len(src[u][1]), 1, 28, 28) and x.dtype == torch.float32
            np.testing.assert_allclose(x.reshape(len(y), 784).numpy(), src[u][0], atol=1e-6)
            assert y.tolist() == src[u][1]
    inv = load_leaf_femnist(tmp_path, normalize="inverted")
    torch.testing.assert_close(inv.train_x[0], 1 - ds.train_x[0])


def test_leaf_unsplit_folder_uses_leafs_by_sample_rule(tmp_path):
    rng = np.random.default_rng(1)
    users = {"a": (_img(rng, 10), list(range(10))), "b": (_img(rng, 2), [3, 4]),
             "c": (_img(rng, 1), [5])}
    _leaf_file(tmp_path / "all_data" / "all_data_0.json", users)
    ds = load_leaf_femnist(tmp_path, train_fraction=0.9, seed=3)
    assert ds.client_ids == ("a", "b")  # c has < 2 examples: dropped, like LEAF
    assert ds.train_sizes().tolist() == [9, 1] and ds.test_sizes().tolist() == [1, 1]
    for m, u in enumerate(ds.client_ids):  # the split is a partition of the user's examples
        labels = sorted(ds.train_y[m].tolist() + ds.test_y[m].tolist())
        assert labels == sorted(users[u][1])
    same = load_leaf_femnist(tmp_path / "all_data", train_fraction=0.9, seed=3)
    assert torch.equal(same.test_y[0], ds.test_y[0])
    held = {int(load_leaf_femnist(tmp_path, seed=s).test_y[0]) for s in range(10)}
    assert len(held) > 1


def test_leaf_errors(tmp_path):
    with pytest.raises(DataNotFoundError, match="does not exist"):
        load_leaf_femnist(tmp_path / "nope")
    with pytest.raises(DataNotFoundError, match="no LEAF json"):
        load_leaf_femnist(tmp_path)
    f = tmp_path / "all_data" / "all_data_0.json"
    f.parent.mkdir()
    f.write_text('{"users": ["a"], "num_samples": [1], "user_da')
    with pytest.raises(DataFormatError, match="(?i)not valid json"):
        load_leaf_femnist(tmp_path)
    f.write_text(json.dumps({"users": ["a"], "user_data": {}}))
    with pytest.raises(DataFormatError, match=r"missing key\(s\) \['num_samples'\]"):
        load_leaf_femnist(tmp_path)
    rng = np.random.default_rng(0)
    good = {"a": (_img(rng, 3), [1, 2, 3])}
    _leaf_file(f, good)
    data = json.loads(f.read_text())
    cases = {
        "num_samples 4": dict(data, num_samples=[4]),
        "784-float": dict(data, user_data={"a": {"x": [[0.5] * 783] * 3, "y": [1, 2, 3]}}),
        "outside 0..61": dict(data, user_data={"a": {"x": data["user_data"]["a"]["x"],
                                                     "y": [1, 2, 62]}}),
        "not in 'user_data'": dict(data, user_data={}),
        "keys 'x' and 'y'": dict(data, user_data={"a": {"x": []}}),
    }
    for msg, d in cases.items():
        f.write_text(json.dumps(d))
        with pytest.raises(DataFormatError, match=msg):
            load_leaf_femnist(tmp_path)


# ============================================================== TFF EMNIST h5
def _h5(path, clients: dict[str, tuple[np.ndarray, np.ndarray]]):
    with _h5py().File(path, "w") as f:
        ex = f.create_group("examples")
        for cid, (x, y) in clients.items():
            g = ex.create_group(cid)
            g.create_dataset("pixels", data=x.astype(np.float32))
            g.create_dataset("label", data=y.astype(np.int32))


def _tff_clients(rng, ids, n):
    return {c: (rng.uniform(0, 1, (n, 28, 28)), rng.integers(0, 62, n)) for c in ids}


def test_tff_h5_schema_and_grouping(tmp_path):
    rng = np.random.default_rng(0)
    train = _tff_clients(rng, ["f0002_07", "f0000_14", "f0001_41"], 5)  # written unsorted
    test = _tff_clients(rng, ["f0000_14", "f0002_07", "f9999_99"], 2)  # f9999: test only
    _h5(tmp_path / "fed_emnist_train.h5", train)
    _h5(tmp_path / "fed_emnist_test.h5", test)
    ds = load_tff_emnist_h5(tmp_path, normalize="leaf")
    assert ds.client_ids == ("f0000_14", "f0001_41", "f0002_07")  # TFF's sorted order
    assert ds.train_sizes().tolist() == [5, 5, 5] and ds.test_sizes().tolist() == [2, 0, 2]
    for m, c in enumerate(ds.client_ids):
        np.testing.assert_allclose(ds.train_x[m][:, 0].numpy(), train[c][0], atol=1e-6)
        assert ds.train_y[m].tolist() == train[c][1].tolist()
    sub = load_tff_emnist_h5(tmp_path, clients=["f0002_07"])
    assert sub.client_ids == ("f0002_07",) and sub.test_sizes().tolist() == [2]
    first = load_tff_emnist_h5(tmp_path, max_clients=2)
    assert first.client_ids == ("f0000_14", "f0001_41")
    with pytest.raises(KeyError, match="nobody"):
        load_tff_emnist_h5(tmp_path, clients=["nobody"])
    # digits-only files have their own names and 10 classes
    white = np.ones((2, 28, 28))
    _h5(tmp_path / "fed_emnist_digitsonly_train.h5", {"w": (white, np.array([9, 0]))})
    _h5(tmp_path / "fed_emnist_digitsonly_test.h5", {"w": (white[:1], np.array([3]))})
    digits = load_tff_emnist_h5(tmp_path, only_digits=True, normalize="inverted")
    assert digits.num_classes == 10 and float(digits.train_x[0].abs().max()) == 0.0


def test_tff_h5_errors(tmp_path):
    h5py = _h5py()
    with pytest.raises(DataNotFoundError, match="fed_emnist_train.h5"):
        load_tff_emnist_h5(tmp_path)
    rng = np.random.default_rng(0)
    _h5(tmp_path / "fed_emnist_test.h5", _tff_clients(rng, ["a"], 1))
    train = tmp_path / "fed_emnist_train.h5"
    train.write_bytes(b"\x89HDF\r\n\x1a\n garbage, truncated")
    with pytest.raises(DataFormatError, match="not a readable HDF5"):
        load_tff_emnist_h5(tmp_path)
    with h5py.File(train, "w") as f:
        f.create_group("data").create_group("a")
    with pytest.raises(DataFormatError, match="no top-level group 'examples'"):
        load_tff_emnist_h5(tmp_path)
    with h5py.File(train, "w") as f:
        f.create_group("examples/a").create_dataset("pixels", data=np.ones((1, 28, 28)))
    with pytest.raises(DataFormatError, match=r"missing dataset\(s\) \['label'\]"):
        load_tff_emnist_h5(tmp_path)
    _h5(train, {"a": (np.ones((2, 32, 32)), np.array([1, 2]))})
    with pytest.raises(DataFormatError, match=r"\[n, 28, 28\]"):
        load_tff_emnist_h5(tmp_path)
    _h5(train, {"a": (np.ones((2, 28, 28)), np.array([1]))})
    with pytest.raises(DataFormatError, match="2 images but 1 labels"):
        load_tff_emnist_h5(tmp_path)
    _h5(train, {"a": (255 * np.ones((1, 28, 28)), np.array([1]))})
    with pytest.raises(DataFormatError, match=r"outside \[0, 1\]"):
        load_tff_emnist_h5(tmp_path)


# ============================================================== GLDv2
COLORS = {"img_r": (200, 30, 30), "img_g": (20, 180, 40), "img_b": (10, 20, 220),
          "img_w": (250, 250, 250), "img_k": (5, 5, 5)}


def _gld(tmp_path, rows, colors=COLORS):
    img = tmp_path / "images"
    img.mkdir(exist_ok=True)
    for name, c in colors.items():
        _pil_image().new("RGB", (40, 30), c).save(img / f"{name}.jpg", quality=95)
    csv = tmp_path / "federated_train.csv"
    csv.write_text("user_id,image_id,class\n" + "".join(f"{u},{i},{c}\n" for u, i, c in rows))
    return csv, img


def test_gldv2_grouping_split_and_pixels(tmp_path):
    rows = [("7", "img_r", 3), ("12", "img_g", 0), ("7", "img_b", 3), ("7", "img_w", 1),
            ("7", "img_k", 2), ("12", "img_w", 5)]
    csv, img = _gld(tmp_path, rows)
    ds = load_gldv2(csv, img, test_fraction=0.25, seed=0, image_size=16)
    assert ds.client_ids == ("7", "12") and ds.num_classes == 6
    # user 7: 4 images, round(0.25*4) = 1 test; user 12: 2 images, round(0.5) = 0 test
    assert ds.train_sizes().tolist() == [3, 2] and ds.test_sizes().tolist() == [1, 0]
    assert ds.train_x[0].shape == (3, 3, 16, 16) and ds.train_x[0].dtype == torch.float32
    x7 = torch.cat([ds.train_x[0], ds.test_x[0]])
    y7 = torch.cat([ds.train_y[0], ds.test_y[0]])
    assert sorted(y7.tolist()) == [1, 2, 3, 3]
    # every image is a solid colour: each channel equals (c/255 - mean)/std up to JPEG error
    want = {name: (np.array(c) / 255 - IMAGENET_MEAN) / IMAGENET_STD
            for name, c in COLORS.items()}
    got = [x.mean(dim=(1, 2)).numpy() for x in x7]
    for name in ("img_r", "img_b", "img_w", "img_k"):
        assert min(np.abs(g - want[name]).max() for g in got) < 0.1, name
    assert all(float(x.std(dim=(1, 2)).max()) < 0.05 for x in x7)
    sel = load_gldv2(csv, img, clients=["12"], image_size=8, num_classes=2028, test_fraction=0.5)
    assert sel.client_ids == ("12",) and sel.num_classes == 2028
    assert sel.train_sizes().tolist() == [1] and sel.test_sizes().tolist() == [1]
    assert load_gldv2(csv, img, max_clients=1, image_size=8).client_ids == ("7",)


def test_gldv2_errors(tmp_path):
    with pytest.raises(DataNotFoundError, match="does not exist"):
        load_gldv2(tmp_path / "none.csv", tmp_path)
    csv, img = _gld(tmp_path, [("1", "img_r", 0), ("1", "img_missing", 1)])
    with pytest.raises(DataNotFoundError, match="img_missing.jpg"):
        load_gldv2(csv, img, image_size=8)
    ds = load_gldv2(csv, img, image_size=8, missing_images="skip")
    assert ds.train_sizes().tolist() == [1]
    with pytest.raises(DataNotFoundError, match="image folder"):
        load_gldv2(csv, tmp_path / "noimages")
    csv.write_text("user_id,image,class\n1,img_r,0\n")
    with pytest.raises(DataFormatError, match=r"missing column\(s\) \['image_id'\]"):
        load_gldv2(csv, img)
    csv.write_text("user_id,image_id,class\n1,img_r,zero\n")
    with pytest.raises(DataFormatError, match=r":2: class 'zero' is not an integer"):
        load_gldv2(csv, img)
    csv.write_text("user_id,image_id,class\n")
    with pytest.raises(DataFormatError, match="no rows"):
        load_gldv2(csv, img)
    csv.write_text("")
    with pytest.raises(DataFormatError, match="empty"):
        load_gldv2(csv, img)
    csv.write_bytes(b"\xff\xfe\x00\x81binary")
    with pytest.raises(DataFormatError, match="UTF-8"):
        load_gldv2(csv, img)
    (img / "img_bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    csv.write_text("user_id,image_id,class\n1,img_bad,0\n")
    with pytest.raises(DataFormatError, match="img_bad.jpg cannot be decoded"):
        load_gldv2(csv, img)
    csv.write_text("user_id,image_id,class\n1,img_r,7\n")
    with pytest.raises(DataFormatError, match="num_classes"):
        load_gldv2(csv, img, num_classes=5)
    with pytest.raises(KeyError, match="'9'"):
        load_gldv2(csv, img, clients=["9"])
    with pytest.raises(ValueError, match="test_fraction"):
        load_gldv2(csv, img, test_fraction=1.0)
