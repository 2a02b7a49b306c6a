"""map_clients: the one place that groups a cohort's clients (vmap groups, a loop, a pool)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partialfl.batching import Loop, Vmap, groups, in_process, map_clients
from partialfl.runtime.backends import BatchedBackend, ProcessBackend, SequentialBackend


def test_groups_follow_the_mode():
    assert [g.tolist() for g in groups(5, Loop())] == [[0], [1], [2], [3], [4]]
    assert [g.tolist() for g in groups(5, Vmap())] == [[0, 1, 2, 3, 4]]
    # at most max_examples // per_client clients per vectorised call
    assert [g.tolist() for g in groups(5, Vmap(8), per_client=3)] == [[0, 1], [2, 3], [4]]
    assert [g.tolist() for g in groups(3, Vmap(2), per_client=5)] == [[0], [1], [2]]


def test_map_clients_concatenates_in_cohort_order_and_uses_the_one_client_kernel():
    calls = []

    def many(pos):
        calls.append(("many", pos.tolist()))
        return {"x": torch.as_tensor(pos * 10.0)}, np.asarray(pos, dtype=float)

    def one(pos):
        calls.append(("one", pos.tolist()))
        return {"x": torch.as_tensor(pos * 10.0)}, np.asarray(pos, dtype=float)

    for mode in (Loop(), Vmap(4), Vmap()):
        calls.clear()
        tree, arr = map_clients(many, 5, mode, per_client=2, single=one)
        assert tree["x"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]
        assert arr.tolist() == [0, 1, 2, 3, 4]
        kinds = [c[0] for c in calls]
        if isinstance(mode, Loop):
            assert kinds == ["one"] * 5
        elif mode.max_examples == 4:  # groups of 2: [0,1] [2,3] [4]
            assert calls == [("many", [0, 1]), ("many", [2, 3]), ("one", [4])]
        else:
            assert calls == [("many", [0, 1, 2, 3, 4])]


def test_modes_and_errors():
    assert isinstance(BatchedBackend(), Vmap) and isinstance(SequentialBackend(), Loop)
    assert isinstance(in_process(ProcessBackend(workers=1)), Loop)  # workers run one client
    assert in_process(BatchedBackend()).vectorized
    with pytest.raises(TypeError, match="unknown batching mode"):
        map_clients(lambda p: p, 3, "vmap")
    with pytest.raises(TypeError, match="ClientCall"):
        map_clients(lambda p: p, 3, ProcessBackend(workers=1))
    with pytest.raises(ValueError, match="non-empty"):
        map_clients(lambda p: p, 0, Loop())
    with pytest.raises(ValueError, match="max_examples"):
        Vmap(0)
