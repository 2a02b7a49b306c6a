"""Distance-based robust rules: they select or weight whole input vectors by their pairwise
(or to-a-centre) Euclidean distances.

* :class:`Krum`              Krum / multi-Krum (Blanchard et al., 2017).
* :class:`CenteredClipping`  (Karimireddy et al., 2021).
* :class:`MDA`               minimum-diameter averaging (El Mhamdi et al., 2018).
* :class:`MoNNA`             mean of the k − f nearest neighbours of a trusted input
  (Farhadkhani et al., 2023).

The geometric median is in :mod:`~partialfl.aggregation.geometric_median`; conventions shared
by every rule in :mod:`partialfl.aggregation.rules`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from partialfl.aggregation.common import (
    NonFiniteInputError,
    chain_of,
    check_delta,
    check_int,
    check_limit,
    dists_to,
    gram,
    mean_rows,
    norms,
    prepare,
    require_finite,
    sq_dists,
    subsets,
)
from partialfl.aggregation.compose import AggregatorOptions, register_rule
from partialfl.aggregation.coordinate import column_median
from partialfl.aggregation.protection import (
    UnprotectedError,
    check,
    check_flag,
    majority,
    warn_once,
)
from partialfl.registry import option


@dataclass(frozen=True)
class Krum:
    """Multi-Krum: average the ``m`` inputs with the lowest Krum score (m = 1: Krum).

    score_i = Σ_{j ∈ N_i} ‖x_i − x_j‖², N_i the k − f − 2 nearest other inputs, f = ⌊δk⌋.
    ``m=None`` selects k − f inputs (the usual multi-Krum). Ties go to the lower index.
    Bound: k ≥ 2f + 3 and, for δ > 0, f ≥ 1 (k ≥ ⌈1/δ⌉). With fewer inputs (e.g. after
    bucketing) the call raises, unless ``cap=True`` — the explicit choice to tolerate only
    f = ⌊(k − 3)/2⌋ then — or ``allow_unprotected=True`` (a warning, then the capped f).
    """

    weighted: ClassVar[bool] = False  # the rows' weights are not used

    delta: float = 0.1
    m: int | None = 1
    cap: bool = False
    allow_unprotected: bool = False
    name = "krum"

    def __post_init__(self) -> None:
        check_delta(self.delta, "krum")
        if self.m is not None:
            check_int(self.m, "krum: m (inputs to average)", 1)
        check_flag(self.cap, "krum: cap")
        check_flag(self.allow_unprotected, "krum: allow_unprotected")

    def tolerated(self, k: int) -> int:
        """f = ⌊δk⌋ (refused where it is 0 for δ > 0); Krum's guarantee needs k ≥ 2f + 3,
        and multi-Krum's a given m ≤ k − f (else an attacker's row is among the m averaged)."""
        f = self._f(k)
        if self.m is not None and self.m > k - f:
            problem = (f"multi-krum: averaging m = {self.m} of k = {k} inputs, f = {f} of them "
                       f"Byzantine, needs m ≤ k − f = {k - f}")
            if not self.allow_unprotected:
                raise UnprotectedError(f"{problem}; lower m, or pass allow_unprotected=True")
            warn_once(f"{problem}; running unprotected (allow_unprotected=True)",
                      ("multi-krum", k, self.m))
        return f

    def _f(self, k: int) -> int:
        f = check("krum", self.delta, k, self.allow_unprotected, extra=0)
        if f == 0 or k >= 2 * f + 3:
            return f
        capped = max(0, (k - 3) // 2)
        problem = (f"krum: f = ⌊δk⌋ = {f} Byzantine inputs among k = {k} needs k ≥ 2f + 3 = "
                   f"{2 * f + 3}")
        if self.cap:
            return capped
        if self.allow_unprotected:
            warn_once(f"{problem}; tolerating only f = {capped} (allow_unprotected=True)",
                      ("krum", k, self.delta))
            return capped
        raise UnprotectedError(f"{problem}; lower delta (or the bucket size), or pass cap=True "
                               f"to tolerate only f = {capped} explicitly")

    def scores(self, X: np.ndarray) -> np.ndarray:
        """score_i for every input (k ≥ 2), in the units s² of :func:`gram` (s = 1 unless
        the inputs exceed 1e100 or are all below 1e-100)."""
        k = len(X)
        f = self.tolerated(k)
        nb = max(1, k - f - 2)
        D = sq_dists(gram(X)[0])
        np.fill_diagonal(D, np.inf)
        return np.sort(D, axis=1)[:, :nb].sum(1)

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "krum")
        k = len(X)
        f = self.tolerated(k)  # refuses (or warns for) a cohort it cannot protect, k = 1 too
        m = k - f if self.m is None else self.m
        if m > k:  # allow_unprotected (tolerated refuses m > k − f otherwise)
            m = k
        if k == 1:
            return restore(X[0].copy())
        sel = np.sort(np.argsort(self.scores(X), kind="stable")[:m])
        return restore(X[sel[0]].copy() if m == 1 else mean_rows(X, sel))


@dataclass(frozen=True)
class CenteredClipping:
    """Centered clipping: v ← v + (1/k) Σ_i (x_i − v)·min(1, τ/‖x_i − v‖), ``iters`` times.

    v⁰ is the coordinate-wise median (``init="median"``) or 0 (``init="zero"``). The radius is
    ``tau`` if given, else ``tau_scale`` · median_i ‖x_i − v⁰‖ (scale-equivariant).
    """

    weighted: ClassVar[bool] = False  # the rows' weights are not used

    tau: float | None = None
    tau_scale: float = 1.0
    iters: int = 3
    init: str = "median"
    name = "cc"

    def __post_init__(self) -> None:
        if self.tau is not None and not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"centered clipping: radius tau must be positive, got {self.tau!r}")
        if not (self.tau_scale > 0 and math.isfinite(self.tau_scale)):
            raise ValueError(f"centered clipping: tau_scale must be positive, "
                             f"got {self.tau_scale!r}")
        check_int(self.iters, "centered clipping: iters", 1)
        if self.init not in ("median", "zero"):
            raise ValueError(f"centered clipping: unknown init {self.init!r}; allowed: "
                             "'median', 'zero'")

    def tolerated(self, k: int) -> int:
        """⌊(k − 1)/2⌋ at most: it starts from the median (refused below a planned f)."""
        return majority("centered clipping", k)

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "centered clipping")
        self.tolerated(len(X))
        v = column_median(X) if self.init == "median" else np.zeros(X.shape[1])
        tau = self.tau
        if tau is None:
            tau = self.tau_scale * float(np.median(norms(X - v)))
            if tau == 0.0:
                return restore(v)
        for _ in range(self.iters):
            D = X - v
            r = norms(D)
            far = r > tau  # only these are clipped: τ/r < 1 there, never a division by ~0
            s = np.ones_like(r)
            s[far] = tau / r[far]
            v = v + (s / len(X)) @ D  # terms ≤ ‖D‖∞/k: no overflow
        return restore(v)

@dataclass(frozen=True)
class MDA:
    """Minimum-diameter averaging: the mean of the k − f inputs S minimising
    max_{i,j ∈ S} ‖x_i − x_j‖ (exhaustive over C(k, f) subsets; the first minimiser in
    lexicographic order of S, as byzfl). f = ⌊δk⌋.

    Bound: k ≥ 2f + 1 and, for δ > 0, f ≥ 1 (k ≥ ⌈1/δ⌉); refused below unless
    ``allow_unprotected=True``."""

    weighted: ClassVar[bool] = False  # the rows' weights are not used

    delta: float = 0.1
    max_subsets: int = 200_000
    allow_unprotected: bool = False
    name = "mda"

    def __post_init__(self) -> None:
        check_delta(self.delta, "mda")
        check_limit(self.max_subsets, "mda")
        check_flag(self.allow_unprotected, "mda: allow_unprotected")

    def tolerated(self, k: int) -> int:
        """f = ⌊δk⌋, refused where the rule protects nothing."""
        return check("mda", self.delta, k, self.allow_unprotected)

    def select(self, X: np.ndarray) -> np.ndarray:
        """The indices of the minimum-diameter subset S (sorted)."""
        k = len(X)
        m = k - self.tolerated(k)
        if m == k:
            return np.arange(k)
        D = sq_dists(gram(X)[0])
        best, best_val = None, np.inf
        for S in subsets(k, m, self.max_subsets, "mda"):
            diam = D[S[:, :, None], S[:, None, :]].max((1, 2))
            i = int(np.argmin(diam))
            if diam[i] < best_val:
                best, best_val = S[i], diam[i]
        return best

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "mda")
        return restore(mean_rows(X, self.select(X)))


@dataclass(frozen=True)
class MoNNA:
    """Mean of the k − f inputs nearest to a trusted reference (Farhadkhani et al., 2023),
    f = ⌊δk⌋. The reference must be honest, which the rule cannot check, so the server chooses
    it and MoNNA refuses to be built without one:

    * ``index``: the position among the inputs of one the server trusts (its own update, placed
      there by the server); it counts among the k − f (first among its ties; byzfl's ``idx``);
    * ``trusted``: the id of a client the server trusts (e.g. the server's own data as a
      client) — what a run spec gives: :class:`~partialfl.algorithms.byzantine.ByzantineRobust`
      puts it in every cohort, never makes it Byzantine and maps it to its row each round
      (:func:`at_row`); a round it did not reply in is skipped and counted (cohorts are sampled
      and rows dropped, so a fixed position would sometimes be an attacker's);
    * ``reference``: a vector ``[d]`` the server holds (e.g. its update on its own data), not an
      input.

    A client's row is no reference (the first row may be Byzantine: with a 1e30 attacker there
    the mean moves to ~1e29), and neither is a bucket mean, so bucketing refuses a MoNNA with
    ``index``. Bound: k ≥ 2f + 1 and, for δ > 0, f ≥ 1 (k ≥ ⌈1/δ⌉); refused below unless
    ``allow_unprotected=True``."""

    weighted: ClassVar[bool] = False  # the rows' weights are not used

    delta: float = 0.1
    index: int | None = None
    reference: Any = field(default=None, compare=False, repr=False)
    allow_unprotected: bool = False
    trusted: int | None = None
    name = "monna"

    def __post_init__(self) -> None:
        check_delta(self.delta, "monna")
        check_flag(self.allow_unprotected, "monna: allow_unprotected")
        given = [self.index is not None, self.reference is not None, self.trusted is not None]
        if sum(given) != 1:
            raise ValueError(
                "monna: needs exactly one trusted reference chosen by the server: trusted=id "
                "(a client the server trusts), index=i (the position of an input the server "
                "trusts, e.g. its own update) or reference=vector [d] (held by the server); a "
                "sampled client's row may be Byzantine"
            )
        if self.trusted is not None:
            check_int(self.trusted, "monna: trusted", 0)
        elif self.index is not None:
            check_int(self.index, "monna: index", 0)
        else:
            ref = np.asarray(self.reference, dtype=np.float64).reshape(-1)
            if not np.isfinite(ref).all():
                raise ValueError("monna: the reference vector contains NaN or inf")
            object.__setattr__(self, "reference", ref)

    def tolerated(self, k: int) -> int:
        """f = ⌊δk⌋, refused where the rule protects nothing."""
        return check("monna", self.delta, k, self.allow_unprotected)

    def __call__(self, vectors, weights=None):
        # rows checked for NaN/inf by the distance pass itself
        X, _, restore = prepare(vectors, weights, "monna", check_finite=False)
        k = len(X)
        if self.trusted is not None:
            raise ValueError(f"monna: trusted client {self.trusted} is a client id; its row is "
                             "known only to the runtime (ByzantineRobust maps it each round)")
        if self.index is not None:
            if self.index >= k:
                raise ValueError(f"monna: trusted index {self.index} but only {k} inputs")
            try:
                dist = dists_to(X, X[self.index], "monna")
            except NonFiniteInputError:
                require_finite(X, "monna")  # name every bad row, not the trusted one
                raise
            dist[self.index] = -1.0  # itself first among its ties
        else:
            if len(self.reference) != X.shape[1]:
                raise ValueError(f"monna: reference vector of length {len(self.reference)} for "
                                 f"inputs of dimension {X.shape[1]}")
            dist = dists_to(X, self.reference, "monna")
        nn = np.sort(np.argsort(dist, kind="stable")[: k - self.tolerated(k)])
        return restore(mean_rows(X, nn))


def trusted_client(agg) -> int | None:
    """The client id a rule (or a chain of wrappers around it) trusts (MoNNA's ``trusted``)."""
    for rule in chain_of(agg):
        t = getattr(rule, "trusted", None)
        if t is not None:
            return int(t)
    return None


def at_row(agg, row: int):
    """``agg`` with its trusted client mapped to input position ``row`` (through wrappers)."""
    if getattr(agg, "trusted", None) is not None:
        return replace(agg, trusted=None, index=int(row))
    inner = getattr(agg, "inner", None)
    return agg if inner is None else replace(agg, inner=at_row(inner, row))


@dataclass(frozen=True)
class KrumOptions(AggregatorOptions):
    """Krum's selection."""

    cap: bool = option(False, "cap multi-Krum's m at k − f (else refuse a larger m)")


@dataclass(frozen=True)
class MultiKrumOptions(KrumOptions):
    """Multi-Krum's number of selected rows."""

    m: int | None = option(None, "rows averaged (None: k − f)")


@dataclass(frozen=True)
class CCOptions(AggregatorOptions):
    """Centered clipping's radius and iterations."""

    tau: float | None = option(None, "clipping radius (None: from tau_scale)")
    tau_scale: float = option(1.0, "radius as a multiple of the median distance")
    iters: int = option(3, "clipping iterations")
    init: str = option("median", "starting point: median, mean or zero")


@dataclass(frozen=True)
class SubsetOptions(AggregatorOptions):
    """The subsets a minimum-diameter rule may search."""

    max_subsets: int = option(200_000, "refuse a cohort with more candidate subsets")


@dataclass(frozen=True)
class MoNNAOptions(AggregatorOptions):
    """MoNNA's trusted row."""

    trusted: int | None = option(None, "the id of a client the server trusts (a run needs it: "
                                 "MoNNA needs an honest reference; it joins every cohort and "
                                 "is never Byzantine)")
    index: int | None = option(None, "the rule used alone on rows you pass: the position of "
                               "the row you trust (a training run refuses it: its cohorts "
                               "are sampled and rows dropped, so use trusted)")


register_rule("krum", Krum, KrumOptions, doc="Krum (Blanchard et al. 2017): the row with the "
              "smallest sum of squared distances to its k − f − 2 nearest rows.")
register_rule("multi-krum", Krum, MultiKrumOptions, aliases=("multikrum",),
              doc="Multi-Krum: the mean of the m rows Krum scores best.")
register_rule("cc", CenteredClipping, CCOptions, aliases=("centered-clipping",),
              doc="Centered clipping (Karimireddy et al. 2021): iterated clipping of the "
              "rows around a centre.")
register_rule("mda", MDA, SubsetOptions, aliases=("minimum-diameter",),
              doc="Minimum-diameter averaging: the mean of the k − f rows of smallest "
              "diameter.")
register_rule("monna", MoNNA, MoNNAOptions, doc="MoNNA (Allouah et al. 2023): the mean of "
              "the k − f rows nearest to a trusted row.")
