"""Wrappers around a rule: pre-aggregations that transform the inputs, then ``inner`` runs.

* :class:`Bucketing` (Karimireddy, He & Jaggi, 2022, Algorithm 1): draw a random permutation
  π, split it into ⌈k/s⌉ buckets of s consecutive entries (the last may be smaller), average
  each bucket, y_b = (1/|B_b|) Σ_{i ∈ B_b} x_{π(i)}, and aggregate the bucket means. Averaging
  shrinks the spread of the good inputs by s while at most s·δ of the buckets contain a
  Byzantine input, which makes CM, GM, Krum, … (δ, c)-robust on heterogeneous data for
  δ ≤ δ_max / s. The permutation comes from ``partialfl.rng.generator(seed, "bucketing",
  round)``, bound per round with :meth:`Bucketing.bind`. The inner rule's δ is the fraction
  of Byzantine *bucket means* (:func:`~partialfl.build.make_aggregator` gives
  it s·δ for a fraction δ of Byzantine clients).
* :class:`NearestNeighborMixing` (Allouah et al., 2023): every x_i is replaced by the average
  of its k − f nearest inputs (itself included), f = ⌊δk⌋.
* :class:`ARC` — adaptive robust clipping (Allouah et al., 2024): the ⌊2(f/k)(k − f)⌋ inputs
  of largest norm are clipped to the norm of the largest remaining one.
* :class:`StaticClipping` — x_i ← x_i · min(1, c/‖x_i‖).

NNM and ARC take the Byzantine fraction δ of the rule they wrap when none is given
(``delta=None``), so a robust rule keeps its robustness when wrapped; NNM refuses δ = 0 (it
would mix every input with all k inputs, one huge input then moves every mixed vector). Like
the rules, NNM and ARC refuse a call where ⌊δk⌋ = 0 for δ > 0 (NNM: also k < 2f + 1) unless
built with ``allow_unprotected=True`` (:mod:`~partialfl.aggregation.protection`);
``tolerated(k)`` of every wrapper reports what the whole chain tolerates among k clients.

ARC and static clipping scale the clipped rows in place when the input is their own copy
(float32 or torch input converted to float64) or when given ``out``; otherwise they return a
new array and never modify the caller's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from partialfl import rng as prng
from partialfl.aggregation.common import (
    bind,
    chain_of,
    check_delta,
    inner_delta,
    mean_rows,
    norms,
    prepare,
    sq_dists_of,
    to_numpy,
)
from partialfl.aggregation.protection import UnprotectedError, check, check_flag, tolerated


def _chain(f: int, inner, k: int) -> int | None:
    """What a wrapper tolerating f, around ``inner``, tolerates among k inputs: min(f, what
    ``inner`` tolerates); None when ``inner`` states no tolerance (the mean: NNM's mixed rows
    still carry an attacker's share, and the mean averages them in)."""
    g = tolerated(inner, k)
    return None if g is None else min(f, g)


def _wrapper_delta(obj, name: str, zero_ok: bool) -> None:
    check_flag(obj.allow_unprotected, f"{name}: allow_unprotected")
    if not callable(obj.inner):
        raise TypeError(f"{name}: inner aggregator must be callable, got {obj.inner!r}")
    delta = obj.delta
    if delta is None:
        delta = inner_delta(obj.inner)
        if delta is None:
            raise ValueError(
                f"{name}: needs the Byzantine fraction delta and the inner rule "
                f"{type(obj.inner).__name__} has none: pass delta > 0"
            )
        object.__setattr__(obj, "delta", delta)
    check_delta(delta, name)
    if delta == 0 and not zero_ok:
        raise ValueError(
            f"{name}: delta = 0 would mix every input with all k inputs (no robustness: one "
            "huge input moves every mixed vector); pass the Byzantine fraction delta > 0"
        )


@dataclass(frozen=True)
class Bucketing:
    """``inner`` applied to the means of random buckets of size ``s``."""

    inner: Any
    s: int = 2
    seed: int = 0
    round: int = 0
    name = "bucketing"

    def __post_init__(self) -> None:
        if isinstance(self.s, bool) or not (isinstance(self.s, int | np.integer) and self.s >= 1):
            raise ValueError(f"bucketing: bucket size s must be an integer >= 1, got {self.s!r}")
        if not callable(self.inner):
            raise TypeError(f"bucketing: inner aggregator must be callable, got {self.inner!r}")
        if any(getattr(r, "name", None) == "monna"
               and (r.index is not None or r.trusted is not None)
               for r in chain_of(self.inner)):
            raise ValueError(
                "bucketing: MoNNA's trusted input would be a bucket mean of random clients, "
                "not an input the server trusts; give MoNNA a reference vector or use no "
                "bucketing"
            )

    @property
    def delta(self) -> float | None:
        """The client-level fraction: the inner rule's δ (over bucket means) divided by s."""
        d = inner_delta(self.inner)
        return None if d is None else d / self.s

    def buckets(self, k: int) -> list[np.ndarray]:
        """The index sets B_1, …, B_⌈k/s⌉ for k inputs (this seed and round)."""
        perm = prng.generator(self.seed, "bucketing", self.round).permutation(k)
        return [perm[i : i + self.s] for i in range(0, k, self.s)]

    def bucket_means(self, X: np.ndarray) -> np.ndarray:
        """The mean of every bucket of the rows of ``X`` ``[⌈k/s⌉, d]`` (overflow-safe)."""
        # Divide before summing: huge finite inputs (e.g. 1e308) must not overflow to inf.
        return np.stack([mean_rows(X, b) for b in self.buckets(len(X))])

    def tolerated(self, k: int) -> int | None:
        """Byzantine clients tolerated among k: as many as the inner rule tolerates bucket
        means among ⌈k/s⌉ (each Byzantine client spoils at most one bucket)."""
        return self._context(k, lambda: tolerated(self.inner, -(-k // self.s)))

    def _context(self, k: int, fn):
        try:
            return fn()
        except UnprotectedError as e:
            raise UnprotectedError(f"bucketing s = {self.s} makes k = {k} inputs "
                                   f"{-(-k // self.s)} bucket means: {e}") from None

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "bucketing")
        Y = self.bucket_means(X)
        out = self._context(len(X), lambda: self.inner(Y, np.ones(len(Y))))
        return restore(np.asarray(out))

    def bind(self, seed: int, round_: int) -> Bucketing:
        """This wrapper (and its inner rule) with the buckets' randomness bound to (seed, round)."""
        return replace(self, seed=int(seed), round=int(round_),
                       inner=bind(self.inner, seed, round_))


@dataclass(frozen=True)
class _Pre:
    """A pre-aggregation: ``inner(transform(X))``; randomness of ``inner`` bound per round."""

    def transform(self, X: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The transformed inputs the inner rule aggregates (written to ``out`` where the
        wrapper can work in place; pragma: abstract)."""
        raise NotImplementedError  # pragma: no cover

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, self.name)
        own = not np.may_share_memory(X, to_numpy(vectors)[0])  # converted: ours to modify
        return restore(np.asarray(self.inner(self.transform(X, out=X if own else None),
                                             weights)))

    def bind(self, seed: int, round_: int):
        """This wrapper with its inner rule bound to (seed, round)."""
        return replace(self, inner=bind(self.inner, seed, round_))


@dataclass(frozen=True)
class NearestNeighborMixing(_Pre):
    """NNM pre-aggregation: y_i = mean of the k − f nearest inputs to x_i (x_i included),
    f = ⌊δk⌋ with δ > 0 (``None``: the inner rule's δ); returns ``inner(y, weights)``.
    Bound: f ≥ 1 (k ≥ ⌈1/δ⌉) and k ≥ 2f + 1; refused below unless ``allow_unprotected=True``.
    """

    inner: Any
    delta: float | None = None
    allow_unprotected: bool = False
    name = "nearest-neighbour mixing"

    def __post_init__(self) -> None:
        _wrapper_delta(self, "nearest-neighbour mixing", zero_ok=False)

    def _own(self, k: int) -> int:
        return check("nearest-neighbour mixing", self.delta, k, self.allow_unprotected)

    def tolerated(self, k: int) -> int | None:
        """Byzantine inputs tolerated among k by NNM and the rule it feeds."""
        return _chain(self._own(k), self.inner, k)

    def mixing_matrix(self, X: np.ndarray) -> np.ndarray:
        """``[k, k]`` W with y = W X: row i has 1/(k − f) on the k − f nearest inputs."""
        k = len(X)
        keep = k - self._own(k)
        D = sq_dists_of(X)
        D[np.arange(k), np.arange(k)] = -1.0  # i itself comes first among its ties
        nn = np.argsort(D, axis=1, kind="stable")[:, :keep]
        W = np.zeros((k, k))
        np.put_along_axis(W, nn, 1.0 / keep, axis=1)
        return W

    def transform(self, X: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Every row replaced by the mean of its k − ⌊δk⌋ nearest rows (itself included);
        always a new array (``out`` is not used: every row depends on the others)."""
        # W has entries 1/(k − f) ≤ 1 summing to 1 per row: no overflow for finite X.
        return self.mixing_matrix(X) @ X

    mix = transform


@dataclass(frozen=True)
class ARC(_Pre):
    """Adaptive robust clipping: with f = ⌊δk⌋ and n = ⌊2(f/k)(k − f)⌋, the n inputs of
    largest norm are scaled to the norm of the (k − n)-th smallest (ties to the lower index);
    δ = None: the inner rule's δ. δ = 0 clips nothing; for δ > 0 it needs f ≥ 1
    (k ≥ ⌈1/δ⌉), refused below unless ``allow_unprotected=True``."""

    inner: Any
    delta: float | None = None
    allow_unprotected: bool = False
    name = "arc"

    def __post_init__(self) -> None:
        _wrapper_delta(self, "arc", zero_ok=True)

    def _own(self, k: int) -> int:
        return check("arc", self.delta, k, self.allow_unprotected, extra=0)

    def tolerated(self, k: int) -> int | None:
        """Byzantine inputs tolerated among k by ARC and the rule it feeds."""
        return _chain(self._own(k), self.inner, k)

    def clipped(self, k: int) -> int:
        """How many of k inputs are clipped: ⌊2(f/k)(k − f)⌋."""
        f = self._own(k)
        return int(math.floor(2 * f / k * (k - f) + 1e-9))

    def transform(self, X: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The inputs with the n largest clipped to the (k − n)-th smallest norm (into
        ``out``, which may be X; else X itself when nothing is clipped, or a new array)."""
        k = len(X)
        n = self.clipped(k)
        if n == 0:
            return _scaled(X, np.zeros(0, dtype=np.int64), np.zeros(0), out)
        r = norms(X)
        order = np.argsort(r, kind="stable")
        thr = r[order[k - n - 1]]
        big = order[k - n:]
        far = big[r[big] > thr]  # r > thr ≥ 0: a safe division
        return _scaled(X, far, thr / r[far], out)


@dataclass(frozen=True)
class StaticClipping(_Pre):
    """x_i ← x_i · min(1, c/‖x_i‖) for a fixed radius c > 0."""

    inner: Any
    c: float = 1.0
    name = "static clipping"

    def tolerated(self, k: int) -> int | None:
        """What the rule it feeds tolerates (clipping alone tolerates nothing)."""
        return tolerated(self.inner, k)

    def __post_init__(self) -> None:
        if not callable(self.inner):
            raise TypeError(f"static clipping: inner aggregator must be callable, "
                            f"got {self.inner!r}")
        if isinstance(self.c, bool) or not (isinstance(self.c, int | float) and self.c > 0
                                            and math.isfinite(self.c)):
            raise ValueError(f"static clipping: radius c must be a positive number, "
                             f"got {self.c!r}")

    def transform(self, X: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The inputs clipped to norm c (into ``out``, which may be X; else X itself when
        nothing is clipped, or a new array)."""
        r = norms(X)
        far = np.flatnonzero(r > self.c)
        return _scaled(X, far, self.c / r[far], out)


def _scaled(X: np.ndarray, rows: np.ndarray, factors: np.ndarray,
            out: np.ndarray | None) -> np.ndarray:
    """X with ``rows`` multiplied by ``factors``: in ``out`` (may be X), else X itself when no
    row changes, else a copy (the caller's X is never modified unless it is ``out``)."""
    if out is None:
        if not len(rows):
            return X
        out = X.copy()
    elif out is not X:
        out[...] = X
    for i, c in zip(rows.tolist(), factors.tolist(), strict=True):
        np.multiply(X[i], c, out=out[i])
    return out
