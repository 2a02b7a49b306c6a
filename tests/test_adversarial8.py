"""Adversarial round 8 (issue 21): regression tests for what the eighth independent round
found (a reviewer who did not write the fixes)."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
from conftest import SMALL
from test_resume_check import _rewrite

from partialfl.aggregation.coordinate import TrimmedMean
from partialfl.algorithms import FFGG, Scaffold
from partialfl.algorithms.byzantine import ByzantineRobust
from partialfl.algorithms.dp import CLIP, NUM_CLIENTS, DifferentiallyPrivate, DPOptions
from partialfl.local import ExactSolver
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime import run_rounds
from partialfl.runtime.resume_check import CheckpointError
from partialfl.server import SGD, Adam


# -- a resumed state's algorithm numbers ---------------------------------------------------
def _extra(key, value):
    def f(server, client):
        st = server["state"]
        server["state"] = replace(st, extra={**st.extra, key: value(st.extra.get(key))})
        return server, client
    return f


def _opt(server, client):
    st = server["state"]
    nan = {n: np.full_like(v, np.nan) for n, v in st.opt_state["v"].items()}
    server["state"] = replace(st, opt_state={**st.opt_state, "v": nan})
    return server, client


def _dp(adaptive=False):
    return DifferentiallyPrivate(FFGG(ExactSolver(), SGD(0.1)), DPOptions(
        clip_norm=1.0, target_epsilon=5.0, rounds=4, clients_per_round=4,
        adaptive_clipping=adaptive, clip_count_std=1.0 if adaptive else None))


#: the algorithms whose checkpoints are crafted
MAKERS = {
    "dp": _dp,
    "dp-adaptive": lambda: _dp(True),
    "scaffold": lambda: Scaffold(3),
    "adam": lambda: Scaffold(3, server_opt=Adam(0.01)),
    "byzantine": lambda: ByzantineRobust(Scaffold(3), TrimmedMean(delta=0.25),
                                         clients_per_round=4),
}

#: (algorithm, edit): each edit passed the checks and resumed, or crashed later
CASES = {
    # DP's M sets the accountant's sampling rate: M = 10⁶ for 6 clients resumed with the
    # noise multiplier 0.32 instead of 0.72 and reported ε = 5 (a false privacy statement)
    "dp-num-clients": ("dp", _extra(NUM_CLIENTS, lambda v: 10**6)),
    "dp-num-clients-zero": ("dp", _extra(NUM_CLIENTS, lambda v: 0)),
    # a fixed clip norm is the options': 1e300 resumed without clipping
    "dp-fixed-clip-huge": ("dp", _extra(CLIP, lambda v: 1e300)),
    "dp-fixed-clip-negative": ("dp", _extra(CLIP, lambda v: -1.0)),
    # an adaptive clip norm changes, but never to NaN or inf (θ NaN after one round)
    "dp-adaptive-clip-nan": ("dp-adaptive", _extra(CLIP, lambda v: float("nan"))),
    "dp-adaptive-clip-inf": ("dp-adaptive", _extra(CLIP, lambda v: float("inf"))),
    # Scaffold's control variate NaN: every later update non-finite, rounds skipped
    "scaffold-c-nan": ("scaffold", _extra("c", lambda c: {
        n: np.full_like(v, np.nan) for n, v in c.items()})),
    "scaffold-num-clients": ("scaffold", _extra("num_clients", lambda v: 1)),
    "scaffold-num-clients-zero": ("scaffold", _extra("num_clients", lambda v: 0)),
    # a counter the loop adds: inf was an OverflowError traceback, -5 was logged
    "rounds-unprotected-inf": ("scaffold",
                               _extra("rounds_unprotected", lambda v: float("inf"))),
    "rounds-unprotected-negative": ("scaffold",
                                    _extra("rounds_unprotected", lambda v: -5)),
    # Adam's second moment NaN: θ NaN at the first step
    "adam-moment-nan": ("adam", _opt),
    # the planned Byzantine cohort: a larger one turns "refuse an unprotected cohort" into
    # a counted warning
    "byzantine-planned-cohort": ("byzantine", _extra("byz_cohort", lambda v: 100)),
}


def _run(p, alg, ck, resume=False, rounds=4):
    k = None if isinstance(alg, DifferentiallyPrivate) else 4
    return run_rounds(p, alg, rounds, clients_per_round=k, seed=1, checkpoint=ck,
                      checkpoint_every=1, resume=resume)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Each algorithm's checkpoint after 2 of 4 rounds."""
    pytest.importorskip("dp_accounting")
    p = LeastSquaresProblem(SMALL, basis="standard")
    out = {}
    for key, make in MAKERS.items():
        out[key] = tmp_path_factory.mktemp(key)
        _run(p, make(), out[key] / "run.ckpt", rounds=2)
    return p, out


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_with_crafted_algorithm_numbers_is_refused(case, templates, tmp_path):
    """A checkpoint rewritten with its pointer (every hash matches) was checked for θ's
    finiteness and the *types* of the algorithm's state only: DP's number of clients M (the
    accountant's sampling rate: less noise than the budget needs, a false ε), a fixed clip
    norm, Scaffold's M, the planned Byzantine cohort were taken as written; a NaN control
    variate, clip norm or Adam moment was trained on; an infinite loop counter was an
    OverflowError traceback. Now every floating value of the state must be finite, its
    numbers >= 0, and what the algorithm declares fixed by its configuration
    (``fixed_extra``) equal to a fresh run's: one CheckpointError line."""
    p, tmpl = templates
    key, edit = CASES[case]
    d = tmp_path / "ck"
    shutil.copytree(tmpl[key], d)
    _rewrite(d / "run.ckpt", "sync", edit)
    with pytest.raises(CheckpointError) as e:
        _run(p, MAKERS[key](), d / "run.ckpt", resume=True)
    assert "\n" not in str(e.value) and "run.ckpt" in str(e.value), str(e.value)


@pytest.mark.parametrize("key", sorted(MAKERS))
def test_the_untouched_checkpoints_of_those_algorithms_still_resume(key, templates, tmp_path):
    """The new checks refuse nothing a real run writes (DP with a fixed and an adaptive
    clip norm, Adam's moments, the Byzantine counters): rewritten unedited, each checkpoint
    resumes to the uninterrupted run's θ."""
    p, tmpl = templates
    make = MAKERS[key]
    d = tmp_path / "ck"
    shutil.copytree(tmpl[key], d)
    _rewrite(d / "run.ckpt", "sync", lambda s, c: (s, c))
    res = _run(p, make(), d / "run.ckpt", resume=True)
    ref = _run(p, make(), tmp_path / "ref.ckpt")
    for n, v in ref.state.theta.items():
        np.testing.assert_array_equal(res.state.theta[n], v)
