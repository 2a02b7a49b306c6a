"""THE local SGD loop for model problems: epochs of minibatch SGD on any subset of parameters.

Every model algorithm (FFGG's fine-tuner, Local FFGG, FedAvg, FedAlt, FedSim, stage-3
fine-tuning, evaluation on new clients) trains through :func:`run_sgd`. One step on client m
with minibatch b ⊂ D_m and trained variables x (w, θ or both):

    g = ∇_x [ Σ_{i∈b} ℓ_i / Σ_{i∈b} d_i ],   g ← g · min(1, c / (‖g‖ + 1e-6))  (if clip c),
    x ← x − η g.

``train="alternate"`` (Local FFGG, Algorithm 4) does, per minibatch, a w-step and then a θ-step
at the new w (both on the same minibatch, each clipped separately). Every forward pass also
updates the client's normalization running statistics carried in w (whatever is trained), as
a forward pass in train mode does in PyTorch.

``prox=(λ, c)`` (with ``train="theta"``; Ditto's personal model) follows every step with the
exact proximal map of (λ/2)‖x − c‖²:  x ← (x + ηλ c) / (1 + ηλ)  (λ = ∞: x ← c), a
proximal-gradient step on f_m(x) + (λ/2)‖x − c‖², stable for every λ ≥ 0; λ = 0 is plain SGD.

Minibatches: for each epoch a permutation of the client's examples drawn from
``partialfl.rng.generator(seed, stream, round, client)`` (one generator per client, epochs in
sequence), cut into consecutive batches of ``batch_size`` (the last one may be smaller). With
``steps`` given, exactly that many batches are taken, drawing further epochs as needed. The
plan depends only on (seed, stream, round, client, n), never on the backend or on which
other clients share the cohort, so the vectorised and the sequential paths take identical steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from partialfl.batching import map_clients
from partialfl.local.base import LocalResult, check_train
from partialfl.local.solvers import SolverResult
from partialfl.problems.base import check_w_init
from partialfl.registry import option, register
from partialfl.rng import generator, round_path
from partialfl.types import Params


@dataclass(frozen=True)
class SGDConfig:
    """Minibatch SGD epochs on the client's data (model problems): the client optimizer of
    every model algorithm, and FFGG's fine-tuner."""

    lr: float = option(0.01, "stepsize η > 0")
    epochs: int = option(1, "passes over the client's data (ignored when steps is given)")
    batch_size: int = option(32, "minibatch size")
    steps: int | None = option(None, "exact number of minibatch steps instead of epochs")
    clip_norm: float | None = option(None, "clip each step's gradient to this norm")

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, int | float) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"client lr must be a positive finite number, got {self.lr!r}")
        if not isinstance(self.epochs, int) or self.epochs < 0:
            raise ValueError(f"epochs must be a non-negative integer, got {self.epochs!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 0):
            raise ValueError(f"steps must be None or a non-negative integer, got {self.steps!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be None or > 0, got {self.clip_norm!r}")

    def run(self, problem, cohort, theta: Params, w: Params, train: str, *, seed: int,
            round_: int, stream: str, shift: Params | None = None, mode=None) -> LocalResult:
        """:func:`~partialfl.local.sgd.run_sgd` with this configuration (the
        :class:`~partialfl.local.base.LocalTrainer` interface)."""
        return run_sgd(problem, cohort, theta, w, train=train, cfg=self, seed=seed,
                       round_=round_, stream=stream, shift=shift, mode=mode)

    def stepsizes(self, problem, cohort) -> np.ndarray:
        """η = ``lr`` for every client of the cohort ``[k]``."""
        return np.full(len(cohort), float(self.lr))

    # -- the local component interface (partialfl.algorithms.context) -------------------
    def trainer(self, **over) -> SGDConfig:
        """This trainer with some settings replaced (e.g. ``steps=K``)."""
        return dataclasses.replace(self, **over) if over else self

    def finetuner(self, w_init: str):
        """FFGG's fine-tuner: SGD on w alone from ``w_init``."""
        return SGDFineTuner(self, w_init)


@register("local", "sgd", options=SGDConfig, trainer=True)
def _sgd(opts: SGDConfig, ctx=None) -> SGDConfig:
    """Minibatch SGD epochs on the client's data (model problems): the client optimizer of
    every model algorithm, and FFGG's fine-tuner."""
    return opts


def batch_plan(n: int, batch_size: int, epochs: int, steps: int | None,
               rng: np.random.Generator) -> list[np.ndarray]:
    """The minibatches (index arrays into a client's n examples) of one local run."""
    if n == 0:
        return []
    out: list[np.ndarray] = []
    e = 0
    while (steps is None and e < epochs) or (steps is not None and len(out) < steps):
        perm = rng.permutation(n)
        out.extend(perm[i:i + batch_size] for i in range(0, n, batch_size))
        e += 1
    return out if steps is None else out[:steps]


def client_plans(problem, cohort, cfg: SGDConfig, seed: int, round_: int, stream: str
                 ) -> list[list[np.ndarray]]:
    """The minibatch plan of every client of the cohort for one call of the SGD loop (``cfg``'s
    epochs or steps, batches drawn from (seed, stream, round, client))."""
    sizes = problem.num_examples(cohort)
    return [batch_plan(int(n), cfg.batch_size, cfg.epochs, cfg.steps,
                       generator(seed, stream, *round_path(round_), int(m)))
            for m, n in zip(cohort, sizes)]


SGDResult = LocalResult  # loss: the mean minibatch loss per client ([k], nan if no step)


def _clip(g: Params, c: float | None) -> Params:
    import torch

    if c is None:
        return g
    v0 = next(iter(g.values()))
    k = v0.shape[0]
    sq = torch.zeros(k, device=v0.device)
    for v in g.values():
        sq += v.reshape(k, -1).pow(2).sum(1)
    scale = torch.clamp(c / (sq.sqrt() + 1e-6), max=1.0)
    return {n: v * scale.reshape((-1,) + (1,) * (v.dim() - 1)) for n, v in g.items()}


def _step(x: Params, g: Params, lr: float) -> Params:
    return {n: (x[n] - lr * g[n]) if n in g else x[n] for n in x}


def _stack_theta(theta: Params, shapes: dict, k: int) -> Params:
    return {n: (v.unsqueeze(0).repeat(k, *([1] * v.dim())) if tuple(v.shape) == shapes[n]
                else v.clone()) for n, v in theta.items()}


def run_sgd(problem, cohort, theta: Params, w: Params, *, train: str, cfg: SGDConfig,
            seed: int, round_: int, stream: str,
            prox: tuple[float, Params] | None = None, shift: Params | None = None,
            mode=None) -> SGDResult:
    """Run the local SGD loop on every client of the cohort (see the module docstring).

    ``theta`` is shared or per client; ``w`` is stacked ``[k, ...]``; ``shift`` (stacked
    ``[k, ...]`` over trained names) is subtracted from every (clipped) step gradient of a
    client that takes the step (Scaffold's correction c_m − c). ``mode`` (the run's batching
    mode, ``RoundContext.mode``; None: the problem's default) groups the clients: under a
    ``Vmap`` a group of clients steps together (at most ``max_examples // batch_size`` of
    them; a client whose plan is over gets no batch, hence no change), under a ``Loop`` one
    client after the other.
    """
    check_train(train)
    if prox is not None:
        lam = float(prox[0])
        if train != "theta" or not (lam >= 0):
            raise ValueError(f"prox=(λ, centre) needs train='theta' and λ >= 0, got "
                             f"train={train!r}, λ={prox[0]!r}")
    cohort = np.asarray(cohort, dtype=np.int64)
    k = len(cohort)
    if k == 0:
        raise ValueError("run_sgd needs a non-empty cohort")
    plans = client_plans(problem, cohort, cfg, seed, round_, stream)
    if not hasattr(problem, "call_mode"):  # the default client on a closed-form problem
        from partialfl.config import ConfigError

        raise ConfigError(f"client 'sgd' trains a model on minibatches of data; "
                          f"{type(problem).__name__} is a closed form: give the stage's "
                          "client gd, cg or exact (e.g. client = {name = \"cg\", tau = 5})")
    mode = problem.call_mode(mode)
    if train in ("theta", "both", "alternate"):
        theta = _stack_theta(theta, problem.theta_shapes, k)

    def group(pos):
        sl = slice(int(pos[0]), int(pos[-1]) + 1)
        th_g = {n: (v if tuple(v.shape) == problem.theta_shapes[n] else v[sl])
                for n, v in theta.items()}
        sh_g = None if shift is None else {n: v[sl] for n, v in shift.items()}
        th_g, w_g, s, lg = _loop(problem, cohort[sl], th_g, {n: v[sl] for n, v in w.items()},
                                 plans[sl], train, cfg, mode, prox, sh_g)
        return th_g if train != "w" else {}, w_g, np.array([s]), lg

    th_out, w_out, steps, losses = map_clients(group, k, mode, per_client=cfg.batch_size)
    if train == "w":
        th_out = theta
    return SGDResult(th_out, w_out, int(steps.max()), np.asarray(losses, dtype=float),
                     np.array([len(p) for p in plans]))


def _grads(problem, cohort, theta, w, batches, wrt, mode):
    """Minibatch gradients; running statistics (personal client state, see
    :class:`~partialfl.problems.model.ModelProblem`) updated in w by the forward pass."""
    if not getattr(problem, "state_names", ()):
        return problem.minibatch_grads(cohort, theta, w, batches, wrt, mode=mode), w
    g, loss, stats = problem.minibatch_grads(cohort, theta, w, batches, wrt, with_state=True,
                                             mode=mode)
    return (g, loss), {**w, **stats}


def _prox_step(x: Params, prox: tuple[float, Params], lr: float, active: np.ndarray) -> Params:
    """x ← (x + ηλ c)/(1 + ηλ) on the rows of clients that took a step (``active``)."""
    import torch

    lam, centre = float(prox[0]), prox[1]
    out = {}
    for n, v in x.items():
        a = torch.as_tensor(active, device=v.device)
        c = centre[n].to(v.device)
        if math.isinf(lam):
            new = c.expand_as(v).clone()
        elif lr * lam > 1e20:  # ηλc overflowed float32 (λ = 1e308: inf/inf, NaN models)
            new = c + (v - c) * (1.0 / (1 + lr * lam))
        else:
            new = (v + lr * lam * c) / (1 + lr * lam)
        mask = a.reshape((-1,) + (1,) * (v.dim() - 1))
        out[n] = torch.where(mask, new.to(v.dtype), v)
    return out


def _shifted(g: Params, shift: Params | None, active: np.ndarray) -> Params:
    """g − shift on the rows of clients that take the step (``active``)."""
    import torch

    if shift is None:
        return g
    out = {}
    for n, v in g.items():
        if n not in shift:
            out[n] = v
            continue
        mask = torch.as_tensor(active, dtype=v.dtype, device=v.device)
        out[n] = v - shift[n].to(v.device) * mask.reshape((-1,) + (1,) * (v.dim() - 1))
    return out


def _plain(problem, cohort, train: str, cfg, prox, shift) -> bool:
    """Whether the group takes the problem's one-client fast path
    (:meth:`~partialfl.problems.model.ModelProblem.plain_sgd`, bit for bit this loop)."""
    return (len(cohort) == 1 and train in ("w", "theta", "both") and cfg.clip_norm is None
            and prox is None and shift is None and getattr(problem, "plain_sgd_ok", False))


def _loop(problem, cohort, theta, w, plans, train, cfg, mode, prox=None, shift=None):
    import torch

    k = len(cohort)
    if _plain(problem, cohort, train, cfg, prox, shift):
        shared = {n for n, v in theta.items() if tuple(v.shape) == problem.theta_shapes[n]}
        th1 = {n: (v if n in shared else v[0]) for n, v in theta.items()}
        th1, w1, total = problem.plain_sgd(int(cohort[0]), th1, {n: v[0] for n, v in w.items()},
                                           plans[0], train, cfg.lr)
        th_out = {n: (v if n in shared and train == "w" else v.unsqueeze(0))
                  for n, v in th1.items()}
        mean = float(total) / len(plans[0]) if len(plans[0]) else np.nan
        return th_out, {n: v.unsqueeze(0) for n, v in w1.items()}, len(plans[0]), \
            np.array([mean])
    n_steps = max((len(p) for p in plans), default=0)
    # summed on the problem's device (no host sync per step); float64 where it exists
    dev = getattr(problem, "device", torch.device("cpu"))
    loss_sum = torch.zeros(k, dtype=torch.float32 if dev.type == "mps" else torch.float64,
                           device=dev)
    for s in range(n_steps):
        batches = [p[s] if s < len(p) else None for p in plans]
        active = np.array([b is not None for b in batches])
        if train == "alternate":
            (gw, loss), w = _grads(problem, cohort, theta, w, batches, "w", mode)
            w = _step(w, _shifted(_clip(gw, cfg.clip_norm), shift, active), cfg.lr)
            (gt, _), w = _grads(problem, cohort, theta, w, batches, "theta", mode)
            theta = _step(theta, _shifted(_clip(gt, cfg.clip_norm), shift, active), cfg.lr)
        else:
            (g, loss), w = _grads(problem, cohort, theta, w, batches, train, mode)
            g = _shifted(_clip(g, cfg.clip_norm), shift, active)
            if train in ("w", "both"):
                w = _step(w, g, cfg.lr)
            if train in ("theta", "both"):
                theta = _step(theta, g, cfg.lr)
            if prox is not None:
                theta = _prox_step(theta, prox, cfg.lr, active)
        loss_sum += loss.to(loss_sum.dtype)
    loss_sum = loss_sum.cpu().numpy().astype(np.float64)
    counts = np.array([len(p) for p in plans], dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_loss = np.where(counts > 0, loss_sum / counts, np.nan)
    return theta, w, n_steps, mean_loss


@dataclass(frozen=True)
class SGDFineTuner:
    """FFGG's local solver for model problems: w ← init (``pretrained``/``zero``/``random``),
    then ``cfg`` SGD epochs on w with θ fixed (stream ``"finetune"``). Stateless."""

    cfg: SGDConfig
    init: str = "pretrained"

    def __post_init__(self) -> None:
        check_w_init(self.init)

    def __call__(self, problem, cohort, theta, seed=0, round_=0, *, mode=None) -> SolverResult:
        w = problem.init_w(cohort, self.init, seed, round_)
        res = run_sgd(problem, cohort, theta, w, train="w", cfg=self.cfg, seed=seed,
                      round_=round_, stream="finetune", mode=mode)
        return SolverResult(res.w, res.steps, res.loss)

    def with_gradient(self, problem, cohort, theta, seed=0, round_=0, *, mode=None
                      ) -> tuple[SolverResult, Params] | None:
        """FFGG's whole client in one pass where the problem offers it: ``(this solver's
        result, ∇_θ f_m(θ, w_m) stacked [k, ...])``, the values of ``self(...)`` followed by
        ``problem.grad_theta`` (:mod:`partialfl.problems.model.head`: w is the output layer,
        clients one by one, no clipping); None where it does not apply."""
        ok = getattr(problem, "head_cache_ok", None)
        if ok is None or self.cfg.clip_norm is not None or not ok():
            return None
        if problem.call_mode(mode).vectorized:
            return None
        import torch

        cohort = np.asarray(cohort, dtype=np.int64)
        plans = client_plans(problem, cohort, self.cfg, seed, round_, "finetune")
        w0 = problem.init_w(cohort, self.init, seed, round_)
        rows = [problem.head_finetune_grad(int(m), theta, {n: v[i] for n, v in w0.items()},
                                           plans[i], float(self.cfg.lr))
                for i, m in enumerate(cohort)]
        w = {n: torch.stack([r[0][n] for r in rows]) for n in rows[0][0]}
        g = {n: torch.stack([r[2][n] * (1.0 / torch.clamp(r[3], min=1e-12)) for r in rows])
             for n in rows[0][2]}
        with np.errstate(invalid="ignore", divide="ignore"):
            loss = np.array([float(r[1]) / len(p) if len(p) else np.nan
                             for r, p in zip(rows, plans)])
        return SolverResult(w, max(len(p) for p in plans), loss), g
