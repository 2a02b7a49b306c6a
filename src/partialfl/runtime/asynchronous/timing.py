"""How long a client computation takes in the asynchronous runtime: duration distributions
(registered components of kind ``distribution``), device speeds and the compute-time model.

A distribution is a frozen dataclass whose fields are its options (``scale``; ``shape`` for
the two that have one), drawing with a given generator:

* ``constant``: always ``scale``;          * ``exponential``: mean ``scale``;
* ``half-normal``: scale·|N(0, 1)|;          * ``log-normal``: scale·exp(shape·N(0, 1));
* ``pareto``: scale·(1 + Lomax(shape)), i.e. Pareto with minimum ``scale`` and tail index
  ``shape`` (heavy-tailed; infinite mean for shape ≤ 1).

In a spec: ``[asynchronous] duration = {name = "log-normal", scale = 1.0, shape = 0.5}``; in
Python: ``LogNormal(1.0, 0.5)`` or ``Distribution("log-normal", 1.0, 0.5)`` (by name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from partialfl import rng as prng
from partialfl.registry import entry, names, option, register
from partialfl.runtime.sync import sample_cohort


def _check(name: str, scale, shape=1.0) -> None:
    if not (isinstance(scale, int | float) and scale >= 0 and math.isfinite(scale)):
        raise ValueError(f"{name} distribution: scale must be finite and >= 0, got {scale!r}")
    if not (isinstance(shape, int | float) and shape > 0 and math.isfinite(shape)):
        raise ValueError(f"{name} distribution: shape must be finite and > 0, got {shape!r}")


class Duration:
    """A non-negative duration distribution (see the module docstring): ``sample(rng,
    size=None)`` draws once (``size`` None) or ``size`` times; ``mean()``; ``name`` is its
    registered name, ``deterministic`` whether it draws nothing."""

    name = "duration"
    deterministic = False

    @property
    def kind(self) -> str:
        """The registered name (older spelling)."""
        return self.name

    def __post_init__(self) -> None:
        _check(self.name, self.scale, getattr(self, "shape", 1.0))

    def sample(self, rng: np.random.Generator | None, size: int | None = None):
        """One draw (``size=None``) or ``size`` draws with ``rng``."""
        raise NotImplementedError

    def mean(self) -> float:
        """The distribution's mean."""
        raise NotImplementedError


def _itself(opts: Duration, ctx=None) -> Duration:
    return opts  # a distribution's options are the distribution


def _distribution(name: str):
    """Class decorator: register the class as the distribution ``name`` (its own options)."""
    def deco(cls):
        cls.name = name
        register("distribution", name, options=cls, doc=" ".join(cls.__doc__.split()))(_itself)
        return cls
    return deco


@_distribution("constant")
@dataclass(frozen=True)
class Constant(Duration):
    """Always ``scale`` (no randomness)."""

    scale: float = option(1.0, "the duration, >= 0")
    deterministic = True

    def sample(self, rng=None, size=None):
        return float(self.scale) if size is None else np.full(size, float(self.scale))

    def mean(self) -> float:
        return float(self.scale)


@_distribution("exponential")
@dataclass(frozen=True)
class Exponential(Duration):
    """Exponential with mean ``scale``."""

    scale: float = option(1.0, "the mean, >= 0")

    def sample(self, rng, size=None):
        return rng.exponential(self.scale, size)

    def mean(self) -> float:
        return float(self.scale)


@_distribution("half-normal")
@dataclass(frozen=True)
class HalfNormal(Duration):
    """scale·|N(0, 1)|."""

    scale: float = option(1.0, "the scale, >= 0")

    def sample(self, rng, size=None):
        return self.scale * np.abs(rng.standard_normal(size))

    def mean(self) -> float:
        return self.scale * math.sqrt(2 / math.pi)


@_distribution("log-normal")
@dataclass(frozen=True)
class LogNormal(Duration):
    """scale·exp(shape·N(0, 1))."""

    scale: float = option(1.0, "the median, >= 0")
    shape: float = option(1.0, "σ of the log, > 0")

    def sample(self, rng, size=None):
        return self.scale * np.exp(self.shape * rng.standard_normal(size))

    def mean(self) -> float:
        return self.scale * math.exp(self.shape**2 / 2)


@_distribution("pareto")
@dataclass(frozen=True)
class Pareto(Duration):
    """Pareto with minimum ``scale`` and tail index ``shape``: scale·(1 + Lomax(shape))
    (heavy-tailed; infinite mean for shape ≤ 1)."""

    scale: float = option(1.0, "the minimum, >= 0")
    shape: float = option(1.0, "the tail index, > 0")

    def sample(self, rng, size=None):
        return self.scale * (1.0 + rng.pareto(self.shape, size))

    def mean(self) -> float:
        return math.inf if self.shape <= 1 else self.scale * self.shape / (self.shape - 1)


def Distribution(kind: str = "constant", scale: float = 1.0,  # noqa: N802 - a constructor
                 shape: float = 1.0) -> Duration:
    """The registered distribution ``kind`` with ``scale`` (and ``shape``, where it has one;
    ignored otherwise)."""
    if not isinstance(kind, str) or kind not in names("distribution"):
        raise ValueError(f"unknown distribution {kind!r}; allowed: "
                         f"{', '.join(names('distribution'))}")
    cls = entry("distribution", kind).options
    has = {f.name for f in fields(cls)}
    _check(kind, scale, shape)
    return cls(**{k: v for k, v in (("scale", scale), ("shape", shape)) if k in has})


#: the longest simulated computation: a clock summing such durations stays finite
MAX_DURATION = 1e15


def device_speeds(num_clients: int, dist: Duration, seed: int) -> np.ndarray:
    """Per-client device speeds drawn from ``dist`` (``generator(seed, "device-speed")``)."""
    v = np.asarray(dist.sample(prng.generator(seed, "device-speed"), num_clients), dtype=float)
    if not (v > 0).all():
        raise ValueError(f"device speeds must be positive; {dist} produced {v.min()}")
    return v


@dataclass(frozen=True)
class ComputeTimeModel:
    """duration(m) = (X + Σ_{i ≤ n_m} E_i) / speed_m with X ~ ``per_job`` (or
    ``per_job[m]``), E_i ~ ``per_example`` (omitted if None) and n_m the number of examples
    of client m; ``speed`` defaults to 1 for every client."""

    per_job: Duration | tuple[Duration, ...] = Constant(1.0)
    per_example: Duration | None = None
    speed: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        pj = self.per_job
        if not isinstance(pj, Duration):
            pj = tuple(pj)
            if not pj or not all(isinstance(d, Duration) for d in pj):
                raise TypeError("per_job must be a distribution or a sequence of them "
                                "(one per client)")
            object.__setattr__(self, "per_job", pj)
        if self.per_example is not None and not isinstance(self.per_example, Duration):
            raise TypeError(f"per_example must be a distribution or None, "
                            f"got {self.per_example!r}")
        if self.speed is not None:
            sp = tuple(float(v) for v in np.asarray(self.speed, dtype=float).reshape(-1))
            if not all(v > 0 and math.isfinite(v) for v in sp):
                raise ValueError("device speeds must be positive and finite")
            object.__setattr__(self, "speed", sp)

    def check(self, num_clients: int) -> None:
        """Raise if a per-client table does not have one entry per client."""
        for name, v in (("per_job", self.per_job), ("speed", self.speed)):
            if isinstance(v, tuple) and len(v) != num_clients:
                raise ValueError(f"compute-time model has {len(v)} {name} entries for "
                                 f"{num_clients} clients")

    def duration(self, client: int, num_examples: float, rng: np.random.Generator) -> float:
        """The compute time of one job of ``client`` on ``num_examples`` examples."""
        d = self.per_job[client] if isinstance(self.per_job, tuple) else self.per_job
        work = float(d.sample(rng))
        if self.per_example is not None:
            work += float(np.sum(self.per_example.sample(rng, int(num_examples))))
        v = work / (self.speed[client] if self.speed is not None else 1.0)
        if not 0 <= v <= MAX_DURATION:  # an inf/huge draw made the clock inf: "diverged"
            raise ValueError(f"asynchronous.duration: a computation of client {client} lasts "
                             f"{v:g} simulated seconds ({d}); a duration must be finite and "
                             f"at most {MAX_DURATION:g} (lower the scale or raise the shape)")
        return v

    def is_deterministic(self) -> bool:
        """Whether every distribution of the model is constant (no randomness in durations)."""
        dists = self.per_job if isinstance(self.per_job, tuple) else (self.per_job,)
        if self.per_example is not None:
            dists = (*dists, self.per_example)
        return all(d.deterministic for d in dists)

    def job_duration(self, seed: int, job: int, client: int, num_examples: float) -> float:
        """The duration of asynchronous job ``job`` (``generator(seed, "compute-time", job)``,
        not even built when every distribution is constant)."""
        rng = None if self.is_deterministic() else prng.generator(seed, "compute-time", job)
        return self.duration(client, num_examples, rng)


def synchronous_round_times(compute_time: ComputeTimeModel, problem, rounds: int,
                            clients_per_round: int | None, seed: int) -> np.ndarray:
    """Simulated wall-clock of synchronous rounds ``[rounds + 1]`` (0 first): a round lasts
    as long as its slowest sampled client (cohorts as in :func:`run_rounds`, durations from
    ``generator(seed, "compute-time-sync", round, client)``)."""
    M = problem.num_clients
    compute_time.check(M)
    n = problem.num_examples(np.arange(M))
    t = np.zeros(rounds + 1)
    for r in range(rounds):
        cohort = sample_cohort(seed, r, M, clients_per_round)
        d = max(compute_time.duration(int(m), n[m],
                                      prng.generator(seed, "compute-time-sync", r, int(m)))
                for m in cohort)
        t[r + 1] = t[r] + d
    return t

