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

**Final errors over seeds (the least-squares studies).** Where a study's only randomness is
its seed (the data, the attack, the faults, the device speeds are drawn from it) and a run
reports one final error e > 0 (e.g. ‖θ − θ*‖² / ‖θ*‖²), two methods run with the same seeds
are compared by the paired per-seed difference of log10 errors

    D_s = log10 e_ref[s] − log10 e[s]     ("orders of magnitude below the reference")

(with several cells per seed, e.g. one per attack, D_s is their mean). Errors are first
clipped to [``floor``, ``ceiling``]: below the floor (default 1e-30, the double-precision
rounding level of a relative squared distance) differences are rounding noise, and a run
that diverged (non-finite, or above the ceiling, default 1e3 = a thousand times the starting
error) counts as the ceiling. The S seeds are independent draws, so D̄ = (1/S) Σ_s D_s has
the *t interval* D̄ ± t_{S−1, (1+level)/2} · sd(D)/√S (exact when D_s is normal; the
bootstrap is useless with 3 seeds), the verdict as above ("better": lower error than the
reference), and MDE = (t_{S−1, 0.975} + t_{S−1, 0.80}) · SE (the t analogue of 2.80 · SE;
14.1 · SE at S = 2, 5.4 · SE at S = 3). One seed gives no interval. Measured on
synthetic log-normal errors (tests/test_stats.py, S = 3, 4000 repetitions without a true
difference): 95.6% gave "no detectable difference"; a true difference equal to the average
reported MDE was detected in 69% of 2000 repetitions (with 2 degrees of freedom the SE
itself is uncertain, so the 80% of the MDE's definition is approximate), twice the MDE in
99%.
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
    #: MDE / SE: 2.80 for the bootstrap, t_{S−1,0.975} + t_{S−1,0.80} for a t interval
    mde_factor: float = MDE_FACTOR

    @property
    def mde(self) -> float:
        """Minimum detectable difference (95% confidence, 80% power): ``mde_factor`` · SE
        (2.80 · SE for the bootstrap)."""
        return self.mde_factor * self.se

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


#: the largest count of test examples of one client taken as a count (floats hold it exactly)
MAX_COUNT = 2 ** 53


def check_counts(m: dict, prefix: str = "per_client_test") -> None:
    """Raise ValueError, naming the key, unless the metrics dict ``m`` holds per-client counts
    the intervals can rest on: ``client_ids`` a list of distinct ids (strings or integers),
    ``{prefix}_correct`` and ``{prefix}_total`` lists of integers, one per client, with
    0 <= correct <= total < :data:`MAX_COUNT` (a crafted metrics.json was read as counts of
    another shape — nested lists, ``null``, 1e308 examples — and tabled as an accuracy)."""
    ids = m.get("client_ids")
    if (not isinstance(ids, list) or not all(isinstance(i, str | int) and not isinstance(
            i, bool) for i in ids) or len(set(ids)) != len(ids)):
        raise ValueError(f"client_ids is {str(ids)[:60]!r}, not a list of distinct client ids")
    cols = []
    for k in (f"{prefix}_correct", f"{prefix}_total"):
        v = m.get(k)
        if (not isinstance(v, list) or len(v) != len(ids) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and x == x
                and 0 <= x < MAX_COUNT and float(x).is_integer() for x in v)):
            raise ValueError(f"{k} is {str(v)[:60]!r}, not {len(ids)} counts (integers >= 0, "
                             "one per client id)")
        cols.append(v)
    if any(c > t for c, t in zip(*cols)):
        raise ValueError(f"{prefix}_correct exceeds {prefix}_total for a client")


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


def contrast_interval(terms, *, level: float = 0.95, n_boot: int = DEFAULT_BOOT,
                      seed: int = 0, resample_seeds: bool = True) -> Interval:
    """Bootstrap interval of a linear contrast L = Σ_j a_j A_j of pooled accuracies, with the
    same clients and seeds resampled for every term (paired): ``terms`` is a sequence of
    ``(a_j, correct [S, M], total [S, M])``, all of one shape. ``[(1, c, t), (−1, bc, bt)]``
    is :func:`paired_difference`; four terms give a difference of differences, e.g.
    (A − B at one setting) − (A − B at another) on the same clients and seeds."""
    _check(level, n_boot)
    terms = list(terms)
    if not terms:
        raise ValueError("contrast_interval needs at least one term")
    counts = [_counts(c, t, f"contrast_interval (term {j})")
              for j, (_, c, t) in enumerate(terms)]
    shape = counts[0][0].shape
    if any(c.shape != shape for c, _ in counts):
        raise ValueError(f"contrast_interval: every term must cover the same seeds and "
                         f"clients, got shapes {[c.shape for c, _ in counts]}")
    s, m = shape[-2:]
    wc, ws = _draws(m, s, n_boot, seed, resample_seeds)
    a = [float(t[0]) for t in terms]
    reps = sum(aj * _replicates(c, t, wc, ws) for aj, (c, t) in zip(a, counts))
    est = sum(aj * pooled_accuracy(c, t) for aj, (c, t) in zip(a, counts))
    return _interval(est, reps, level, m, s, counts[0][1].sum(-1).mean(-1), n_boot)


# ----------------------------------------------------------------- final errors over seeds
#: errors below this are rounding noise (relative squared distance in double precision)
ERROR_FLOOR = 1e-30
#: a diverged run (non-finite or above this, relative to the starting error) counts as this
ERROR_CEILING = 1e3


def clipped_log10(errors, floor: float = ERROR_FLOOR, ceiling: float = ERROR_CEILING
                  ) -> np.ndarray:
    """log10 of ``errors`` clipped to [floor, ceiling]; NaN and ±inf (a diverged run) count
    as the ceiling. Negative errors are refused."""
    if not 0 < floor < ceiling:
        raise ValueError(f"need 0 < floor < ceiling, got floor={floor}, ceiling={ceiling}")
    e = np.asarray(errors, dtype=float)
    if (e < 0).any():
        raise ValueError("errors must be >= 0 (NaN / inf count as diverged)")
    e = np.where(np.isfinite(e), e, ceiling)
    return np.log10(np.clip(e, floor, ceiling))


def t_quantile(df: int, q: float) -> float:
    """The q-quantile of Student's t with ``df`` degrees of freedom."""
    from scipy.special import stdtrit

    return float(stdtrit(df, q))


def seed_mean_interval(d, *, level: float = 0.95) -> Interval:
    """The t interval of the mean of S ≥ 2 independent per-seed values ``d`` (paired
    differences): D̄ ± t_{S−1,(1+level)/2} · sd(d)/√S, with MDE factor
    t_{S−1,0.975} + t_{S−1,0.80} (see the module docstring)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    d = np.asarray(d, dtype=float).ravel()
    if d.size < 2:
        raise ValueError(f"an interval over seeds needs at least 2 seeds, got {d.size}")
    if not np.isfinite(d).all():
        raise ValueError("per-seed values must be finite")
    s = d.size
    se = float(d.std(ddof=1) / math.sqrt(s))
    half = t_quantile(s - 1, (1 + level) / 2) * se
    est = float(d.mean())
    return Interval(est, est - half, est + half, se, level, 0, s, 0, 0,
                    mde_factor=t_quantile(s - 1, 0.975) + t_quantile(s - 1, 0.80))


def log_error_ratio(errors, base_errors, *, level: float = 0.95, floor: float = ERROR_FLOOR,
                    ceiling: float = ERROR_CEILING) -> Interval:
    """Paired comparison of final errors over seeds: D_s = log10 e_ref[s] − log10 e[s]
    (orders of magnitude below the reference; positive = the method ends closer), averaged
    over any further axes (cells of one seed), with its t interval over the S ≥ 2 seeds
    (:func:`seed_mean_interval`). ``errors`` and ``base_errors``: arrays ``[S]`` or
    ``[S, cells]`` of the same shape, row s of both from seed s."""
    e, b = np.asarray(errors, dtype=float), np.asarray(base_errors, dtype=float)
    if e.shape != b.shape or e.ndim == 0:
        raise ValueError(f"log_error_ratio: errors {e.shape} and reference errors {b.shape} "
                         "must be arrays of the same shape [seeds, ...]")
    d = clipped_log10(b, floor, ceiling) - clipped_log10(e, floor, ceiling)
    return seed_mean_interval(d.reshape(d.shape[0], -1).mean(1), level=level)


def ratio_of_sums(num, den, floor: float = 1e-12) -> float:
    """Σ num / max(Σ den, floor), both sums taken after dividing by the largest |value|: the
    nodes' finite sums give a finite ratio even where Σ num itself overflows float64 (two
    nodes' loss sums of 1.7e308 each over 2 clients: mean 1.7e308, not inf). A ratio beyond
    float64's range (a huge sum over a tiny weight) is clipped to its largest finite value."""
    a = np.atleast_1d(np.asarray(num, dtype=np.float64))
    b = np.atleast_1d(np.asarray(den, dtype=np.float64))
    s = float(max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))) or 1.0
    with np.errstate(over="ignore"):
        r = (a / s).sum() / max((b / s).sum(), floor / s)
    big = np.finfo(np.float64).max
    return float(np.clip(r, -big, big))
