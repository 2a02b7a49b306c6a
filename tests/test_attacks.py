"""Byzantine attacks against their definitions (hand-checked and brute force)."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest

from partialfl.attacks import (
    ALIE,
    IPM,
    BitFlip,
    GaussianNoise,
    Mimic,
    NoAttack,
    SignFlip,
    alie_z,
    flip_labels,
)
from partialfl.build import make_attack
from partialfl.registry import names as _names


def data(h=7, b=3, d=4, seed=0):
    g = np.random.default_rng(seed)
    return g.standard_normal((h, d)) + 2.0, g.standard_normal((b, d))


def test_alie_z_formula_by_hand():
    # n = 20, b = 2: s = floor(20/2 + 1) − 2 = 9, z = Φ⁻¹((20 − 9)/20) = Φ⁻¹(0.55).
    assert alie_z(20, 2) == pytest.approx(0.12566134685507402, rel=1e-12)
    # n = 50, b = 12 (Baruch et al.'s example): s = 14, z = Φ⁻¹(0.72).
    assert alie_z(50, 12) == pytest.approx(NormalDist().inv_cdf(36 / 50))
    with pytest.raises(ValueError, match="undefined"):
        alie_z(4, 3)  # s = 0: (n − s)/n = 1


def test_alie_by_hand_and_brute_force():
    honest = np.array([[0.0, 4.0], [2.0, 4.0]])  # mean [1, 4], population std [1, 0]
    own = np.zeros((3, 2))
    out = ALIE(z=1.5)(honest, own, None)
    np.testing.assert_allclose(out, np.tile([-0.5, 4.0], (3, 1)))
    honest, own = data()
    out = ALIE()(honest, own, None)
    z = alie_z(10, 3)
    for row in out:
        for j in range(honest.shape[1]):
            col = honest[:, j]
            mu = sum(col) / len(col)
            sd = (sum((c - mu) ** 2 for c in col) / len(col)) ** 0.5
            assert row[j] == pytest.approx(mu - z * sd, rel=1e-12)


def test_ipm_sign_flip_noattack():
    honest, own = data()
    np.testing.assert_allclose(IPM(0.5)(honest, own, None),
                               np.tile(-0.5 * honest.mean(0), (3, 1)))
    np.testing.assert_array_equal(SignFlip()(honest, own, None), -own)
    out = NoAttack()(honest, own, None)
    np.testing.assert_array_equal(out, own)
    assert out is not own


def test_gaussian_noise():
    honest, own = data()
    for center, c in (("zero", 0.0), ("mean", honest.mean(0)), ("own", own)):
        out = GaussianNoise(sigma=2.0, center=center)(honest, own, np.random.default_rng(5))
        noise = 2.0 * np.random.default_rng(5).standard_normal(own.shape)
        np.testing.assert_allclose(out, c + noise)
    big = GaussianNoise(sigma=3.0)(np.zeros((1, 200)), np.zeros((200, 200)),
                                   np.random.default_rng(0))
    assert abs(big.mean()) < 0.05 and abs(big.std() - 3.0) < 0.05


def test_bit_flip_by_hand():
    own = np.array([[1.0, 0.5, -2.0, 3.0]])
    none = np.zeros((0, 4))
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(BitFlip(bits=(63,), fraction=1.0)(none, own, rng), -own)
    out = BitFlip(bits=(62,), fraction=1.0)(none, own, rng)
    # Top exponent bit. 1.0 (biased exponent 1023) → 2047 with mantissa 0: +inf.
    # 0.5 (1022) → 2046: 2^1023.  −2.0 (1024) → 0, mantissa 0: −0.0.
    # 3.0 (1024, mantissa .5) → subnormal 0.5·2^−1022 = 2^−1023.
    assert out[0, 0] == np.inf
    assert out[0, 1] == 2.0**1023
    assert out[0, 2] == 0.0 and np.signbit(out[0, 2])
    assert out[0, 3] == 2.0**-1023
    # Lowest exponent bit: 1.0 (1023, odd) → 0.5; 0.5 (1022, even) → 1.0.
    np.testing.assert_array_equal(BitFlip(bits=(52,), fraction=1.0)(none, own, rng)[0, :2],
                                  [0.5, 1.0])


def test_bit_flip_brute_force():
    import struct

    own = np.random.default_rng(2).standard_normal((4, 6)) * 10.0
    bits = (0, 17, 52, 62, 63)
    out = BitFlip(bits=bits, fraction=0.5)(np.zeros((0, 6)), own, np.random.default_rng(9))
    hit = np.random.default_rng(9).random(own.shape) < 0.5  # the same draw
    for (i, j), x in np.ndenumerate(own):
        (u,) = struct.unpack("<Q", struct.pack("<d", x))
        if hit[i, j]:
            for b in bits:
                u ^= 1 << b
        (expected,) = struct.unpack("<d", struct.pack("<Q", u))
        assert out[i, j] == expected or (np.isnan(out[i, j]) and np.isnan(expected))


def test_bit_flip_fraction_and_involution():
    own = np.random.default_rng(1).standard_normal((50, 40))
    att = BitFlip(bits=(63, 3), fraction=0.3)
    once = att(np.zeros((0, 40)), own, np.random.default_rng(7))
    changed = (once != own).mean()
    assert 0.25 < changed < 0.35
    twice = att(np.zeros((0, 40)), once, np.random.default_rng(7))
    np.testing.assert_array_equal(twice, own)  # same coordinates flipped back


def test_mimic_brute_force():
    honest, own = data(h=9, d=5, seed=3)
    out = Mimic()(honest, own, None)
    C = honest - honest.mean(0)
    lam, V = np.linalg.eigh(C.T @ C)
    v = V[:, -1]  # top principal direction
    i = int(np.argmax(np.abs(C @ v)))
    np.testing.assert_array_equal(out, np.tile(honest[i], (3, 1)))
    np.testing.assert_array_equal(Mimic(target=2)(honest, own, None), np.tile(honest[2], (3, 1)))
    with pytest.raises(ValueError, match="target position 20"):
        Mimic(target=20)(honest, own, None)


def test_attacks_without_visible_good_clients_use_own():
    _, own = data()
    empty = np.zeros((0, own.shape[1]))
    np.testing.assert_allclose(IPM(1.0)(empty, own, None), np.tile(-own.mean(0), (3, 1)))
    np.testing.assert_allclose(ALIE(z=1.0)(empty, own, None),
                               np.tile(own.mean(0) - own.std(0), (3, 1)))


def test_make_attack_and_errors():
    for name in _names("attack"):
        att = make_attack(name)
        honest, own = data()
        out = att(honest, own, np.random.default_rng(0))
        assert out.shape == own.shape
    assert make_attack("ipm", epsilon=10.0).epsilon == 10.0
    assert make_attack("bit-flip", bits=[63]).bits == (63,)
    with pytest.raises(ValueError, match="'lie' is not allowed .*; allowed: alie, alie-opt"):
        make_attack("lie")
    with pytest.raises(ValueError, match="unknown key 'attack.sigma'.*epsilon"):
        make_attack("ipm", sigma=1.0)
    with pytest.raises(ValueError, match="'label-flip' is not allowed"):
        make_attack("label-flip")
    with pytest.raises(ValueError, match="epsilon must be a positive"):
        IPM(0.0)
    with pytest.raises(ValueError, match="bits must be"):
        BitFlip(bits=(64,))
    with pytest.raises(ValueError, match="unknown center"):
        GaussianNoise(center="median")
    with pytest.raises(ValueError, match="dimension 4"):
        SignFlip()(np.zeros((2, 4)), np.zeros((1, 3)), None)


def test_flip_labels():
    y = np.array([0, 1, 2, 9, 5])
    np.testing.assert_array_equal(flip_labels(y, 10), [9, 8, 7, 0, 4])
    np.testing.assert_array_equal(flip_labels(flip_labels(y, 10), 10), y)
    np.testing.assert_array_equal(flip_labels(y, 10, mode="shift", shift=3), [3, 4, 5, 2, 8])
    assert (flip_labels(y, 10) != y).all()
    with pytest.raises(ValueError, match=r"integers in \[0, 5\)"):
        flip_labels(y, 5)
    with pytest.raises(ValueError, match="unknown mode"):
        flip_labels(y, 10, mode="random")
    torch = pytest.importorskip("torch")
    t = flip_labels(torch.tensor([0, 1, 61]), 62)
    assert isinstance(t, torch.Tensor) and t.tolist() == [61, 60, 0]
