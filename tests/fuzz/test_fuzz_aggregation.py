"""Fuzz every aggregation rule and wrapper (issue 21): for random k, d, δ, inputs and weights
(including 0, huge and non-finite values) a rule either returns a finite vector of shape [d]
or raises the project's error — a ValueError subclass with a one-line message — never another
exception, a non-finite result or a hang (each test has a time limit). Examples are
derandomized (the same every run) and no database is written; to search longer with fresh
examples: ``PARTIALFL_FUZZ_EXAMPLES=2000 pytest tests/fuzz``."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from partialfl.aggregation import (  # noqa: E402
    ARC,
    CAF,
    MDA,
    SMEA,
    Bucketing,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Meamed,
    Mean,
    MoNNA,
    NearestNeighborMixing,
    StaticClipping,
    TrimmedMean,
    aggregate_tree,
)
from partialfl.build import make_aggregator  # noqa: E402
from partialfl.registry import names  # noqa: E402

_MORE = int(os.environ.get("PARTIALFL_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_MORE or 60, deadline=None, derandomize=not _MORE, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: entries: ordinary, huge, tiny, zero and (rarely) non-finite
ENTRY = st.one_of(
    st.floats(-10, 10, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1e30, -1e30, 1e300, -1e300, 1.7e308, -1.7e308, 1e-300,
                     5e-324]),
    st.sampled_from([np.nan, np.inf, -np.inf]).filter(lambda _: True),
)
WEIGHT = st.one_of(
    st.floats(0, 10, allow_nan=False),
    st.sampled_from([0.0, 1e-300, 1e30, 1e308, 1.7e308, -1.0, np.nan, np.inf]),
)
DELTA = st.one_of(st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.25, 0.3, 0.45, 0.49]),
                  st.floats(0, 0.499))


@st.composite
def inputs(draw, max_k=12, max_d=5, finite=False):
    k = draw(st.integers(1, max_k))
    d = draw(st.integers(1, max_d))
    kind = draw(st.sampled_from(["normal", "entries", "outliers"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "normal":
        X = rng.standard_normal((k, d)) * draw(st.sampled_from([1e-200, 1e-3, 1.0, 1e200]))
    elif kind == "outliers":
        X = rng.standard_normal((k, d))
        bad = rng.random(k) < 0.3
        X[bad] = draw(st.sampled_from([1e30, -1e30, 1e300, 1.7e308, -1.7e308]))
    else:
        entry = ENTRY if not finite else ENTRY.filter(np.isfinite)
        X = np.array(draw(st.lists(entry, min_size=k * d, max_size=k * d))).reshape(k, d)
    if finite:
        X = np.where(np.isfinite(X), X, 0.0)
    if draw(st.booleans()):
        w = None
    else:
        w = np.array(draw(st.lists(WEIGHT, min_size=k, max_size=k)))
    return X, w


RULES = [n for n in names("aggregator")]


@st.composite
def aggregators(draw):
    """A rule by name with random wrappers and options, or a wrapper built directly; None when
    the combination is refused at construction (with the project's error, checked)."""
    name = draw(st.sampled_from(RULES))
    kw = {"bucketing": draw(st.sampled_from([1, 1, 2, 3])),
          "nnm": draw(st.booleans()), "arc": draw(st.booleans()),
          "allow_unprotected": draw(st.booleans()), "seed": draw(st.integers(0, 5))}
    if draw(st.booleans()):
        kw["delta"] = draw(DELTA)
    if draw(st.booleans()):
        kw["clip"] = draw(st.sampled_from([1e-3, 1.0, 1e30]))
    if name == "monna":
        kw["index"] = draw(st.integers(0, 3))
    if name == "mean":
        kw = {"weighted": draw(st.booleans())}
    return project_call(lambda: make_aggregator(name, **kw))


def project_call(fn):
    """fn(), or None when it raised the project's one-line ValueError."""
    try:
        return fn()
    except ValueError as e:
        msg = str(e)
        assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
        return None


def check_result(agg, X, w):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GM max_iter, unprotected runs, skipped rows
        out = project_call(lambda: agg(X, w))
    if out is None:
        return
    out = np.asarray(out)
    assert out.shape == (X.shape[1],), (out.shape, X.shape)
    assert np.isfinite(out).all(), (agg, X, w, out)


@pytest.mark.timeout(120 if not _MORE else 3600)
@FUZZ
@given(agg=aggregators(), data=inputs())
def test_registry_rules_with_wrappers(agg, data):
    if agg is not None:
        check_result(agg, *data)


DIRECT = st.sampled_from([
    lambda d, s: CoordinateMedian(), lambda d, s: TrimmedMean(d, s),
    lambda d, s: GeometricMedian(weighted=s), lambda d, s: GeometricMedian(max_iter=3),
    lambda d, s: Krum(d, m=None, cap=s), lambda d, s: Krum(d, m=2, allow_unprotected=s),
    lambda d, s: CenteredClipping(iters=2, init="zero" if s else "median"),
    lambda d, s: CenteredClipping(tau=1e-3), lambda d, s: MDA(d, allow_unprotected=s),
    lambda d, s: MoNNA(d, index=0, allow_unprotected=s),
    lambda d, s: Meamed(d, s), lambda d, s: CAF(d, s), lambda d, s: SMEA(d, allow_unprotected=s),
    lambda d, s: NearestNeighborMixing(CoordinateMedian(), max(d, 0.01), allow_unprotected=s),
    lambda d, s: ARC(Mean(), d, allow_unprotected=s), lambda d, s: StaticClipping(Mean(), 1.0),
    lambda d, s: Bucketing(Krum(d, cap=True), s=2), lambda d, s: Mean(weighted=s),
])


@pytest.mark.timeout(120 if not _MORE else 3600)
@FUZZ
@given(make=DIRECT, delta=DELTA, loose=st.booleans(), data=inputs())
def test_rules_built_directly(make, delta, loose, data):
    agg = project_call(lambda: make(delta, loose))
    if agg is not None:
        check_result(agg, *data)


@pytest.mark.timeout(120 if not _MORE else 3600)
@settings(FUZZ, max_examples=_MORE or 40)
@given(make=DIRECT, delta=DELTA, data=inputs(finite=True), ref=st.integers(0, 2**32 - 1))
def test_finite_inputs_with_a_reference_vector_and_trees(make, delta, data, ref):
    """Finite inputs: also MoNNA with a server-side reference and the stacked-tree path."""
    X, w = data
    r = np.random.default_rng(ref).standard_normal(X.shape[1])
    agg = project_call(lambda: MoNNA(delta, reference=r, allow_unprotected=True))
    if agg is not None:
        check_result(agg, X, w)
    agg = project_call(lambda: make(delta, True))
    if agg is None:
        return
    tree = {"a": X[:, :1], "b": X[:, 1:].reshape(len(X), -1, 1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = project_call(lambda: aggregate_tree(agg, tree, w))
    if out is not None:
        assert np.isfinite(np.asarray(out["a"])).all() and out["a"].shape == (1,)
