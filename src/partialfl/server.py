"""Server optimizers and learning-rate schedules acting on θ.

The server receives a (pseudo-)gradient g — the aggregated θ-gradient for FFGG, or −Δ̄ (the
negated mean model change) for delta-based methods such as FedAvg — and steps:

* SGD:  θ ← θ − η_r (g + μ·m) with optional heavy-ball momentum μ.
* Adam (FedAdam, Reddi et al. 2021): m ← β₁m + (1−β₁)g, v ← β₂v + (1−β₂)g²,
  θ ← θ − η_r m̂/(√v̂ + ε), with bias correction.

Schedules map the round r to η_r = lr·s(r) (:class:`Constant`, :class:`WarmupLinear`,
:class:`Exponential`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from partialfl.registry import option, register
from partialfl.types import Params


@dataclass(frozen=True)
class Constant:
    """η_r = lr."""

    def factor(self, r: int) -> float:
        """1 at every round."""
        return 1.0


@dataclass(frozen=True)
class WarmupLinear:
    """Linear warm-up over ``warmup`` rounds, then linear decay to 0 at round ``total``."""

    total: int
    warmup: int = 0

    def __post_init__(self) -> None:
        if self.total < 1 or not 0 <= self.warmup < self.total:
            raise ValueError(
                f"warmup-linear needs total >= 1 and 0 <= warmup < total, got total={self.total}, "
                f"warmup={self.warmup}"
            )

    def factor(self, r: int) -> float:
        """(r + 1)/warmup during the warm-up, then (total − r)/(total − warmup), floored at 0."""
        if r < self.warmup:
            return (r + 1) / self.warmup
        return max(0.0, (self.total - r) / max(1, self.total - self.warmup))


@dataclass(frozen=True)
class Exponential:
    """Halve the stepsize every ``halve_every`` rounds: factor 0.5^⌊r/k⌋."""

    halve_every: int

    def __post_init__(self) -> None:
        if self.halve_every < 1:
            raise ValueError(f"exponential schedule needs halve_every >= 1, got {self.halve_every}")

    def factor(self, r: int) -> float:
        """0.5^⌊r / halve_every⌋."""
        return 0.5 ** (r // self.halve_every)


@dataclass(frozen=True)
class ScheduleContext:
    """What a schedule entry is built with: the stage's rounds."""

    total: int = 1


@register("schedule", "constant")
def _constant(opts: None, ctx: ScheduleContext | None = None) -> Constant:
    """The stepsize stays lr."""
    return Constant()


@dataclass(frozen=True)
class WarmupOptions:
    """The warm-up of ``warmup-linear``."""

    warmup: int = option(0, "rounds of linear warm-up (then linear decay to 0 at the end)")

    def __post_init__(self) -> None:
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")


@register("schedule", "warmup-linear", options=WarmupOptions)
def _warmup_linear(opts: WarmupOptions, ctx: ScheduleContext) -> WarmupLinear:
    """Linear warm-up over ``warmup`` rounds, then linear decay to 0 at the stage's end."""
    return WarmupLinear(total=max(ctx.total, 1), warmup=opts.warmup)


@dataclass(frozen=True)
class HalvingOptions:
    """The period of ``exponential``."""

    halve_every: int = option(1, "halve the stepsize every this many rounds (>= 1)")

    def __post_init__(self) -> None:
        Exponential(self.halve_every)


@register("schedule", "exponential", options=HalvingOptions)
def _exponential(opts: HalvingOptions, ctx: ScheduleContext | None = None) -> Exponential:
    """Halve the stepsize every ``halve_every`` rounds."""
    return Exponential(opts.halve_every)


def _check_lr(lr: float) -> float:
    if not (isinstance(lr, int | float) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"server stepsize must be a positive finite number, got {lr!r}")
    return float(lr)


@dataclass(frozen=True)
class SGD:
    """Server SGD θ ← θ − η_r g (heavy-ball ``momentum`` m ← βm + g, step on m), η_r = lr ×
    ``schedule``'s factor."""

    lr: float
    momentum: float = 0.0
    schedule: Any = Constant()

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")

    def init(self, theta: Params) -> Any:
        """The momentum buffer (zeros like θ), or None without momentum."""
        return {k: 0 * v for k, v in theta.items()} if self.momentum else None

    def step(self, theta: Params, grad: Params, state: Any, r: int) -> tuple[Params, Any]:
        """One step on the pseudo-gradient ``grad`` at round ``r``: ``(new θ, new state)``."""
        eta = self.lr * self.schedule.factor(r)
        if self.momentum:
            state = {k: self.momentum * state[k] + grad[k] for k in grad}
            grad = state
        return {k: theta[k] - eta * grad[k] for k in theta}, state


@dataclass(frozen=True)
class Adam:
    """Server Adam (FedAdam on a model-change pseudo-gradient): bias-corrected first and second
    moments, θ ← θ − η_r m̂ / (√v̂ + eps)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    schedule: Any = Constant()

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"Adam {name} must be in [0, 1), got {getattr(self, name)}")

    def init(self, theta: Params) -> Any:
        """Zero moments and step count 0."""
        return {"m": {k: 0 * v for k, v in theta.items()},
                "v": {k: 0 * v for k, v in theta.items()}, "t": 0}

    def step(self, theta: Params, grad: Params, state: Any, r: int) -> tuple[Params, Any]:
        """One Adam step on the pseudo-gradient ``grad`` at round ``r``: ``(new θ, new state)``."""
        b1, b2, t = self.beta1, self.beta2, state["t"] + 1
        m = {k: b1 * state["m"][k] + (1 - b1) * grad[k] for k in grad}
        v = {k: b2 * state["v"][k] + (1 - b2) * grad[k] * grad[k] for k in grad}
        eta = self.lr * self.schedule.factor(r)
        c1, c2 = 1 - b1**t, 1 - b2**t
        new = {k: theta[k] - eta * (m[k] / c1) / ((v[k] / c2) ** 0.5 + self.eps) for k in theta}
        return new, {"m": m, "v": v, "t": t}


@dataclass(frozen=True)
class Clipped:
    """Gradient-norm clipping of the server's pseudo-gradient before ``inner``'s step:
    g ← g · min(1, max_norm / ‖g‖) with ‖·‖ the Euclidean norm over all leaves of θ."""

    inner: Any
    max_norm: float

    def __post_init__(self) -> None:
        if not (isinstance(self.max_norm, int | float) and self.max_norm > 0):
            raise ValueError(f"max_norm must be a positive number, got {self.max_norm!r}")

    def init(self, theta: Params) -> Any:
        """The inner optimizer's state."""
        return self.inner.init(theta)

    def step(self, theta: Params, grad: Params, state: Any, r: int) -> tuple[Params, Any]:
        """The inner step on the clipped pseudo-gradient."""
        norm = math.sqrt(sum(float((g * g).sum()) for g in grad.values()))
        scale = min(1.0, self.max_norm / norm) if norm > 0 else 1.0
        return self.inner.step(theta, {k: scale * g for k, g in grad.items()}, state, r)


@dataclass(frozen=True)
class OptimizerContext:
    """What an optimizer entry is built with: the stepsize (resolved) and the schedule."""

    lr: float
    schedule: Any = Constant()


@dataclass(frozen=True)
class SGDOptions:
    """Server SGD's momentum."""

    momentum: float = option(0.0, "heavy-ball momentum in [0, 1)")

    def __post_init__(self) -> None:
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


@register("optimizer", "sgd", options=SGDOptions)
def _sgd(opts: SGDOptions, ctx: OptimizerContext) -> SGD:
    """Server SGD θ ← θ − η_r g (with lr 1 on a model change: FedAvg's averaging)."""
    return SGD(lr=ctx.lr, momentum=opts.momentum, schedule=ctx.schedule)


@dataclass(frozen=True)
class AdamOptions:
    """Server Adam's moment decays and ε."""

    beta1: float = option(0.9, "first-moment decay in [0, 1)")
    beta2: float = option(0.999, "second-moment decay in [0, 1)")
    eps: float = option(1e-8, "ε in the denominator")

    def __post_init__(self) -> None:
        Adam(1.0, self.beta1, self.beta2, self.eps)


@register("optimizer", "adam", options=AdamOptions)
def _adam(opts: AdamOptions, ctx: OptimizerContext) -> Adam:
    """Server Adam (FedAdam, Reddi et al. 2021) on the aggregated pseudo-gradient."""
    return Adam(lr=ctx.lr, beta1=opts.beta1, beta2=opts.beta2, eps=opts.eps,
                schedule=ctx.schedule)
