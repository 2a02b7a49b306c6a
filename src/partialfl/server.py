"""Server optimizers and learning-rate schedules acting on θ.

The server receives a (pseudo-)gradient g — the aggregated θ-gradient for FFGG, or −Δ̄ (the
negated mean model change) for delta-based methods such as FedAvg — and steps:

* SGD:  θ ← θ − η_r (g + μ·m) with optional heavy-ball momentum μ.
* Adam (FedAdam, Reddi et al. 2021): m ← β₁m + (1−β₁)g, v ← β₂v + (1−β₂)g²,
  θ ← θ − η_r m̂/(√v̂ + ε), with bias correction.

Schedules map the round r to η_r = lr·s(r).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from partialfl.types import Params


@dataclass(frozen=True)
class Schedule:
    """η_r = lr · factor(r). Kinds: ``constant``, ``warmup-linear`` (linear warm-up over
    ``warmup`` rounds then linear decay to 0 at ``total``), ``exponential`` (halve every
    ``halve_every`` rounds)."""

    kind: str = "constant"
    total: int = 0
    warmup: int = 0
    halve_every: int = 0

    KINDS = ("constant", "warmup-linear", "exponential")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"unknown schedule {self.kind!r}; allowed: {', '.join(self.KINDS)}")
        if self.kind == "warmup-linear" and (self.total < 1 or not 0 <= self.warmup < self.total):
            raise ValueError(
                f"warmup-linear needs total >= 1 and 0 <= warmup < total, got total={self.total}, "
                f"warmup={self.warmup}"
            )
        if self.kind == "exponential" and self.halve_every < 1:
            raise ValueError(f"exponential schedule needs halve_every >= 1, got {self.halve_every}")

    def factor(self, r: int) -> float:
        """The multiplier of the base stepsize at round ``r`` (1 for ``constant``; 0.5^⌊r/k⌋ for
        ``exponential``; linear warm-up to 1, then linear decay to 0 at ``total``)."""
        if self.kind == "constant":
            return 1.0
        if self.kind == "exponential":
            return 0.5 ** (r // self.halve_every)
        if r < self.warmup:
            return (r + 1) / self.warmup
        return max(0.0, (self.total - r) / max(1, self.total - self.warmup))


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
    schedule: Schedule = Schedule()

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
    schedule: Schedule = Schedule()

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
