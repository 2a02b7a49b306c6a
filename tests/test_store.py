"""The on-disk client store: round trip, lazy ModelProblem path, corruption, atomicity,
client state on disk."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _nn_toy import max_diff, one_thread, toy_data, toy_model
from conftest import SMALL

from partialfl.algorithms import Scaffold
from partialfl.algorithms.disk_state import OnDiskClientState
from partialfl.algorithms.model import FedAlt, FedAvg, FedSim, model_ffgg
from partialfl.data.client_state import ClientStateStore
from partialfl.data.federated import FederatedDataset
from partialfl.data.store import (
    ClientStore,
    StoreDataset,
    StoreError,
    StoreSplit,
    StoreWriter,
    open_store,
    write_store,
)
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.problems.model import ModelProblem
from partialfl.runtime import BatchedBackend, SequentialBackend, run_rounds
from partialfl.server import SGD
from partialfl.split import make_split


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _data():
    d = toy_data(num_clients=6, seed=3)
    # one client without test examples, and array-valued meta
    tx, ty = list(d.test_x), list(d.test_y)
    tx[2], ty[2] = tx[2][:0], ty[2][:0]
    return FederatedDataset(d.train_x, d.train_y, tx, ty, d.client_ids, d.num_classes,
                            "toy", {"pixel_mean": np.arange(4.0), "normalize": "emnist"})


def _same(a, b):
    assert a.num_clients == b.num_clients and list(a.client_ids) == list(b.client_ids)
    assert a.num_classes == b.num_classes
    for f in ("train_x", "train_y", "test_x", "test_y"):
        for m in range(a.num_clients):
            u, v = getattr(a, f)[m], getattr(b, f)[m]
            assert u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v), (f, m)


def test_round_trip_and_dataset_queries(tmp_path):
    d = _data()
    ds = open_store(write_store(tmp_path / "s", d))
    assert isinstance(ds, StoreDataset)
    _same(ds, d)
    _same(ds.to_memory(), d)
    assert np.array_equal(ds.train_sizes(), d.train_sizes())
    assert np.array_equal(ds.test_sizes(), d.test_sizes())
    assert np.array_equal(ds.meta["pixel_mean"], np.arange(4.0))
    assert ds.meta["normalize"] == "emnist" and ds.description == "toy"
    assert ds.index_of("c4") == 4 and ds.summary() == d.summary()
    for u, v in zip(ds.pooled("test"), d.pooled("test")):
        assert torch.equal(u, v)
    _same(ds.subset([4, 0, 2]), d.subset([4, 0, 2]))
    assert ds.subset([4, 0, 2]).index_of("c0") == 1
    for a, b in zip(ds.split_clients(2, seed=1), d.split_clients(2, seed=1)):
        _same(a, b)
    with pytest.raises(KeyError, match="c99"):
        ds.index_of("c99")
    with pytest.raises(ValueError, match="repeat"):
        ds.subset([1, 1])
    ClientStore(tmp_path / "s").verify()
    import pickle

    blob = pickle.dumps(ds.subset([4, 0]))  # by reference: the folder, not the data
    assert len(blob) < 2000
    _same(pickle.loads(blob), d.subset([4, 0]))


def test_uint8_store_with_scale(tmp_path):
    rng = np.random.default_rng(0)
    with StoreWriter(tmp_path / "u", num_classes=3, x_scale=1 / 255) as w:
        for m in range(3):
            x = rng.integers(0, 256, (4, 1, 2, 2), dtype=np.uint8)
            w.add(f"w{m}", x, np.zeros(4, np.int64), x[:1], np.ones(1, np.int64))
    ds = open_store(tmp_path / "u")
    x = ds.train_x[1]
    assert x.dtype == torch.float32 and float(x.max()) <= 1.0
    raw = ClientStore(tmp_path / "u").fields["train_x"]
    assert raw.dtype == np.uint8 and np.allclose(x.numpy(), raw[4:8] / 255, atol=0, rtol=1e-6)


@pytest.mark.parametrize("vectorize", [True, False])
def test_model_problem_from_the_store_matches_memory(tmp_path, vectorize):
    d = _data()
    ds = open_store(write_store(tmp_path / "s", d))
    split = make_split(toy_model(0), "output")
    mem = ModelProblem(split, d, vectorize=vectorize, chunk=4)
    disk = ModelProblem(split, ds, vectorize=vectorize, chunk=4)
    assert isinstance(disk._store["train"], StoreSplit)  # nothing concatenated in memory
    cohort = np.array([5, 1, 2])
    theta = mem.init_theta()
    w = mem.init_w(cohort, "random", 0, 0)
    assert np.array_equal(mem.loss(cohort, theta, w), disk.loss(cohort, theta, w))
    assert max_diff(mem.grad_theta(cohort, theta, w), disk.grad_theta(cohort, theta, w)) == 0
    for k, v in mem.metric_counts(cohort, theta, w).items():
        assert np.array_equal(v, disk.metric_counts(cohort, theta, w)[k]), k
    batches = [np.array([0, 3]), None, np.array([0])]
    g1, l1 = mem.minibatch_grads(cohort, theta, w, batches, "both")
    g2, l2 = disk.minibatch_grads(cohort, theta, w, batches, "both")
    assert max_diff(g1, g2) == 0 and torch.equal(l1, l2)


@pytest.mark.parametrize("name", ["ffgg", "fedavg", "fedalt"])
def test_training_from_the_store_is_identical(tmp_path, name):
    d = _data()
    ds = open_store(write_store(tmp_path / "s", d))
    cfg = SGDConfig(lr=0.2, batch_size=4)
    make, kind = {"ffgg": (lambda: model_ffgg(cfg, server_opt=SGD(0.5)), "output"),
                  "fedavg": (lambda: FedAvg(cfg), "none"),
                  "fedalt": (lambda: FedAlt(cfg), "output")}[name]
    out = []
    for data in (d, ds):
        pb = ModelProblem(make_split(toy_model(0), kind), data, vectorize=False)
        out.append(run_rounds(pb, make(), 3, clients_per_round=3, seed=1,
                              backend=SequentialBackend(), evaluate=round_evaluator(),
                              eval_every=3))
    assert max_diff(out[0].state.theta, out[1].state.theta) == 0
    assert out[0].history[-1]["test_acc"] == out[1].history[-1]["test_acc"]


def test_truncated_or_corrupt_files_are_named(tmp_path):
    path = write_store(tmp_path / "s", _data())
    f = path / "train_x.bin"
    raw = f.read_bytes()
    f.write_bytes(raw[:-8])
    with pytest.raises(StoreError, match="train_x.bin.*truncated"):
        open_store(path)
    f.write_bytes(raw[:8] + bytes([raw[8] ^ 0xFF]) + raw[9:])
    with pytest.raises(StoreError, match="train_x.bin.*CRC"):  # same size: the CRC sees it
        open_store(path)
    f.write_bytes(raw)
    off = path / "test_offsets.bin"
    ob = off.read_bytes()
    off.write_bytes(ob[:8] + bytes([ob[8] ^ 0x01]) + ob[9:])
    with pytest.raises(StoreError, match="test_offsets.bin.*CRC"):
        open_store(path)
    off.write_bytes(ob)
    (path / "client_ids.bin").unlink()
    with pytest.raises(StoreError, match="client_ids.bin.*missing"):
        open_store(path)
    (path / "header.json").write_text("{not json")
    with pytest.raises(StoreError, match="header.json.*corrupt"):
        open_store(path)
    h = tmp_path / "v" / "header.json"
    h.parent.mkdir()
    h.write_text(json.dumps({"format": "partialfl-client-store", "version": 99}))
    with pytest.raises(StoreError, match="version 99"):
        open_store(h.parent)


def test_conversion_is_atomic(tmp_path):
    d = _data()
    target = tmp_path / "s"
    with pytest.raises(RuntimeError, match="boom"):
        with StoreWriter(target, num_classes=d.num_classes) as w:
            w.add("a", d.train_x[0], d.train_y[0], d.test_x[0], d.test_y[0])
            raise RuntimeError("boom")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    # a writer killed before close (no cleanup at all): only a hidden temp folder, no store
    w = StoreWriter(target, num_classes=d.num_classes)
    w.add("a", d.train_x[0], d.train_y[0], d.test_x[0], d.test_y[0])
    assert not target.exists()
    with pytest.raises(StoreError, match="header.json.*missing"):
        open_store(w.tmp)
    w.abort()
    # overwriting keeps the old store until the new one is complete
    write_store(target, d)
    with pytest.raises(FileExistsError):
        write_store(target, d)
    write_store(target, d.subset([0, 1]), overwrite=True)
    assert open_store(target).num_clients == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_writer_refuses_bad_clients(tmp_path):
    w = StoreWriter(tmp_path / "s", num_classes=3)
    x = np.zeros((2, 4), np.float32)
    w.add("a", x, np.zeros(2, np.int64), x, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="duplicate client id 'a'"):
        w.add("a", x, np.zeros(2, np.int64), x, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="'b'.*first client"):
        w.add("b", np.zeros((2, 5), np.float32), np.zeros(2, np.int64), x, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="labels outside 0..2"):
        w.add("c", x, np.full(2, 3), x, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="non-finite"):
        w.add("d", x + np.nan, np.zeros(2, np.int64), x, np.zeros(2, np.int64))
    w.abort()


def test_client_state_store_get_put(tmp_path):
    calls = []

    def init(c):
        calls.append(np.asarray(c).copy())
        return {"w": torch.arange(3.0).repeat(len(c), 1) + torch.as_tensor(c)[:, None]}

    st = ClientStateStore(tmp_path / "cs", 1000, init)
    rows = st.get([7, 2])["w"]
    assert torch.equal(rows, torch.tensor([[7.0, 8, 9], [2, 3, 4]]))
    st.put([2], {"w": torch.full((1, 3), -1.0)})
    st["w"][np.array([9])] = torch.full((1, 3), 5.0)
    assert torch.equal(st["w"][np.array([2, 9, 7])],
                       torch.tensor([[-1.0, -1, -1], [5, 5, 5], [7, 8, 9]]))
    assert np.array_equal(calls[-1], [7])  # only the unwritten row was initialised
    assert st["w"].shape == (1000, 3) and torch.equal(st["w"][3], torch.tensor([3.0, 4, 5]))
    with pytest.raises(ValueError, match="shape"):
        st.put([1], {"w": torch.zeros(1, 4)})
    with pytest.raises(ValueError, match="non-finite"):
        st.put([1], {"w": torch.full((1, 3), float("inf"))})
    with pytest.raises(KeyError, match="'v'"):
        st["v"]
    import pickle

    with pytest.raises(TypeError, match="cannot be pickled.*checkpoint"):
        pickle.dumps(st)


@pytest.mark.parametrize("name", ["fedalt", "fedsim"])
def test_stateful_model_baselines_with_state_on_disk_are_identical(tmp_path, name):
    cfg = SGDConfig(lr=0.2, batch_size=4)
    make = {"fedalt": lambda: FedAlt(cfg, w_init="random"), "fedsim": lambda: FedSim(cfg)}[name]
    d = toy_data()
    out = []
    for alg in (make(), OnDiskClientState(make(), tmp_path / "state")):
        for backend in (BatchedBackend(), SequentialBackend()):
            pb = ModelProblem(make_split(toy_model(0), "output"), d,
                              vectorize=isinstance(backend, BatchedBackend))
            out.append(run_rounds(pb, alg, 3, clients_per_round=3, seed=2, backend=backend,
                                  evaluate=round_evaluator(), eval_every=3))
    mem, disk = out[1], out[3]  # sequential, bit-exact comparison
    assert max_diff(mem.state.theta, disk.state.theta) == 0
    assert mem.history[-1]["test_acc"] == disk.history[-1]["test_acc"]
    for n in mem.client_state:
        assert torch.equal(disk.client_state[n][np.arange(d.num_clients)], mem.client_state[n])
    assert max_diff(out[0].state.theta, out[2].state.theta) == 0


def test_scaffold_with_state_on_disk_is_identical(tmp_path):
    pb = LeastSquaresProblem(SMALL, basis="standard")
    a = run_rounds(pb, Scaffold(5), 6, clients_per_round=2, seed=1)
    b = run_rounds(pb, OnDiskClientState(Scaffold(5), tmp_path / "sc"), 6, clients_per_round=2,
                   seed=1)
    for n in a.state.theta:
        assert np.array_equal(a.state.theta[n], b.state.theta[n])
    for n in ("c_theta", "c_w"):
        rows = b.client_state[n][np.arange(SMALL.num_clients)]
        assert isinstance(rows, np.ndarray) and np.array_equal(rows, a.client_state[n])
    assert np.abs(a.client_state["c_theta"]).sum() > 0
