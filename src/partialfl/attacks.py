"""What Byzantine clients send instead of their honest update.

Attacks are *omniscient*: an attack sees the honest updates of the good clients of the round
(``honest [h, d]``) and what the Byzantine clients themselves would have sent honestly
(``own [b, d]``), and returns the b vectors they send: ``attack(honest, own, rng) -> [b, d]``.
When no good client is visible in a round, attacks that need the good updates use ``own`` as
their estimate of them.

* :class:`ALIE` — A Little Is Enough (Baruch et al., 2019): every Byzantine client sends
  μ − z·σ (coordinate-wise mean and standard deviation of the good updates), with
  z = Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − b for n = h + b clients, unless z is given. σ is the
  population standard deviation (``ddof=0``, divisor h) by default; byzfl's
  ``ALittleIsEnough(tau)`` sends μ + τ·σ with the sample deviation (divisor h − 1), which is
  ``ALIE(z=-tau, ddof=1)``.
* :class:`IPM` — Inner Product Manipulation (Xie et al., 2020): −ε·μ.
* :class:`OptimizedALIE`, :class:`OptimizedIPM` — the same attacks with their scale (z, ε)
  tuned every round against the defence (byzfl's Optimal ALIE / Optimal IPM): a line search
  maximising ‖Agg(good ∪ Byzantine) − μ‖ (see :func:`line_search`). The defence is the
  server's aggregator of the round, handed over by the Byzantine wrapper (omniscient).
* :class:`Inf` — every coordinate +inf (a server must drop it, byzfl's ``Inf``).
* :class:`SignFlip` — −x for each Byzantine client's own honest update x.
* :class:`GaussianNoise` — c + N(0, σ²I) with c = 0, μ or the own update.
* :class:`BitFlip` — hardware-fault model: flips the given bits of the IEEE-754 float64
  representation of a random ``fraction`` of the coordinates of the own update (the default,
  bit 62 = top exponent bit, turns values into ~1e±300, inf or NaN).
* :class:`Mimic` (Karimireddy et al., 2022) — every Byzantine client copies one good client:
  the given position, or the one with the largest |projection| on the top principal direction
  of the centred good updates (the most "heterogeneous" one).
* :class:`NoAttack` — Byzantine clients behave honestly (control).

Label flipping is a data-level attack on classification data: :func:`flip_labels`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

import numpy as np

from partialfl import arrays
from partialfl.registry import option, register


class Attack(Protocol):
    """What Byzantine clients send: ``attack(honest [h, d], own [b, d], rng) -> [b, d]`` (an
    omniscient adversary sees the honest updates)."""

    def __call__(self, honest: np.ndarray, own: np.ndarray,
                 rng: np.random.Generator) -> np.ndarray: ...


def _inputs(honest, own) -> tuple[np.ndarray, np.ndarray]:
    honest = np.asarray(honest, dtype=np.float64)
    own = np.asarray(own, dtype=np.float64)
    if own.ndim != 2 or honest.ndim != 2:
        raise ValueError(f"attack inputs must be [h, d] and [b, d] matrices, got shapes "
                         f"{honest.shape} and {own.shape}")
    if len(honest) and honest.shape[1] != own.shape[1]:
        raise ValueError(f"honest updates have dimension {honest.shape[1]}, the Byzantine "
                         f"clients' own ones {own.shape[1]}")
    return honest, own


def _reference(honest: np.ndarray, own: np.ndarray) -> np.ndarray:
    return honest if len(honest) else own


def _finite_positive(value, name: str) -> float:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def alie_z(n: int, b: int) -> float:
    """Baruch et al.'s z_max: s = ⌊n/2 + 1⌋ − b, z = Φ⁻¹((n − s)/n)."""
    if not (isinstance(n, int | np.integer) and isinstance(b, int | np.integer) and 0 <= b <= n
            and n >= 1):
        raise ValueError(f"ALIE needs 0 <= b <= n clients, got n={n!r}, b={b!r}")
    s = math.floor(n / 2 + 1) - b
    p = (n - s) / n
    if not 0 < p < 1:
        raise ValueError(f"ALIE's z formula is undefined for n={n}, b={b} "
                         f"((n − s)/n = {p:.3g}); pass z explicitly")
    return NormalDist().inv_cdf(p)


@dataclass(frozen=True)
class NoAttack:
    """Byzantine clients send their own honest update (a control)."""

    name = "none"

    def __call__(self, honest, own, rng=None):
        return _inputs(honest, own)[1].copy()


def _check_ddof(ddof) -> None:
    if ddof not in (0, 1) or isinstance(ddof, bool):
        raise ValueError(f"ALIE: ddof must be 0 (population deviation) or 1 (sample), "
                         f"got {ddof!r}")


def _alie_vector(ref: np.ndarray, z: float, ddof: int) -> np.ndarray:
    sd = ref.std(0, ddof=ddof) if len(ref) > ddof else np.zeros(ref.shape[1])
    return ref.mean(0) - z * sd


@dataclass(frozen=True)
class ALIE:
    """μ − z·σ; z from :func:`alie_z` (n = h + b) when ``z`` is None; σ with ``ddof``."""

    z: float | None = option(None, "the attack factor (None: from the numbers of honest and "
                             "Byzantine clients)")
    ddof: int = option(0, "σ with ddof 0 (population) or 1 (sample)")
    name = "alie"

    def __post_init__(self) -> None:
        if self.z is not None and not (isinstance(self.z, int | float) and math.isfinite(self.z)):
            raise ValueError(f"ALIE: z must be a finite number or None, got {self.z!r}")
        _check_ddof(self.ddof)

    def z_for(self, h: int, b: int) -> float:
        """The ALIE factor z for h honest and b Byzantine clients (the given ``z`` if set)."""
        return float(self.z) if self.z is not None else alie_z(h + b, b)

    def __call__(self, honest, own, rng=None):
        honest, own = _inputs(honest, own)
        z = self.z_for(len(honest), len(own))
        return np.repeat(_alie_vector(_reference(honest, own), z, self.ddof)[None], len(own), 0)


@dataclass(frozen=True)
class IPM:
    """−ε·μ (ε small: a slightly negative inner product with the true mean; ε large: a big
    reversal)."""

    epsilon: float = option(0.1, "ε > 0: send −ε·(honest mean)")
    name = "ipm"

    def __post_init__(self) -> None:
        _finite_positive(self.epsilon, "IPM epsilon")

    def __call__(self, honest, own, rng=None):
        honest, own = _inputs(honest, own)
        return np.repeat((-self.epsilon * _reference(honest, own).mean(0))[None], len(own), 0)


@dataclass(frozen=True)
class Inf:
    """+inf in every coordinate."""

    name = "inf"

    def __call__(self, honest, own, rng=None):
        return np.full_like(_inputs(honest, own)[1], np.inf)


def line_search(objective, start: float, step: float, ratio: float, evals: int) -> float:
    """byzfl's expansion/contraction search for the scale maximising ``objective``: from
    ``start``, step forward while the objective grows (doubling the step), then try
    best + step with the step shrunk by ``ratio`` each time, ``evals`` evaluations in all."""
    best_x, best_y = start, objective(start)
    left = evals - 1
    while left > 0:  # expansion
        y = objective(best_x + step)
        left -= 1
        if y > best_y:
            best_x, best_y = best_x + step, y
            step *= 2
        else:
            step *= ratio
            break
    while left > 0:  # contraction
        y = objective(best_x + step)
        left -= 1
        if y > best_y:
            best_x, best_y = best_x + step, y
        step *= ratio
    return best_x


@dataclass(frozen=True)
class _Optimized:
    """An attack family x(s) whose scale s is tuned by :func:`line_search` against
    ``aggregator`` (set by :meth:`against`; None: the mean, byzfl's default): maximise
    ‖Agg(good ∪ b copies of x(s)) − μ‖."""

    aggregator: object = None
    evals: int = 20
    start: float = 0.0
    step: float = 10.0
    ratio: float = 0.8

    def __post_init__(self) -> None:
        if isinstance(self.evals, bool) or not (isinstance(self.evals, int) and self.evals >= 1):
            raise ValueError(f"{self.name}: evals must be an integer >= 1, got {self.evals!r}")
        for key in ("start", "step"):
            v = getattr(self, key)
            if not (isinstance(v, int | float) and math.isfinite(v)):
                raise ValueError(f"{self.name}: {key} must be a finite number, got {v!r}")
        if self.step == 0:
            raise ValueError(f"{self.name}: step must be non-zero")
        if not (isinstance(self.ratio, int | float) and 0.5 < self.ratio < 1):
            raise ValueError(f"{self.name}: ratio must be in (0.5, 1), got {self.ratio!r}")
        if self.aggregator is not None and not callable(self.aggregator):
            raise TypeError(f"{self.name}: aggregator must be callable, got {self.aggregator!r}")

    def against(self, aggregator):
        """This attack tuned against ``aggregator`` (the defence of the round)."""
        from dataclasses import replace

        return replace(self, aggregator=aggregator)

    def vector(self, ref: np.ndarray, scale: float) -> np.ndarray:  # pragma: no cover
        """The vector every Byzantine client sends at scale ``scale``."""
        raise NotImplementedError

    def scale(self, honest: np.ndarray, b: int) -> float:
        """The tuned scale for b Byzantine clients beside the good updates ``honest``."""
        agg = self.aggregator
        if agg is None:  # byzfl's default defence; the Byzantine wrapper sets the real one
            from partialfl.aggregation import Mean

            agg = Mean()
        mu = honest.mean(0)

        def objective(s: float) -> float:
            with np.errstate(all="ignore"):
                X = np.concatenate([honest, np.repeat(self.vector(honest, s)[None], b, 0)])
                X = X[np.isfinite(X).all(1)]  # what the server drops before aggregating
                if not len(X):
                    return -math.inf
                try:
                    out = np.asarray(agg(X, np.ones(len(X))), dtype=np.float64)
                except ValueError:  # the defence refuses these inputs: no damage
                    return -math.inf
                dist = float(np.linalg.norm(out - mu))
            return dist if math.isfinite(dist) else -math.inf

        return line_search(objective, float(self.start), float(self.step), float(self.ratio),
                           self.evals)

    def __call__(self, honest, own, rng=None):
        honest, own = _inputs(honest, own)
        ref = _reference(honest, own)
        s = self.scale(ref, len(own))
        return np.repeat(self.vector(ref, s)[None], len(own), 0)


@dataclass(frozen=True)
class OptimizedALIE(_Optimized):
    """μ − z·σ with z tuned against the defence (σ with ``ddof``; byzfl's Optimal ALIE is
    ``step=-10.0, ddof=1``: its μ + τσ with τ searched upwards)."""

    ddof: int = 0
    name = "alie-opt"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_ddof(self.ddof)

    def vector(self, ref, scale):
        """μ − scale·σ."""
        return _alie_vector(ref, scale, self.ddof)


@dataclass(frozen=True)
class OptimizedIPM(_Optimized):
    """−ε·μ with ε tuned against the defence (byzfl's Optimal IPM)."""

    name = "ipm-opt"

    def vector(self, ref, scale):
        """−scale·μ."""
        return -scale * ref.mean(0)


@dataclass(frozen=True)
class SignFlip:
    """−x: each Byzantine client sends the negation of its own honest update."""

    name = "sign-flip"

    def __call__(self, honest, own, rng=None):
        return -_inputs(honest, own)[1]


@dataclass(frozen=True)
class GaussianNoise:
    """c + σ·N(0, I): c = 0 (``center="zero"``), the good mean μ, or the own update."""

    sigma: float = option(1.0, "noise std σ > 0")
    center: str = option("zero", "zero, mean (of the honest updates) or own")
    name = "gaussian"

    def __post_init__(self) -> None:
        _finite_positive(self.sigma, "Gaussian attack sigma")
        if self.center not in ("zero", "mean", "own"):
            raise ValueError(f"Gaussian attack: unknown center {self.center!r}; allowed: "
                             "'zero', 'mean', 'own'")

    def __call__(self, honest, own, rng):
        honest, own = _inputs(honest, own)
        if self.center == "zero":
            c = np.zeros_like(own)
        elif self.center == "mean":
            c = np.repeat(_reference(honest, own).mean(0)[None], len(own), 0)
        else:
            c = own
        return c + self.sigma * rng.standard_normal(own.shape)


@dataclass(frozen=True)
class BitFlip:
    """Flip ``bits`` (0 = least significant mantissa bit, 63 = sign) of the float64
    representation of a random ``fraction`` of the coordinates of the own update."""

    bits: tuple[int, ...] = option((62,), "float64 bits to flip (0: lowest mantissa bit, 63: sign)")
    fraction: float = option(0.1, "fraction of coordinates flipped, in (0, 1]")
    name = "bit-flip"

    def __post_init__(self) -> None:
        bits = tuple(self.bits)
        if not bits or not all(isinstance(b, int | np.integer) and 0 <= b <= 63 for b in bits):
            raise ValueError(f"bit flip: bits must be a non-empty tuple of ints in [0, 63], "
                             f"got {self.bits!r}")
        object.__setattr__(self, "bits", bits)
        if not (isinstance(self.fraction, int | float) and 0 < self.fraction <= 1):
            raise ValueError(f"bit flip: fraction must be in (0, 1], got {self.fraction!r}")

    def __call__(self, honest, own, rng):
        _, own = _inputs(honest, own)
        out = np.ascontiguousarray(own, dtype=np.float64).copy()
        u = out.view(np.uint64)
        mask = np.uint64(0)
        for b in self.bits:
            mask |= np.uint64(1) << np.uint64(b)
        hit = rng.random(out.shape) < self.fraction
        u[hit] ^= mask
        return out


@dataclass(frozen=True)
class Mimic:
    """Copy one good client: position ``target`` in the honest stack, or (None) the one with
    the largest |⟨x_i − μ, v⟩|, v the top right-singular vector of the centred good updates."""

    target: int | None = option(None, "the honest position to copy (None: the most extreme one)")
    name = "mimic"

    def __post_init__(self) -> None:
        if self.target is not None and not (isinstance(self.target, int) and self.target >= 0):
            raise ValueError(f"mimic: target must be a non-negative position or None, "
                             f"got {self.target!r}")

    def choose(self, honest: np.ndarray) -> int:
        """The position of the honest update to copy: ``target``, else the one farthest along the
        top principal direction of the centred honest updates."""
        if self.target is not None:
            if self.target >= len(honest):
                raise ValueError(f"mimic: target position {self.target} but only "
                                 f"{len(honest)} good updates")
            return self.target
        C = honest - honest.mean(0)
        if not np.any(C):
            return 0
        v = np.linalg.svd(C, full_matrices=False)[2][0]
        return int(np.argmax(np.abs(C @ v)))

    def __call__(self, honest, own, rng=None):
        honest, own = _inputs(honest, own)
        ref = _reference(honest, own)
        return np.repeat(ref[self.choose(ref)][None], len(own), 0)


def flip_labels(labels, num_classes: int, mode: str = "reverse", shift: int = 1):
    """Label flipping for classification data: y ↦ C − 1 − y (``"reverse"``) or
    y ↦ (y + shift) mod C (``"shift"``). Works on numpy arrays and torch tensors."""
    if not (isinstance(num_classes, int | np.integer) and num_classes >= 2):
        raise ValueError(f"label flipping needs num_classes >= 2, got {num_classes!r}")
    if mode not in ("reverse", "shift"):
        raise ValueError(f"label flipping: unknown mode {mode!r}; allowed: 'reverse', 'shift'")
    arr = arrays.to_numpy(labels)
    if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0
                     or arr.max() >= num_classes):
        raise ValueError(f"labels must be integers in [0, {num_classes}), got dtype "
                         f"{arr.dtype} with range [{arr.min()}, {arr.max()}]")
    if mode == "reverse":
        return (num_classes - 1) - labels
    return (labels + shift) % num_classes


# ----------------------------------------------------------------------------- registry
def _self(opts, ctx=None):
    """The attack is its own options object."""
    return opts


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split("\n\n")[0].split())


register("attack", "none", doc=_doc(NoAttack))(lambda opts=None, ctx=None: NoAttack())
register("attack", "alie", options=ALIE, doc=_doc(ALIE))(_self)
register("attack", "ipm", options=IPM, doc=_doc(IPM))(_self)
register("attack", "inf", doc=_doc(Inf))(lambda opts=None, ctx=None: Inf())
register("attack", "sign-flip", doc=_doc(SignFlip))(lambda opts=None, ctx=None: SignFlip())
register("attack", "gaussian", options=GaussianNoise, doc=_doc(GaussianNoise))(_self)
register("attack", "bit-flip", options=BitFlip, doc=_doc(BitFlip))(_self)
register("attack", "mimic", options=Mimic, doc=_doc(Mimic))(_self)



@dataclass(frozen=True)
class OptimizedOptions:
    """The line search of an attack tuned against the defence (omniscient)."""

    evals: int = option(20, "aggregator evaluations of the line search")
    start: float = option(0.0, "the first scale tried")
    step: float = option(10.0, "the first step of the search")
    ratio: float = option(0.8, "the step's shrink factor, in (0, 1)")


@dataclass(frozen=True)
class OptimizedALIEOptions(OptimizedOptions):
    """ALIE's σ estimate."""

    ddof: int = option(0, "σ with ddof 0 (population) or 1 (sample)")


@register("attack", "alie-opt", options=OptimizedALIEOptions)
def _alie_opt(opts: OptimizedALIEOptions, ctx=None) -> OptimizedALIE:
    """ALIE with z tuned against the round's aggregator (the adversary sees the defence)."""
    return OptimizedALIE(**dataclasses.asdict(opts))


@register("attack", "ipm-opt", options=OptimizedOptions)
def _ipm_opt(opts: OptimizedOptions, ctx=None) -> OptimizedIPM:
    """IPM with ε tuned against the round's aggregator (the adversary sees the defence)."""
    return OptimizedIPM(**dataclasses.asdict(opts))
