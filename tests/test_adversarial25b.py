"""Adversarial round 25b (issue 21, tried again from scratch): defects still present.

Each test fails on the current code because of the defect it names (hence ``xfail(strict)``)
and passes once the defect is fixed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest


# -- area 1: a process pool reused across runs keeps a stale loss function -------------------
def _loss3(out, y):
    import torch.nn.functional as F

    return 3.0 * F.cross_entropy(out, y, reduction="none")


def test_a_reused_process_pool_sees_a_loss_function_changed_between_runs():
    """``ProcessBackend(1)`` passed to two ``run_rounds`` on one :class:`ModelProblem`,
    ``p.loss_fn`` replaced between them (cross-entropy → 3 × cross-entropy, a public
    attribute): the second run returns exactly the first run's θ, not the sequential θ of
    the new loss (fork and spawn alike; the threads backend gets it right). Root cause:
    runtime/checkpoint.py ``_describe`` drops attributes that are functions
    (``not isinstance(v, _FUNCTIONS)``) and names a function only by ``__qualname__``, so
    ``content_digest(problem, fast=True)`` in runtime/cohort_pool.py
    ``ProcessBackend._pool_for`` is unchanged and the workers keep their copy. Expected: the
    sequential backend's θ, or a one-line refusal."""
    import torch
    from _nn_toy import one_thread, toy_data, toy_model

    from partialfl.algorithms.model import model_ffgg
    from partialfl.local.sgd import SGDConfig
    from partialfl.problems.model import ModelProblem
    from partialfl.runtime import SequentialBackend, run_rounds
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.split import make_split

    def problem():
        return ModelProblem(make_split(toy_model(0), "output"), toy_data(4), vectorize=False)

    alg = model_ffgg(SGDConfig(lr=0.3, epochs=1, batch_size=4))
    with one_thread(), ProcessBackend(1) as pb:
        p = problem()
        run_rounds(p, alg, 1, clients_per_round=4, seed=0, backend=pb)
        p.loss_fn = _loss3
        try:
            got = run_rounds(p, alg, 1, clients_per_round=4, seed=0, backend=pb)
        except ValueError as e:
            assert "\n" not in str(e)
            return
    ref = problem()
    ref.loss_fn = _loss3
    with one_thread():
        want = run_rounds(ref, alg, 1, clients_per_round=4, seed=0,
                          backend=SequentialBackend())
    assert all(torch.equal(got.state.theta[n], want.state.theta[n]) for n in want.state.theta)


# -- area 2: one SuperNode's evaluation weight drowns the honest nodes -----------------------
_FEMNIST = {"seed": 0, "model": {"name": "leaf_cnn", "options": {"hidden": 8}},
            "data": {"source": "femnist", "num_clients": 4, "holdout": 0},
            "method": {"algorithm": "ffgg", "split": "output"},
            "personalize": {"rounds": 1, "clients_per_round": 4, "eval_every": 1,
                            "client": {"lr": 0.05, "batch_size": 16, "epochs": 1},
                            "server": {"lr": 0.1}}}


def _huge_loss_weight(partition, mtype, content):
    if partition == 1 and mtype == "evaluate" and len(content["eval"]) > 0:
        content["eval"]["loss_weight.sum"] = 1.7e308
        content["eval"]["loss_sum.sum"] = 1.7e308


@pytest.mark.slow
def test_one_node_evaluation_weight_never_erases_the_honest_nodes(loopback):
    """FEMNIST (4 writers, LEAF CNN with an 8-wide dense layer) on 2 SuperNodes; node 1
    replies to every evaluation with ``loss_weight.sum = loss_sum.sum = 1.7e308`` (finite,
    ≥ 0: accepted) for its 2 clients. The logged ``eval_loss`` becomes exactly 1.0 with
    0 failures (honest: ≈ 4.14): node 0's clients no longer count at all, although the
    claimed weight is ~1e305 × the node's examples. Root cause: flower/codec.py
    ``_decode_eval`` bounds ``clients``/``acc.count`` by the node's clients and checks
    ``loss_weight.sum >= 0`` and ``correct <= total``, but bounds neither ``total.sum`` nor
    ``loss_weight.sum`` by the node's examples. Fixed: nodes declare ``eval-units`` when they
    describe themselves and a reply beyond them is refused and counted (eval_loss from node
    0 alone)."""
    from partialfl.data import default_data_dir
    from partialfl.data.femnist import FEMNIST_NPZ
    from partialfl.flower.server import run_server

    d = default_data_dir()
    if d is None or not (d / FEMNIST_NPZ).exists():
        pytest.skip(f"{FEMNIST_NPZ} not found (set PARTIALFL_DATA_DIR to ../shared/data)")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = run_server(loopback(2, tamper=_huge_loss_weight), {"spec": _FEMNIST})
    assert all(np.isfinite(np.asarray(v)).all() for v in rep.theta.values())
    last = rep.history[-1]
    assert last["eval_loss"] > 2.0, last
    refused = [f for f in rep.failures if f.kind == "eval-invalid"]
    assert refused and {f.partition for f in refused} == {1}, rep.failures
    assert "eval-units" in refused[0].reason
