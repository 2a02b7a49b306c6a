"""Server rules for asynchronous training and the asynchronous baselines.

An asynchronous runtime (:mod:`partialfl.runtime.asynchronous`,
:mod:`partialfl.runtime.processes`) calls ``server_update`` once per arriving client update
and records its staleness τ (server steps since the client received θ) in
``updates.metrics["staleness"]``.

* **Asynchronous FFGG** (the paper's Algorithm 3) is plain :class:`~partialfl.algorithms.FFGG`
  run by an asynchronous runtime: θ^{k+1} = θ^k − γ ∇₁f_{m_k}(θ^{k−τ_k}, w_{m_k}), w_{m_k}
  fine-tuned for the stale θ^{k−τ_k} it received.
* :func:`joint_sgd` — SGD on the *non-personalized* problem, shared x = (θ, w): the client
  sends Δ = −∇f_m(x) (Local GD with one step of size 1, :class:`~partialfl.algorithms.LocalGD`),
  the server steps x ← x − γ·(−Δ). Run asynchronously it is asynchronous SGD.
* :class:`FedAsync` — staleness-weighted application (Xie et al., 2019, in the delta form of
  FLSim): the arriving update is scaled by s(τ) before the base server step, so with Local GD
  x ← x + α·s(τ)·Δ. s: ``constant`` 1, ``polynomial`` (1 + τ)^(−a),
  ``hinge`` 1 if τ ≤ b else 1/(a(τ − b) + 1).
* :class:`FedBuff` — buffered asynchronous aggregation (Nguyen et al., 2022): arriving
  (s(τ)-scaled) updates wait in a buffer; every K-th arrival the base server steps once on the
  K of them (mean), e.g. x ← x + η_g·(1/K)Σ s(τ_i)Δ_i. θ changes only every K arrivals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partialfl import arrays
from partialfl.aggregation.common import ZeroWeightsError
from partialfl.aggregation.protection import (
    UnprotectedError,
    cohort_checked,
    tolerated,
    warn_once,
)
from partialfl.algorithms.base import (
    Algorithm,
    ClientResult,
    ServerState,
    concat_results,
    skipped_step,
)
from partialfl.algorithms.context import WrapperContext
from partialfl.algorithms.fedavg import LocalGD
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.config import check_choice
from partialfl.registry import option, register
from partialfl.server import SGD
from partialfl.types import ClientUpdates

STALENESS_FUNCTIONS = ("constant", "polynomial", "hinge")


def joint_sgd(lr: float, aggregator=None) -> LocalGD:
    """Gradient steps on the shared model x = (θ, w): client m sends Δ = −∇f_m(x) (one local
    step of size 1), the server steps x ← x − lr·(−mean Δ) = x − lr·mean ∇f_m(x)."""
    return LocalGD(tau=1, lr=1.0, server_opt=SGD(lr=lr), aggregator=aggregator)


def staleness_weight(tau, kind: str = "constant", a: float = 0.5, b: float = 4.0):
    """FedAsync's s(τ) (elementwise over an array of staleness values)."""
    t = np.asarray(tau, dtype=np.float64)
    if kind == "constant":
        return np.ones_like(t)
    if kind == "polynomial":
        return (1.0 + t) ** (-a)
    if kind == "hinge":
        return np.where(t <= b, 1.0, 1.0 / (a * (t - b) + 1.0))
    raise ValueError(f"unknown staleness function {kind!r}; allowed: "
                     f"{', '.join(STALENESS_FUNCTIONS)}")


def _check_staleness_args(kind: str, a: float, b: float) -> None:
    if kind not in STALENESS_FUNCTIONS:
        raise ValueError(f"unknown staleness function {kind!r}; allowed: "
                         f"{', '.join(STALENESS_FUNCTIONS)}")
    if not (a > 0 and math.isfinite(a)) or not (b >= 0 and math.isfinite(b)):
        raise ValueError(f"staleness parameters need a > 0 and b >= 0, got a={a!r}, b={b!r}")


def _staleness(updates: ClientUpdates, who: str) -> np.ndarray:
    if "staleness" not in updates.metrics:
        raise ValueError(f"{who} needs the staleness of each update in "
                         "updates.metrics['staleness']: run it with an asynchronous runtime")
    return np.asarray(updates.metrics["staleness"], dtype=np.float64)


def _scaled(updates: ClientUpdates, s: np.ndarray) -> ClientUpdates:
    if np.all(s == 1.0):
        return updates
    vecs = {}
    for n, v in updates.vectors.items():
        vecs[n] = v * arrays.per_row(s, v)
    return ClientUpdates(vecs, updates.weights, updates.cohort, updates.grad_evals,
                         updates.metrics, updates.extra)


class FedAsync(AlgorithmWrapper):
    """Each arriving update is scaled by s(τ) and applied at once by the base server."""

    def __init__(self, base: Algorithm, staleness: str = "polynomial", a: float = 0.5,
                 b: float = 4.0) -> None:
        super().__init__(base)
        _check_staleness_args(staleness, a, b)
        self.staleness, self.a, self.b = staleness, float(a), float(b)
        self.name = f"fedasync-{base.name}"

    def server_update(self, state, updates, ctx) -> ServerState:
        """The base algorithm's step on the update scaled by its staleness weight s(τ)."""
        s = staleness_weight(_staleness(updates, "FedAsync"), self.staleness, self.a, self.b)
        return self.base.server_update(state, _scaled(updates, s), ctx)


class FedBuff(AlgorithmWrapper):
    """Buffer ``buffer_size`` = K arriving updates (scaled by s(τ)), then step once on all."""

    def __init__(self, base: Algorithm, buffer_size: int, staleness: str = "constant",
                 a: float = 0.5, b: float = 4.0) -> None:
        super().__init__(base)
        if not (isinstance(buffer_size, int | np.integer) and buffer_size >= 1):
            raise ValueError(f"FedBuff buffer size K must be an integer >= 1, "
                             f"got {buffer_size!r}")
        _check_staleness_args(staleness, a, b)
        self.K = int(buffer_size)
        self.staleness, self.a, self.b = staleness, float(a), float(b)
        self.name = f"fedbuff{self.K}-{base.name}"

    def init(self, problem, theta0) -> ServerState:
        """The base algorithm's state with an empty buffer."""
        state = self.base.init(problem, theta0)
        state.extra["buffer"] = ()
        return state

    def server_update(self, state, updates, ctx) -> ServerState:
        """Buffers the staleness-weighted update; every K updates, one step of the base algorithm on
        all of them."""
        s = staleness_weight(_staleness(updates, "FedBuff"), self.staleness, self.a, self.b)
        buffer = (*state.extra.get("buffer", ()), _scaled(updates, s))
        if len(buffer) < self.K:
            return ServerState(state.theta, state.opt_state, state.round,
                               {**state.extra, "buffer": buffer})
        merged = concat_results([ClientResult(u) for u in buffer]).updates
        f = tolerated(getattr(self.base, "aggregator", None), self.K)
        try:
            if f is None:  # no robust rule: every buffered update counts
                new = self.base.server_update(state, merged, ctx)
            else:  # a robust rule counts clients: a client's rows in one buffer become one
                merged = _one_row_per_client(merged)  # row (jobs go to idle clients, so one
                with cohort_checked(f):  # client can fill several slots), and the K-row
                    new = self.base.server_update(state, merged, ctx)  # plan's f is kept
        except UnprotectedError as e:
            warn_once(f"{self.name}: {len(merged.cohort)} distinct clients in a buffer of "
                      f"{self.K}, too few for the robust rule to tolerate f = {f}; the "
                      f"step is skipped (θ kept; state.extra['rounds_unprotected']): {e}",
                      ("fedbuff-unprotected", id(self)))
            new = skipped_step(state)
        except ZeroWeightsError as e:  # only clients without examples: as a synchronous round
            warn_once(f"{self.name}: {e}; the buffer's step is skipped (θ kept)",
                      ("fedbuff-zero-weights", id(self)))
            new = skipped_step(state)
        new.extra["buffer"] = ()
        return new


def _one_row_per_client(u: ClientUpdates) -> ClientUpdates:
    """The updates with every client's rows replaced by their mean (first-arrival order)."""
    rows: dict[int, list[int]] = {}
    for i, m in enumerate(np.asarray(u.cohort).tolist()):
        rows.setdefault(int(m), []).append(i)
    if all(len(r) == 1 for r in rows.values()):
        return u

    def mean(x, c: int):  # divide first: huge finite rows must not overflow the sum
        return (x / c).sum(0, keepdims=True) if isinstance(x, np.ndarray) else \
            (x / c).sum(0, keepdim=True)

    parts = []
    for idx in rows.values():
        one = u.select(np.asarray(idx))
        if len(idx) > 1:
            c = len(idx)
            one = ClientUpdates({n: mean(v, c) for n, v in one.vectors.items()},
                                np.asarray(one.weights).sum(keepdims=True), one.cohort[:1],
                                one.grad_evals,
                                {n: np.asarray(v).mean(keepdims=True).reshape(1)
                                 for n, v in one.metrics.items()},
                                {e: {n: mean(v, c) for n, v in t.items()}
                                 for e, t in one.extra.items()})
        parts.append(ClientResult(one))
    return concat_results(parts).updates


@dataclass(frozen=True)
class FedAsyncOptions:
    """FedAsync's staleness weighting s(τ)."""

    staleness: str = option("polynomial", "s(τ): constant, polynomial (1+τ)^-a, hinge")
    a: float = option(0.5, "the decay a > 0")
    b: float = option(4.0, "hinge: the staleness b >= 0 up to which s = 1")

    def __post_init__(self) -> None:
        check_choice("staleness", self.staleness, STALENESS_FUNCTIONS)
        _check_staleness_args(self.staleness, self.a, self.b)


@register("wrapper", "fedasync", options=FedAsyncOptions, asynchronous=True)
def _fedasync(opts: FedAsyncOptions, ctx: WrapperContext) -> FedAsync:
    """FedAsync (Xie et al. 2019): each arriving update, scaled by s(τ), is applied at once
    (with FFGG: Algorithm 3)."""
    return FedAsync(ctx.base, opts.staleness, opts.a, opts.b)


@dataclass(frozen=True)
class FedBuffOptions:
    """FedBuff's buffer and staleness weighting."""

    buffer: int = option(4, "K: arriving updates per server step")
    staleness: str = option("constant", "s(τ): constant, polynomial (1+τ)^-a, hinge")
    a: float = option(0.5, "the decay a > 0")
    b: float = option(4.0, "hinge: the staleness b >= 0 up to which s = 1")

    def __post_init__(self) -> None:
        if not (isinstance(self.buffer, int) and self.buffer >= 1):
            raise ValueError(f"buffer must be an integer >= 1, got {self.buffer!r}")
        check_choice("staleness", self.staleness, STALENESS_FUNCTIONS)
        _check_staleness_args(self.staleness, self.a, self.b)


@register("wrapper", "fedbuff", options=FedBuffOptions, asynchronous=True)
def _fedbuff(opts: FedBuffOptions, ctx: WrapperContext) -> FedBuff:
    """FedBuff (Nguyen et al. 2022): K arriving (s(τ)-scaled) updates are buffered, then the
    server steps once on all of them."""
    if ctx.rounds is not None and opts.buffer > ctx.rounds:  # θ would never move
        raise ValueError(f"buffer {opts.buffer} is more than the stage's {ctx.rounds} rounds "
                         "(applied updates): the server would never step")
    return FedBuff(ctx.base, opts.buffer, opts.staleness, opts.a, opts.b)
