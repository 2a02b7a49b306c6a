"""Uncertainty of pooled accuracies and of paired method differences, from per-client counts.

Data of one method: ``correct[s, m]`` and ``total[s, m]`` (metric counts c and t of client m
in the run with seed s, e.g. correct test images and test images), S seeds × M clients; every
method of a comparison is evaluated on the same clients with the same seeds (a *paired*
design). The statistics:

    pooled accuracy      A = (1/S) Σ_s  Σ_m c[s,m] / Σ_m t[s,m]
    paired difference    D = A(method) − A(baseline)

**Bootstrap (seed-fixed, vectorised).** Clients and seeds are crossed factors, so each of B
replicates resamples both independently (the "pigeonhole" bootstrap for crossed designs):
M clients drawn with replacement, and, when ``resample_seeds`` and S > 1, S seeds drawn with
replacement; a replicate's statistic is the same formula with every client and seed weighted
by how often it was drawn. For a difference the *same* draw is applied to both methods, which
is what makes the comparison paired (the client-to-client spread cancels out). The draws come
from ``partialfl.rng.generator(seed, "bootstrap", M, S, B)``: the same inputs give the same
interval. SE is the replicates' standard deviation. The interval is the *expanded percentile*
interval (Hesterberg 2015): the replicates' quantiles at α'/2 and 1 − α'/2 with
Φ⁻¹(α'/2) = −√(M/(M−1)) · t_{M−1, 1−α/2}, α = 1 − ``level``, which corrects the plain
percentile interval's under-coverage with few clients (the bootstrap's variance is (M−1)/M of
the plug-in one, and a normal quantile stands in for a t quantile). Measured on synthetic
paired data with no true difference (the generator of tests/test_stats.py, 5 × 1000
repetitions, one seed): the plain 95% percentile interval (B = 1000) excluded 0 in 5.8% of them
(M = 40 clients) and 6.6% (M = 20); the expanded one with B = 4000 in 5.0% ± 0.3% (M = 40) and
5.1% ± 0.3% (M = 84), i.e. at its nominal 5%. With several seeds, resampling them as well is
conservative (1% at S = 3 seeds that differ little).

**Verdict** from the interval of D: "better" if it lies above 0, "worse" if below, otherwise
"no detectable difference at this size".

**Power.** With a two-sided test at 95% confidence and power 80%, the smallest true
difference that is detected is (z₀.₉₇₅ + z₀.₈₀)·SE = (1.960 + 0.842)·SE ≈ 2.80·SE (the
*minimum detectable difference*, MDE); anything smaller than 1.96·SE cannot be declared at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partialfl.rng import generator

#: z₀.₉₇₅ + z₀.₈₀: the MDE multiplier of the SE (95% two-sided confidence, 80% power)
MDE_FACTOR = 1.959964 + 0.841621
DEFAULT_BOOT = 4000
VERDICTS = ("better", "worse", "no detectable difference at this size")


@dataclass(frozen=True)
class Interval:
    """A bootstrap estimate: point estimate, percentile interval, SE, and its sample size
    (clients, seeds, evaluated examples per seed summed over clients)."""

    estimate: float
    low: float
    high: float
    se: float
    level: float
    clients: int
    seeds: int
    examples: int
    n_boot: int

    @property
    def mde(self) -> float:
        """Minimum detectable difference (95% confidence, 80% power): 2.80 · SE."""
        return MDE_FACTOR * self.se

    @property
    def verdict(self) -> str:
        """For a difference: "better" (interval above 0), "worse" (below 0) or "no
        detectable difference at this size"."""
        if self.low > 0:
            return VERDICTS[0]
        if self.high < 0:
            return VERDICTS[1]
        return VERDICTS[2]


def _counts(correct, total, what: str) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(correct, dtype=float)
    t = np.asarray(total, dtype=float)
    if c.ndim == 1:
        c = c[None]
    if t.ndim == 1:
        t = t[None]
    if c.shape != t.shape or c.ndim < 2:
        raise ValueError(f"{what}: correct {c.shape} and total {t.shape} must be arrays of the "
                         "same shape [..., seeds, clients]")
    if not (np.isfinite(c).all() and np.isfinite(t).all()):
        raise ValueError(f"{what}: counts must be finite")
    if (c < 0).any() or (c > t + 1e-9).any():
        raise ValueError(f"{what}: counts must satisfy 0 <= correct <= total")
    if (t.sum(-1) <= 0).any():
        raise ValueError(f"{what}: a seed has no evaluated example (total = 0 for every client)")
    return c, t


def pooled_accuracy(correct, total) -> np.ndarray | float:
    """A = mean over seeds of Σ_m c / Σ_m t (arrays ``[..., seeds, clients]``)."""
    c, t = _counts(correct, total, "pooled_accuracy")
    a = (c.sum(-1) / t.sum(-1)).mean(-1)
    return float(a) if a.ndim == 0 else a


def _draws(m: int, s: int, n_boot: int, seed: int, resample_seeds: bool
           ) -> tuple[np.ndarray, np.ndarray]:
    """Multiplicities ``[B, M]`` of the clients and ``[B, S]`` of the seeds in each replicate."""
    rng = generator(seed, "bootstrap", m, s, n_boot)
    wc = rng.multinomial(m, np.full(m, 1.0 / m), size=n_boot).astype(float)
    if resample_seeds and s > 1:
        ws = rng.multinomial(s, np.full(s, 1.0 / s), size=n_boot).astype(float)
    else:
        ws = np.ones((n_boot, s))
    return wc, ws


def _replicates(c: np.ndarray, t: np.ndarray, wc: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """The pooled accuracy of every replicate, ``[..., B]``."""
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.einsum("bm,...sm->...bs", wc, c) / np.einsum("bm,...sm->...bs", wc, t)
    return (acc * ws).sum(-1) / ws.shape[-1]


def expanded_quantiles(level: float, m: int) -> tuple[float, float]:
    """The replicate quantiles of the expanded percentile interval at ``level`` with ``m``
    resampled units: (α'/2, 1 − α'/2) with Φ⁻¹(α'/2) = −√(m/(m−1)) · t_{m−1, (1+level)/2}."""
    from scipy.special import stdtrit  # the t quantile (scipy.stats is slow to import)

    if m < 2:
        raise ValueError(f"an interval over clients needs at least 2 clients, got {m}")
    z = np.sqrt(m / (m - 1)) * float(stdtrit(m - 1, (1 + level) / 2))
    q = 0.5 * math.erfc(z / math.sqrt(2))  # Φ(−z)
    return q, 1 - q


def _interval(est, reps: np.ndarray, level: float, m: int, s: int, examples, n_boot: int
              ) -> Interval | list:
    lo, hi = np.nanquantile(reps, expanded_quantiles(level, m), axis=-1)
    se = np.nanstd(reps, axis=-1, ddof=1)
    est = np.asarray(est)
    if est.ndim == 0:
        return Interval(float(est), float(lo), float(hi), float(se), level, m, s,
                        int(examples), n_boot)
    return [Interval(float(e), float(a), float(b), float(d), level, m, s, int(x), n_boot)
            for e, a, b, d, x in zip(est.ravel(), lo.ravel(), hi.ravel(), se.ravel(),
                                     np.broadcast_to(examples, est.shape).ravel())]


def _check(level: float, n_boot: int) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if not isinstance(n_boot, int | np.integer) or n_boot < 100:
        raise ValueError(f"n_boot must be an integer >= 100, got {n_boot!r}")


def accuracy_interval(correct, total, *, level: float = 0.95, n_boot: int = DEFAULT_BOOT,
                      seed: int = 0, resample_seeds: bool = True) -> Interval | list[Interval]:
    """Bootstrap interval of one method's pooled accuracy (see the module docstring).
    Arrays ``[seeds, clients]`` (or ``[clients]``: one seed) give one :class:`Interval`;
    leading batch axes give a flat list of them."""
    _check(level, n_boot)
    c, t = _counts(correct, total, "accuracy_interval")
    s, m = c.shape[-2:]
    wc, ws = _draws(m, s, n_boot, seed, resample_seeds)
    return _interval(pooled_accuracy(c, t), _replicates(c, t, wc, ws), level, m, s,
                     t.sum(-1).mean(-1), n_boot)


def paired_difference(correct, total, base_correct, base_total, *, level: float = 0.95,
                      n_boot: int = DEFAULT_BOOT, seed: int = 0,
                      resample_seeds: bool = True) -> Interval | list[Interval]:
    """Bootstrap interval of D = A(method) − A(baseline) with the same clients and seeds
    resampled for both (paired). Shapes as in :func:`accuracy_interval`; both methods must
    have the same shape (the same clients and seeds, in the same order)."""
    _check(level, n_boot)
    c, t = _counts(correct, total, "paired_difference (method)")
    bc, bt = _counts(base_correct, base_total, "paired_difference (baseline)")
    if c.shape != bc.shape:
        raise ValueError(f"paired_difference: method counts {c.shape} and baseline counts "
                         f"{bc.shape} must cover the same seeds and clients")
    s, m = c.shape[-2:]
    wc, ws = _draws(m, s, n_boot, seed, resample_seeds)
    reps = _replicates(c, t, wc, ws) - _replicates(bc, bt, wc, ws)
    est = np.asarray(pooled_accuracy(c, t)) - np.asarray(pooled_accuracy(bc, bt))
    return _interval(est, reps, level, m, s, t.sum(-1).mean(-1), n_boot)
