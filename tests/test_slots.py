"""Arrays between worker processes and their parent through reused shared-memory slots
(:mod:`partialfl.runtime.slots`): the same values, dtypes, shapes and strides as sent, copies
the receiver owns, and no shared-memory hand-over per tensor once the slots exist."""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from _nn_toy import one_thread, toy_data
from test_nn_algorithms import _problem

from partialfl.algorithms.base import RoundContext, ServerState
from partialfl.algorithms.model import FedAvg
from partialfl.local.sgd import SGDConfig
from partialfl.runtime import run_rounds
from partialfl.runtime.clients import ClientCall
from partialfl.runtime.cohort_pool import ProcessBackend
from partialfl.runtime.slots import SLOTS, SlotReader, SlotWriter


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@dataclass(frozen=True)
class Box:
    tree: dict
    note: str = "kept"


def leaves(seed: int) -> Box:
    """Every kind of leaf a message may hold, with values that depend on ``seed``."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 6, generator=g)
    rng = np.random.default_rng(seed)
    big = rng.normal(size=(40, 30))
    return Box({
        "contiguous": torch.randn(3, 5, generator=g),
        "transposed": a.t(),  # dense, not contiguous: clone keeps these strides
        "sliced": a[:, ::2],  # not dense: comes back contiguous, as clone makes it
        "expanded": torch.randn(1, 3, generator=g).expand(4, 3),
        "scalar": torch.tensor(float(seed) + 0.25),
        "empty": torch.zeros(0, 3),
        "bool": torch.rand(5, generator=g) > 0.5,
        "int64": torch.arange(seed, seed + 7),
        "bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "complex": torch.randn(3, generator=g, dtype=torch.complex64),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "np_c": big,
        "np_f": np.asfortranarray(big[:, :20]),
        "np_small": rng.normal(size=3),  # below MIN_NUMPY_BYTES: pickled inline
        "np_object": np.array([{"a": seed}, None], dtype=object),
        "grad": torch.ones(3, requires_grad=True),  # autograd leaf: pickled as torch does
        "nested": [{"x": torch.full((2,), float(seed))}, (np.full(300, seed),)],
    })


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)


def same(a, b) -> None:
    """``a`` and ``b`` are equal bit for bit, leaf by leaf, with the same layout."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.requires_grad == b.requires_grad
        assert a.clone().stride() == b.stride()  # the layout a copy of the sent one has
        assert torch.equal(_bytes(a), _bytes(b))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.flags.f_contiguous == b.flags.f_contiguous
        if a.dtype.hasobject:
            assert a.tolist() == b.tolist()
        else:
            assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, Box):
        same(a.tree, b.tree)
        assert a.note == b.note
    else:
        assert a == b


def test_round_trip_keeps_values_dtypes_shapes_and_strides():
    w, r = SlotWriter(), SlotReader()
    got = [r.unpack(w.pack(leaves(s))) for s in range(2 * SLOTS + 1)]
    for s, g in enumerate(got):  # earlier messages are not overwritten by slot reuse
        same(leaves(s), g)
    assert all(x is not None for x in w.slots) and len(w.slots) == SLOTS
    # the copies are the receiver's own: not views of a slot
    ptrs = [int(x.data_ptr()) for x in r.slots]
    t = got[-1].tree["contiguous"]
    assert all(not (p <= t.data_ptr() < p + s.numel()) for p, s in zip(ptrs, r.slots))


def test_slots_grow_and_are_reused():
    w, r = SlotWriter(), SlotReader()
    msgs = [w.pack({"x": torch.zeros(n)}) for n in (10, 10, 10, 10, 5000, 10)]
    assert [m[2] is not None for m in msgs] == [True, True, False, False, True, False]
    for n, m in zip((10, 10, 10, 10, 5000, 10), msgs):
        assert r.unpack(m)["x"].shape == (n,)
    without = w.pack({"x": np.zeros(3), "k": 1})  # nothing in a slot: no buffer handed over
    assert without[2] is None and r.unpack(without)["k"] == 1


class Leaves:
    """A client that returns :func:`leaves` of its id (not a ClientResult: the pool moves
    any value)."""

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        return leaves(int(cohort[0]))


def test_worker_results_arrive_intact_through_reused_slots():
    """Through the pool itself (the processes backend accepts client results only)."""
    from partialfl.runtime.pool import Task, WorkerPool

    pb = _problem("output", False, toy_data(8))
    pool = WorkerPool(pb, Leaves(), 1)  # one worker: its two slots reused four times
    try:
        pool.wait_ready()
        out = {}
        for i in range(8):
            pool.send(0, Task(i, i, ServerState({}), RoundContext(0, 0), None))
            ev = pool.next()
            assert ev.kind == "done", ev
            out[ev.task] = ev.payload
    finally:
        pool.close()
    for i in range(8):
        same(leaves(i), out[i])


def test_results_need_no_shared_memory_handover_per_tensor(monkeypatch):
    """Once the slots exist, a round's results arrive without a shared-memory segment per
    tensor (torch's reductions rebuild one per tensor per client: ~2 ms each)."""
    import torch.multiprocessing.reductions as red

    pb = _problem("none", False, toy_data())
    alg = FedAvg(SGDConfig(lr=0.1, batch_size=4))
    rebuilt = []

    def counting(orig):
        @functools.wraps(orig)  # pickled by name, as the original
        def rebuild(*args):
            rebuilt.append(1)
            return orig(*args)
        return rebuild

    for name in ("rebuild_storage_fd", "rebuild_storage_filename"):
        monkeypatch.setattr(red, name, counting(getattr(red, name)))
    with ProcessBackend(workers=2) as be:
        run_rounds(pb, alg, 1, clients_per_round=6, backend=be)  # the slots are made
        rebuilt.clear()
        run_rounds(pb, alg, 2, clients_per_round=6, backend=be)
    assert rebuilt == []


def test_a_task_that_does_not_pickle_fails_in_the_caller():
    """The task is pickled when it is sent, so an unpicklable one raises there (pickled later
    by a queue's feeder thread, it was lost and its worker waited for it)."""
    pb = _problem("none", False, toy_data(4))
    call = ClientCall(Leaves(), pb, ServerState({}), np.arange(4),
                      RoundContext(0, 0, mode=lambda: None))
    with ProcessBackend(workers=1, task_timeout=20) as be, pytest.raises(
            (AttributeError, TypeError, pickle.PicklingError), match="pickle"):
        be.map_groups(call, [np.array([i]) for i in range(4)])
