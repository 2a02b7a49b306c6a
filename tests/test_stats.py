"""Bootstrap intervals, paired differences, verdicts and power on synthetic data with a known
truth (partialfl.stats)."""

from __future__ import annotations

import numpy as np
import pytest

from partialfl.stats import (
    MDE_FACTOR,
    VERDICTS,
    accuracy_interval,
    clipped_log10,
    expanded_quantiles,
    log_error_ratio,
    paired_difference,
    pooled_accuracy,
    seed_mean_interval,
)

NO_DIFF = VERDICTS[2]


def synthetic(reps: int, clients: int, gain: float, seed: int, seeds: int = 1):
    """``reps`` independent paired data sets ``[reps, seeds, clients]``: client m has 5..29
    test examples and a base accuracy p_m ~ Beta(8, 2); per example, one latent uniform u
    decides both methods (baseline correct if u < p_m, method if u < p_m + gain), and each
    prediction is flipped independently with probability 5% (so the methods are strongly
    but not perfectly correlated, as two trained models are)."""
    rng = np.random.default_rng(seed)
    t = np.broadcast_to(rng.integers(5, 30, size=(reps, 1, clients)), (reps, seeds, clients))
    p = rng.beta(8, 2, size=(reps, 1, clients, 1))
    n = 29
    u = rng.random((reps, seeds, clients, n))
    mask = np.arange(n) < t[..., None]

    def correct(q):
        flip = rng.random(u.shape) < 0.05
        return (((u < q) ^ flip) & mask).sum(-1).astype(float)

    return correct(p + gain), t.astype(float), correct(p), t.astype(float)


def true_gain(gain: float, reps: int, clients: int, seed: int) -> float:
    """The expected pooled difference of :func:`synthetic` (gain shrinks by clipping at 1 and
    by the 5% flips), measured on a large sample."""
    c, t, bc, bt = synthetic(reps, clients, gain, seed)
    return float((c.sum() - bc.sum()) / t.sum())


def test_pooled_accuracy_and_point_estimates():
    c = np.array([[1, 2, 3], [2, 2, 3]])
    t = np.array([[2, 4, 4], [2, 4, 4]])
    assert pooled_accuracy(c, t) == pytest.approx((6 / 10 + 7 / 10) / 2)
    iv = accuracy_interval(c, t, n_boot=500)
    assert iv.estimate == pytest.approx(0.65) and iv.low <= iv.estimate <= iv.high
    assert (iv.clients, iv.seeds, iv.examples) == (3, 2, 10)
    d = paired_difference(c, t, c - 1, t, n_boot=500)
    assert d.estimate == pytest.approx(0.3)


def test_identical_methods_give_a_zero_width_interval_and_no_verdict():
    c, t, _, _ = synthetic(1, 30, 0.0, 0)
    d = paired_difference(c[0], t[0], c[0], t[0], n_boot=500)
    assert (d.estimate, d.low, d.high, d.se) == (0.0, 0.0, 0.0, 0.0)
    assert d.verdict == NO_DIFF


def test_a_constant_per_example_gain_is_certain():
    """Every client gains the same fraction of its examples: every bootstrap replicate has the
    same difference, so the interval is a point and the verdict is 'better' / 'worse'."""
    t = np.full((1, 20), 10.0)
    base = np.full((1, 20), 5.0)
    up = paired_difference(base + 1, t, base, t, n_boot=500)
    assert up.low == pytest.approx(0.1) and up.high == pytest.approx(0.1)
    assert up.verdict == "better"
    assert paired_difference(base - 1, t, base, t, n_boot=500).verdict == "worse"


def test_bootstrap_se_matches_the_closed_form_for_equal_sizes():
    """One seed, equal test sizes: D = mean_m d_m / t, whose bootstrap SE is the plug-in
    sd(d)/√M (ddof 0); with B = 4000 replicates it agrees to a few percent."""
    rng = np.random.default_rng(3)
    t = np.full(50, 20.0)
    base = rng.integers(10, 20, size=50).astype(float)
    meth = np.clip(base + rng.integers(-3, 4, size=50), 0, 20)
    d = paired_difference(meth, t, base, t, seed=1)
    closed = np.std((meth - base) / 20) / np.sqrt(50)
    assert d.se == pytest.approx(closed, rel=0.05)
    assert d.mde == pytest.approx(MDE_FACTOR * d.se) and MDE_FACTOR == pytest.approx(2.80, 1e-3)


def test_seed_fixed_and_reproducible():
    c, t, bc, bt = synthetic(1, 25, 0.02, 5)
    a = paired_difference(c[0], t[0], bc[0], bt[0], seed=7)
    assert a == paired_difference(c[0], t[0], bc[0], bt[0], seed=7)
    assert a != paired_difference(c[0], t[0], bc[0], bt[0], seed=8)


def test_pairing_detects_what_separate_intervals_cannot():
    """Clients differ a lot (accuracy 0.3..1), the method adds exactly one correct example on
    40% of clients: the separate intervals of the two accuracies overlap, the paired
    difference (the same clients in every replicate) is clearly positive."""
    rng = np.random.default_rng(0)
    t = np.full(40, 25.0)
    base = np.round(rng.uniform(0.3, 0.95, 40) * 25)
    meth = base + (rng.random(40) < 0.4)
    a, b = accuracy_interval(meth, t), accuracy_interval(base, t)
    assert a.low < b.high  # overlapping
    d = paired_difference(meth, t, base, t)
    assert d.verdict == "better" and d.low > 0


def test_expanded_quantiles():
    lo, hi = expanded_quantiles(0.95, 10)
    assert lo < 0.025 and hi == pytest.approx(1 - lo)
    # tends to the plain percentile interval with many clients
    assert expanded_quantiles(0.95, 100000)[0] == pytest.approx(0.025, abs=1e-4)
    with pytest.raises(ValueError, match="at least 2 clients"):
        expanded_quantiles(0.95, 1)


def test_no_gain_gives_no_detectable_difference_in_95_percent_of_repetitions():
    """400 independent data sets without a true difference (40 clients, one seed): the 95%
    interval should miss 0 in 5% of them. Measured once over 5 × 1000 repetitions of this
    generator: 5.0% ± 0.3% (module docstring); the assertion allows 2.5 Monte Carlo standard
    errors of 400 repetitions (≈ 2.7 points) above the nominal 5%."""
    iv = paired_difference(*synthetic(400, 40, 0.0, 11))
    rate = np.mean([i.verdict == NO_DIFF for i in iv])
    assert rate >= 0.95 - 2.5 * np.sqrt(0.05 * 0.95 / 400), rate
    # and the errors are not all on one side
    assert sum(i.verdict == "better" for i in iv) < 0.04 * 400
    assert sum(i.verdict == "worse" for i in iv) < 0.04 * 400


def test_a_real_gain_is_detected_and_the_mde_means_80_percent_power():
    """A gain of twice the reported MDE is detected ('better') almost always; a gain equal to
    the MDE in about 80% of the repetitions (what the MDE promises)."""
    clients = 40
    null = paired_difference(*synthetic(100, clients, 0.0, 21))
    mde = float(np.mean([i.mde for i in null]))
    # the generator's nominal gain g gives a smaller pooled gain: find g for a target
    shrink = true_gain(0.05, 400, clients, 22) / 0.05
    strong = paired_difference(*synthetic(200, clients, 2 * mde / shrink, 23))
    assert np.mean([i.verdict == "better" for i in strong]) >= 0.97
    at_mde = paired_difference(*synthetic(400, clients, mde / shrink, 24))
    power = np.mean([i.verdict == "better" for i in at_mde])
    assert 0.65 <= power <= 0.92, power
    assert not any(i.verdict == "worse" for i in strong)


def test_seeds_are_resampled_too():
    """Two seeds whose methods disagree in sign: resampling seeds widens the interval beyond
    the client-only one."""
    c, t, bc, bt = synthetic(1, 30, 0.0, 31, seeds=2)
    c, t, bc, bt = c[0], t[0], bc[0], bt[0]
    c[0] = np.minimum(bc[0] + 2, t[0])  # seed 0: the method is much better
    c[1] = np.maximum(bc[1] - 2, 0)  # seed 1: much worse
    both = paired_difference(c, t, bc, bt)
    clients_only = paired_difference(c, t, bc, bt, resample_seeds=False)
    assert both.seeds == 2
    assert both.high - both.low > 2 * (clients_only.high - clients_only.low)


def test_bad_input_is_refused_with_a_clear_error():
    t = np.full(5, 10.0)
    with pytest.raises(ValueError, match="same shape"):
        accuracy_interval(np.ones(5), np.ones(4))
    with pytest.raises(ValueError, match="0 <= correct <= total"):
        accuracy_interval(t + 1, t)
    with pytest.raises(ValueError, match="finite"):
        accuracy_interval(np.full(5, np.nan), t)
    with pytest.raises(ValueError, match="no evaluated example"):
        accuracy_interval(np.zeros(5), np.zeros(5))
    with pytest.raises(ValueError, match="same seeds and clients"):
        paired_difference(np.ones(5), t, np.ones(4), np.full(4, 10.0))
    with pytest.raises(ValueError, match="level"):
        accuracy_interval(np.ones(5), t, level=1.5)
    with pytest.raises(ValueError, match="n_boot"):
        accuracy_interval(np.ones(5), t, n_boot=10)


# ----------------------------------------------------------------- final errors over seeds
def log_normal_errors(reps: int, seeds: int, gain: float, seed: int, noise: float = 0.3):
    """``reps`` paired data sets of final errors ``[reps, seeds]``: seed s draws a problem
    whose difficulty moves both methods' log10 error by a common N(−8, 3²) amount (the paired
    part); the method ends ``gain`` orders of magnitude below the reference, each run adds
    N(0, noise²) orders of its own. So D_s = log10 ref − log10 method ~ N(gain, 2·noise²)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(-8, 3, (reps, seeds))
    base = 10 ** (a + rng.normal(0, noise, (reps, seeds)))
    meth = 10 ** (a - gain + rng.normal(0, noise, (reps, seeds)))
    return meth, base


def test_seed_mean_interval_is_the_t_interval():
    d = np.array([1.0, 2.0, 4.0])
    iv = seed_mean_interval(d)
    se = np.std(d, ddof=1) / np.sqrt(3)
    # t_{2, 0.975} = 4.3027, t_{2, 0.80} = 1.0607
    assert iv.estimate == pytest.approx(7 / 3) and iv.se == pytest.approx(se)
    assert iv.high - iv.estimate == pytest.approx(4.302653 * se, rel=1e-5)
    assert iv.mde == pytest.approx((4.302653 + 1.060660) * se, rel=1e-5)
    assert iv.seeds == 3 and iv.verdict == "no detectable difference at this size"
    assert seed_mean_interval([1.0, 1.1, 0.9]).verdict == "better"
    assert seed_mean_interval([-1.0, -1.1, -0.9]).verdict == "worse"


def test_log_error_ratio_counts_orders_of_magnitude_and_clips():
    iv = log_error_ratio([1e-10, 1e-9], [1e-8, 1e-7])  # 2 orders lower on both seeds
    assert iv.estimate == pytest.approx(2.0) and iv.se == pytest.approx(0.0, abs=1e-12)
    assert iv.verdict == "better"
    # both at the rounding floor: no difference; diverged (inf / NaN / huge) = the ceiling
    assert log_error_ratio([0.0, 1e-40], [1e-35, 0.0]).estimate == 0.0
    assert clipped_log10([np.inf, np.nan, 1e9, 0.0]).tolist() == [3.0, 3.0, 3.0, -30.0]
    assert log_error_ratio([np.inf, np.nan], [1e-3, 1e-3]).estimate == pytest.approx(-6.0)
    # cells of one seed are averaged before the interval over seeds
    cells = log_error_ratio([[1e-4, 1e-2], [1e-4, 1e-2]], [[1e-2, 1e-2], [1e-2, 1e-2]])
    assert cells.estimate == pytest.approx(1.0) and cells.seeds == 2


def test_no_difference_in_final_errors_is_not_declared_in_95_percent_of_repetitions():
    """1000 data sets of 3 seeds without a true difference: the t interval covers 0 in 95%
    (exact for normal D_s); the assertion allows 2.5 Monte Carlo SEs."""
    meth, base = log_normal_errors(1000, 3, 0.0, 1)
    iv = [log_error_ratio(m, b) for m, b in zip(meth, base)]
    rate = np.mean([i.verdict == NO_DIFF for i in iv])
    assert rate >= 0.95 - 2.5 * np.sqrt(0.05 * 0.95 / 1000), rate
    assert sum(i.verdict == "better" for i in iv) < 0.04 * 1000
    assert sum(i.verdict == "worse" for i in iv) < 0.04 * 1000


def test_a_real_reduction_of_the_final_error_is_detected():
    """Twice the average reported MDE is detected ('better') almost always; the MDE itself
    in roughly 70% of repetitions (the SE of 3 seeds is itself uncertain)."""
    null = [log_error_ratio(m, b) for m, b in zip(*log_normal_errors(500, 3, 0.0, 2))]
    mde = float(np.mean([i.mde for i in null]))
    strong = [log_error_ratio(m, b) for m, b in zip(*log_normal_errors(500, 3, 2 * mde, 3))]
    assert np.mean([i.verdict == "better" for i in strong]) >= 0.97
    at_mde = [log_error_ratio(m, b) for m, b in zip(*log_normal_errors(1000, 3, mde, 4))]
    power = np.mean([i.verdict == "better" for i in at_mde])
    assert 0.55 <= power <= 0.9, power
    # and a worse method is called worse
    worse = [log_error_ratio(b, m) for m, b in zip(*log_normal_errors(200, 3, 2 * mde, 5))]
    assert np.mean([i.verdict == "worse" for i in worse]) >= 0.97


def test_final_error_comparisons_refuse_bad_input():
    with pytest.raises(ValueError, match="at least 2 seeds"):
        log_error_ratio([1e-3], [1e-2])
    with pytest.raises(ValueError, match="same shape"):
        log_error_ratio([1e-3, 1e-3], [1e-2])
    with pytest.raises(ValueError, match=">= 0"):
        log_error_ratio([-1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="floor"):
        clipped_log10([1.0], floor=1.0, ceiling=0.5)
    with pytest.raises(ValueError, match="finite"):
        seed_mean_interval([1.0, np.nan])
