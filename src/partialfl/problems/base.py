"""The problem layer: clients, their private data and the loss f_m(θ, w).

Every method is *batched over a cohort* of client ids: personal trees carry a leading client
axis, and returned per-client quantities have shape ``[k, ...]``. A problem whose w-subproblem is
quadratic also implements :class:`QuadraticInW`, which unlocks the conjugate-gradient and exact
local solvers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from partialfl.types import Params

#: how ``init_w`` may start personal parameters: the problem's own initial values
#: (``pretrained``: a model's current layers, 0 for the closed-form problems), zeros, or a
#: fresh random draw per (seed, round, client)
W_INITS = ("pretrained", "zero", "random")


def check_w_init(init: str) -> str:
    """``init`` if it is one of :data:`W_INITS`, else a ValueError naming them."""
    if init not in W_INITS:
        raise ValueError(f"unknown w initialisation {init!r}; allowed: {', '.join(W_INITS)}")
    return init


@runtime_checkable
class Problem(Protocol):
    """A federated problem  min_θ (1/M) Σ_m min_w f_m(θ, w)  (the paper's Eq. (1)).

    The parameter trees' names are part of the interface, so an algorithm never needs a key
    literal: θ has the leaves ``theta_names`` (shapes ``theta_shapes``), w the trained leaves
    ``w_names`` plus the never-trained personal client state ``state_names`` (e.g. BatchNorm
    running statistics; empty for closed-form problems).

    ``mode`` (of ``loss``, ``grad_theta``, ``grad_w``): the caller's batching mode
    (:mod:`partialfl.batching`; a run's loop passes its executor's through
    ``RoundContext.mode``), which groups the cohort's clients into vectorised calls or a loop.
    None: the problem's default. A closed form computes any cohort in one vectorised numpy
    call, whatever the mode.
    """

    num_clients: int
    theta_names: tuple[str, ...]
    theta_shapes: dict[str, tuple[int, ...]]
    w_names: tuple[str, ...]
    state_names: tuple[str, ...]

    def init_theta(self, rng: np.random.Generator) -> Params:
        """The initial global parameters θ⁰."""
        ...

    def init_w(self, cohort: np.ndarray, how: str, seed: int, round_: int) -> Params:
        """Fresh personal parameters for ``cohort`` (one of :data:`W_INITS`), stacked."""
        ...

    def loss(self, cohort: np.ndarray, theta: Params, w: Params, *, mode=None) -> np.ndarray:
        """f_m(θ, w_m) for each m in the cohort: ``[k]``."""
        ...

    def grad_theta(self, cohort: np.ndarray, theta: Params, w: Params, *, mode=None) -> Params:
        """∇₁ f_m(θ, w_m), stacked ``[k, ...]``."""
        ...

    def grad_w(self, cohort: np.ndarray, theta: Params, w: Params, *, mode=None) -> Params:
        """∇₂ f_m(θ, w_m), stacked ``[k, ...]``."""
        ...

    def lipschitz_w(self, cohort: np.ndarray) -> np.ndarray:
        """Smoothness constant of w ↦ f_m(θ, w) for each client: ``[k]``."""
        ...

    def num_examples(self, cohort: np.ndarray) -> np.ndarray:
        """The number of training examples of each client of the cohort: ``[k]``."""
        ...


@runtime_checkable
class QuadraticInW(Protocol):
    """Problems where ∇₂ f_m(θ, w) = Q_m w − c_m(θ) with Q_m symmetric positive definite."""

    def w_system(self, cohort: np.ndarray, theta: Params) -> tuple[np.ndarray, np.ndarray]:
        """``(Q [k, d_w, d_w], c [k, d_w])`` of the w-subproblem."""
        ...

    def w_star(self, cohort: np.ndarray, theta: Params) -> Params:
        """The exact w*_m(θ) = argmin_w f_m(θ, w)."""
        ...


@runtime_checkable
class ClosedForm(Protocol):
    """Problems that expose the exact operator F and its root θ* (for metrics and tests)."""

    def F(self, theta: Params) -> np.ndarray:
        """F(θ) = (1/M) Σ_m ∇₁ f_m(θ, w*_m(θ)), flattened."""
        ...

    def theta_star(self) -> Params:
        """θ*, the root of F (the solution of the partially personalized problem)."""
        ...

    def f_star(self) -> np.ndarray:
        """min_{θ,w} f_m(θ, w) per client ``[M]`` (the fully personalized optimum)."""
        ...


def check_cohort(cohort: np.ndarray, num_clients: int) -> np.ndarray:
    """Validate client ids; returns an int64 array."""
    c = np.asarray(cohort, dtype=np.int64)
    if c.ndim != 1:
        raise ValueError(f"cohort must be 1-D, got shape {c.shape}")
    if c.size and (c.min() < 0 or c.max() >= num_clients):
        raise ValueError(f"client ids must be in [0, {num_clients}), got {c.min()}..{c.max()}")
    return c


@dataclass(frozen=True)
class ProblemContext:
    """What a closed-form problem's registry entry is built with: ``progress`` (a bar while
    the clients' data are generated) and ``shared_w`` (the algorithm trains one w shared by
    all clients, so w must mean the same on every client: least squares then uses its
    standard basis)."""

    progress: bool | str = False
    shared_w: bool = False


#: the largest closed-form problem a config may ask for (data and per-client matrices)
MAX_PROBLEM_BYTES = 8 * 2**30


def check_size(num_clients: int, n: int, d: int) -> None:
    """A ValueError when ``num_clients`` clients of ``n`` rows and ``d`` columns would need
    more than :data:`MAX_PROBLEM_BYTES`."""
    need = 8 * num_clients * (n * d + d * d)
    if need > MAX_PROBLEM_BYTES:
        raise ValueError(f"num_clients={num_clients}, n={n}, d_theta+d_w={d} need about "
                         f"{need / 2**30:.3g} GiB of data; the limit is "
                         f"{MAX_PROBLEM_BYTES / 2**30:.3g} GiB")
