"""Synchronous runtime: sampling, logging, checkpoint and exact resume."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL

from partialfl import rng as prng
from partialfl.algorithms import FFGG, Scaffold
from partialfl.local import GradientDescent
from partialfl.metrics import closed_form_metrics
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime import JsonlLogger, read_jsonl, run_rounds, sample_cohort
from partialfl.server import SGD


def test_sample_cohort_is_seeded_unique_and_validated():
    a = sample_cohort(3, 5, 10, 4)
    assert np.array_equal(a, sample_cohort(3, 5, 10, 4))
    assert len(set(a)) == 4 and a.min() >= 0 and a.max() < 10
    assert not np.array_equal(a, sample_cohort(3, 6, 10, 4)) or not np.array_equal(
        sample_cohort(3, 7, 10, 4), a)
    assert np.array_equal(sample_cohort(0, 0, 5, None), np.arange(5))
    for bad in (0, 11, -1):
        with pytest.raises(ValueError, match="clients_per_round"):
            sample_cohort(0, 0, 10, bad)


def test_rng_paths_are_independent_and_stable():
    a = prng.generator(1, "client", 2, 3).random(3)
    assert np.array_equal(a, prng.generator(1, "client", 2, 3).random(3))
    assert not np.allclose(a, prng.generator(1, "client", 3, 2).random(3))
    assert prng.torch_seed(1, "x") == prng.torch_seed(1, "x") >= 0
    with pytest.raises(ValueError):
        prng.generator(0, -1)


@pytest.mark.parametrize("algorithm", ["ffgg", "scaffold"])
def test_interrupted_run_resumes_exactly(tmp_path, algorithm):
    basis = "eigen" if algorithm == "ffgg" else "standard"
    p = LeastSquaresProblem(SMALL, basis=basis)

    def make():
        if algorithm == "ffgg":
            return FFGG(GradientDescent(3, init="random"), SGD(1.0 / p.L))
        return Scaffold(3)

    kw = dict(clients_per_round=3, seed=4, eval_every=2,
              evaluate=lambda *a: closed_form_metrics(*a, with_loss=False))
    full = run_rounds(p, make(), 12, **kw)
    ckpt = tmp_path / "run.ckpt"

    def crash(r, state):
        if r == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_rounds(p, make(), 12, checkpoint=ckpt, checkpoint_every=3, on_round=crash, **kw)
    assert ckpt.exists() and not ckpt.with_suffix(".ckpt.tmp").exists()
    log = tmp_path / "m.jsonl"
    with JsonlLogger(log) as lg:
        resumed = run_rounds(p, make(), 12, checkpoint=ckpt, checkpoint_every=3, resume=True,
                             logger=lg, **kw)
    for k in full.state.theta:
        assert np.array_equal(full.state.theta[k], resumed.state.theta[k])
    assert [h["round"] for h in resumed.history] == [h["round"] for h in full.history]
    assert [r["round"] for r in read_jsonl(log)] == [h["round"] for h in full.history]


def test_jsonl_roundtrip_with_non_finite(tmp_path):
    with JsonlLogger(tmp_path / "a.jsonl", method="x") as lg:
        lg.log({"round": 1, "v": float("nan"), "w": np.float64(2.5), "i": float("inf")})
    (rec,) = read_jsonl(tmp_path / "a.jsonl")
    assert rec["method"] == "x" and rec["w"] == 2.5 and np.isnan(rec["v"]) and rec["i"] == np.inf


def test_bad_run_arguments():
    p = LeastSquaresProblem(SMALL)
    alg = FFGG(GradientDescent(1))
    with pytest.raises(ValueError, match="rounds"):
        run_rounds(p, alg, -3)
    with pytest.raises(ValueError, match="eval_every"):
        run_rounds(p, alg, 3, eval_every=0)


def test_every_loop_writes_the_same_record_keys():
    """One history schema (runtime.logging.RECORD_KEYS) for rounds, the simulated clock and
    worker processes; ``step`` counts rounds (sync) or applied updates (async)."""
    from partialfl.runtime.asynchronous import run_async
    from partialfl.runtime.logging import RECORD_KEYS
    from partialfl.runtime.processes import run_processes

    p = LeastSquaresProblem(SMALL)

    def alg():
        return FFGG(GradientDescent(2), SGD(0.5 / p.L))

    sync = run_rounds(p, alg(), 3, clients_per_round=2, eval_every=1).history
    sim = run_async(p, alg(), steps=4, concurrency=2, eval_every=2).history
    real = run_processes(p, alg(), steps=4, concurrency=2, time_unit=0.0, eval_every=2).history
    for hist in (sync, sim, real):
        assert all(set(RECORD_KEYS) <= set(h) for h in hist)
        assert "local_grads" not in hist[-1]
    assert [h["step"] for h in sync] == [h["round"] for h in sync] == [0, 1, 2, 3]
    assert [h["step"] for h in sim] == [h["step"] for h in real] == [0, 2, 4]
    # one client's count per round (sync), each applied update's count (async)
    g = sync[1]["grad_evals"]
    assert g > 0 and sync[-1]["grad_evals"] == 3 * g and sim[-1]["grad_evals"] == 4 * g
