"""Client state on disk does per-round work proportional to the cohort, never to M (issue 25
item 4): every byte a round reads or writes is in the cohort's rows, nothing is memory-mapped,
flushed, fsynced or resized, and rows never written are not read."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _nn_toy import one_thread, toy_data, toy_model

from partialfl.algorithms import Scaffold
from partialfl.algorithms.base import RoundContext
from partialfl.algorithms.disk_state import OnDiskClientState
from partialfl.algorithms.model import FedAlt, FedSim
from partialfl.data.client_state import ClientStateStore
from partialfl.local.sgd import SGDConfig
from partialfl.problems.model import ModelProblem
from partialfl.runtime import SequentialBackend, sample_cohort
from partialfl.split import make_split


@pytest.fixture
def disk_calls(monkeypatch):
    """Every positional read / write (fd, offset, bytes); resizing, syncing or mapping a file
    fails the test."""
    calls = []
    real_pread, real_pwrite = os.preadv, os.pwrite

    def preadv(fd, bufs, offset):
        calls.append(("read", fd, offset, sum(memoryview(b).nbytes for b in bufs)))
        return real_pread(fd, bufs, offset)

    def pwrite(fd, data, offset):
        calls.append(("write", fd, offset, memoryview(data).nbytes))
        return real_pwrite(fd, data, offset)

    def forbidden(*a, **k):
        raise AssertionError("whole-file work in a round")

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pwrite", pwrite)
    yield calls, forbidden


def _rows_of(calls, fd, rb):
    out = set()
    for _, f, off, n in calls:
        if f == fd and n:
            assert off % rb == 0 and n % rb == 0, "a partial row"
            out.update(range(off // rb, (off + n) // rb))
    return out


@pytest.mark.parametrize("name", ["fedalt", "fedsim", "scaffold"])
def test_a_round_reads_and_writes_only_the_cohorts_rows(tmp_path, monkeypatch, disk_calls,
                                                        name):
    calls, forbidden = disk_calls
    cfg = SGDConfig(lr=0.1, batch_size=4)
    alg = OnDiskClientState({"fedalt": FedAlt(cfg), "fedsim": FedSim(cfg),
                             "scaffold": Scaffold(local=cfg)}[name], tmp_path / "st")
    d = toy_data(num_clients=30, seed=2)
    with one_thread():
        pb = ModelProblem(make_split(toy_model(0), "output"), d, vectorize=False)
        state = alg.init(pb, pb.init_theta())
        cs = alg.init_client_state(pb)
        assert isinstance(cs, ClientStateStore)
        for attr in ("fsync", "fdatasync", "ftruncate", "truncate"):
            monkeypatch.setattr(os, attr, forbidden)
        monkeypatch.setattr(np.memmap, "__new__", forbidden)
        written: set[int] = set()
        for r in range(6):
            cohort = sample_cohort(0, r, pb.num_clients, 4)
            calls.clear()
            rows = {n: v[cohort] for n, v in cs.items()}
            res = SequentialBackend().run(alg, state, pb, cohort, RoundContext(0, r), rows)
            for n, v in res.client_state.items():
                cs[n][cohort] = v
            state = alg.server_update(state, res.updates, RoundContext(0, r))
            for n in cs.names:
                fd, rb = cs._fd[n], cs.row_bytes[n]
                reads = _rows_of([c for c in calls if c[0] == "read"], fd, rb)
                writes = _rows_of([c for c in calls if c[0] == "write"], fd, rb)
                assert reads == set(cohort.tolist()) & written, (r, n)  # never-written: none
                assert writes == set(cohort.tolist()), (r, n)
                assert sum(c[3] for c in calls if c[0] == "write" and c[1] == fd) \
                    == len(cohort) * rb
            written |= set(cohort.tolist())
    assert cs.io["rows_written"] == 6 * 4 * len(cs.names)


def test_a_million_clients_cost_only_the_rows_touched(tmp_path, disk_calls):
    calls, _ = disk_calls

    def init(c):
        return {"w": torch.zeros(len(c), 1000), "c": np.ones((len(c), 3), np.float64)}

    st = ClientStateStore(tmp_path / "cs", 1_000_000, init)
    cohort = np.array([999_999, 3, 500_000, 4])
    got = st.get(cohort)
    assert calls == [] and torch.equal(got["w"], torch.zeros(4, 1000))  # nothing read
    st.put(cohort, {"w": torch.arange(4.0)[:, None].expand(4, 1000), "c": np.zeros((4, 3))})
    # rows 3 and 4 are adjacent: one write for both
    assert len([c for c in calls if c[0] == "write"]) == 2 * 3
    assert st.io["bytes_written"] == 4 * (4000 + 24)
    back = st.get(np.array([4, 7, 999_999]))
    assert torch.equal(back["w"][:, 0], torch.tensor([3.0, 0.0, 0.0]))
    assert np.array_equal(back["c"], [[0.0] * 3, [1.0] * 3, [0.0] * 3])
    assert st.io["rows_read"] == 2 * 2  # the two written rows, per name
    on_disk = sum(f.stat().st_blocks * 512 for f in (tmp_path / "cs").glob("state_*.bin"))
    assert on_disk < 1 << 20  # sparse: the 4 GB of never-written rows take no space
