"""The vectorised store writer (issue 25 item 4): ``add_many`` blocks write the same bytes as
one ``add`` per client; errors still name the client; a failed close leaves nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _nn_toy import toy_data

from partialfl.data.federated import FederatedDataset
from partialfl.data.store import StoreWriter, open_store, write_store


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _clients(n=7, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for m in range(n):
        k, t = int(rng.integers(0, 5)), int(rng.integers(0, 3))
        x = rng.integers(0, 256, (k + t, 1, 3, 3), dtype=np.uint8)
        y = rng.integers(0, 4, k + t)
        out.append((f"c{m}é" if m == 3 else f"c{m}", x[:k], y[:k], x[k:], y[k:]))
    return out


def test_blocks_write_the_same_store_as_one_client_at_a_time(tmp_path):
    clients = _clients()
    with StoreWriter(tmp_path / "one", num_classes=4, x_scale=0.5, meta={"a": 1}) as w:
        for c in clients:
            w.add(*c)
    with StoreWriter(tmp_path / "many", num_classes=4, x_scale=0.5, meta={"a": 1}) as w:
        for part in (clients[:3], [], clients[3:]):  # an empty block too
            cols = [np.concatenate([c[i] for c in part] or [clients[0][i][:0]])
                    for i in range(1, 5)]
            w.add_many([c[0] for c in part], *cols, [len(c[2]) for c in part],
                       [len(c[4]) for c in part])
    assert _files(tmp_path / "one") == _files(tmp_path / "many")
    ds = FederatedDataset(*([torch.from_numpy(c[i]) for c in clients] for i in range(1, 5)),
                          client_ids=[c[0] for c in clients], num_classes=4, meta={"a": 1})
    write_store(tmp_path / "ws", ds, x_scale=0.5)
    assert _files(tmp_path / "one") == _files(tmp_path / "ws")
    assert list(open_store(tmp_path / "ws").client_ids) == [c[0] for c in clients]


class _Data:
    """What write_store reads of a dataset, without FederatedDataset's own checks."""

    def __init__(self, d, **change):
        self.num_clients, self.num_classes = d.num_clients, d.num_classes
        self.client_ids, self.description, self.meta = d.client_ids, "", {}
        for f in ("train_x", "train_y", "test_x", "test_y"):
            setattr(self, f, change.get(f, getattr(d, f)))


def test_write_store_keeps_per_client_checks(tmp_path):
    d = toy_data(num_clients=5, seed=0)
    tx = list(d.train_x)
    tx[3] = tx[3].double()
    with pytest.raises(ValueError, match="client 'c3': train_x has dtype.*the first client has"):
        write_store(tmp_path / "s", _Data(d, train_x=tx))
    ty = list(d.train_y)
    ty[4] = ty[4] + 7
    with pytest.raises(ValueError, match="client 'c4': train_y labels outside 0..4"):
        write_store(tmp_path / "s", _Data(d, train_y=ty))
    ty[4] = ty[4][:-1]
    with pytest.raises(ValueError, match="client 'c4': train x .* and y .* must share"):
        write_store(tmp_path / "s", _Data(d, train_y=ty))
    assert list(tmp_path.iterdir()) == []


def test_add_many_names_the_bad_client(tmp_path):
    w = StoreWriter(tmp_path / "s", num_classes=3)
    x = np.zeros((6, 2), np.float32)
    y = np.zeros(6, np.int64)
    args = (x[:2], y[:2], [2, 2, 2], [1, 0, 1])
    x_bad = x.copy()
    x_bad[4, 1] = np.inf
    with pytest.raises(ValueError, match="client 'c': train_x has non-finite values"):
        w.add_many(["a", "b", "c"], x_bad, y, *args)
    y_bad = y.copy()
    y_bad[3] = 5
    with pytest.raises(ValueError, match="client 'b': train_y labels outside 0..2"):
        w.add_many(["a", "b", "c"], x, y_bad, *args)
    with pytest.raises(ValueError, match="train_x .* must both have sum"):
        w.add_many(["a", "b", "c"], x[:5], y[:5], *args)
    with pytest.raises(ValueError, match="duplicate client id 'b'"):
        w.add_many(["a", "b", "b"], x, y, *args)
    w.add_many(["a", "b", "c"], x, y, *args)
    with pytest.raises(ValueError, match="duplicate client id 'a'"):
        w.add("a", x[:1], y[:1], x[:1], y[:1])
    with pytest.raises(ValueError, match="NUL"):
        w.add("d\x00", x[:1], y[:1], x[:1], y[:1])
    assert w.num_clients == 3
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_meta_that_cannot_be_stored_is_refused(tmp_path):
    with pytest.raises(ValueError, match="meta\\['o'\\] has dtype object"):
        StoreWriter(tmp_path / "s", num_classes=2, meta={"o": np.array([None, 1])})
    with pytest.raises(ValueError, match="finite numbers"):
        StoreWriter(tmp_path / "s", num_classes=2, meta={"nan": float("nan")})
    assert list(tmp_path.iterdir()) == []


def test_a_failed_close_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="at least one client"):
        with StoreWriter(tmp_path / "s", num_classes=2):
            pass
    assert list(tmp_path.iterdir()) == []
