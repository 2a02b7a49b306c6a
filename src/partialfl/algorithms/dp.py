"""Client-level differential privacy for θ: clipping and Gaussian noise around any algorithm
whose clients send θ-only updates (FFGG, Local FFGG, FedAvg, FedAlt, FedSim, Ditto).

:class:`DifferentiallyPrivate` is DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018, "Learning
Differentially Private Recurrent Language Models", Algorithm 1 with the fixed-denominator
estimator f̃_f) around the base algorithm's clients and server optimizer. Round r:

1. **Sampling.** The cohort C_r is drawn by the wrapper (:meth:`sample_cohort`, which
   :func:`~partialfl.runtime.run_rounds` asks): Poisson with rate q = k/M or k of M without
   replacement (:mod:`partialfl.sampling`) — the rule the accountant assumes.
2. **Clients.** Client m ∈ C_r runs the base algorithm's client update; its message u_m (Δθ,
   or ∇_θ f_m for FFGG) is clipped on the client (so clipping composes with secure
   aggregation):  ũ_m = u_m · min(1, C / ‖u_m‖₂),  ‖ũ_m‖₂ ≤ C. Personal parameters (w_m,
   Ditto's v_m, running statistics) are trained as in the base algorithm and are never
   clipped, noised or sent. Local DP: ũ_m ← ũ_m + N(0, z²C² I), drawn from
   ``generator(key, "dp-noise", r, m)`` with the clients' own key
   (:attr:`~partialfl.algorithms.base.RoundContext.client_secret`: in process the run seed;
   on a Flower SuperNode a key its operator sets, else a fresh secret the server never sees,
   so the server cannot regenerate the noise and subtract it).
3. **Server** (central DP): ū = (Σ_{m ∈ C_r} ũ_m + N(0, z_Δ²C² I)) / k with the fixed
   denominator k (the expected cohort size), so one client moves ū by at most C/k whatever
   the cohort's size; the noise is drawn from ``generator(seed, "dp-noise", r)`` (also when
   no update arrived: the noisy step is released every round). Then the base algorithm's
   server step with ū in place of its mean: θ ← opt(θ, ū) (gradients) or opt(θ, −ū) (deltas).
4. **Adaptive clipping** (optional, central; Andrew, Thakkar, McMahan, Ramaswamy 2021,
   "Differentially Private Learning with Adaptive Clipping", arXiv:1905.03871, Algorithm 1
   with the geometric update): each client also sends b_m = 1{‖u_m‖ ≤ C}; the server
   releases b̄ = (Σ (b_m − ½) + N(0, σ_b²)) / k + ½ (sensitivity ½) and sets
   C ← C · exp(−η_C (b̄ − γ)), so C tracks the γ-quantile of the update norms. The pair
   (sum, count) is one Gaussian mechanism of multiplier z when the update noise is
   z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (their Section 3), which is what the accountant counts.

Uniform weighting is required (example weights would make a client's influence grow with its
data, so the sum's sensitivity would not be C): an ``examples``-weighted base is refused.
Accounting (ε for δ from z, q and the rounds) is :mod:`partialfl.dp_accounting`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import numpy as np

from partialfl import arrays
from partialfl import rng as prng
from partialfl.aggregation import Mean
from partialfl.algorithms.base import Algorithm, ClientResult, ServerState
from partialfl.algorithms.context import WrapperContext
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.dp_accounting import ACCOUNTANTS, Mechanism, epsilon, solve_noise_multiplier
from partialfl.registry import option, register
from partialfl.sampling import SAMPLINGS, draw_cohort
from partialfl.types import ClientUpdates, Params

MODES = ("central", "local")
#: the per-client bit 1{‖u_m‖ ≤ C} of adaptive clipping (a server metric)
UNCLIPPED = "dp_unclipped"
#: state.extra keys: the number of clients M and the current clip norm C (adaptive)
NUM_CLIENTS, CLIP = "dp_num_clients", "dp_clip_norm"
#: the largest noise std z·C: float32 Gaussian noise beyond it overflows (inf in θ)
MAX_NOISE_STD = 1e30


class PrivacyBudgetError(ValueError):
    """A run would spend more privacy than its budget allows."""


def _num(x, name: str, lo: float = 0.0, strict: bool = False, inf: bool = False) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"DP option {name} must be a number, got {x!r}") from None
    ok = (v > lo if strict else v >= lo) and (math.isfinite(v) or (inf and v == math.inf))
    if not ok:
        raise ValueError(f"DP option {name} must be {'>' if strict else '>='} {lo:g}"
                         f"{'' if inf else ' and finite'}, got {x!r}")
    return v


def _int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int | np.integer) or x < 1:
        raise ValueError(f"DP option {name} must be an integer >= 1, got {x!r}")
    return int(x)


@dataclass(frozen=True)
class DPOptions:
    """Client-level DP of θ (see the module docstring for the mechanism); each option's
    help below is its meaning (listed in ``docs/config.md``)."""

    clip_norm: float | None = option(1.0, "C: each client's update clipped to this norm (None: no "
                                     "clipping, only with noise 0)")
    noise_multiplier: float | None = option(None, "z: noise std / C (None: solved for "
                                            "target_epsilon)")
    target_epsilon: float | None = option(None, "the ε to meet after rounds (z solved for it, or "
                                          "checked; inf: no noise)")
    delta: float | None = option(None, "δ of the (ε, δ) guarantee (None: 1/M)")
    rounds: int | None = option(None, "the rounds the budget covers; a stage may not run "
                                "more (None: the stage's rounds)")
    clients_per_round: int | None = option(None, "k, the expected cohort size (None: the stage's, "
                                           "or all)")
    sampling: str = option("poisson", "poisson (add/remove one client) or fixed (k of M; replace "
                           "one)")
    mode: str = option("central", "central (the server noises the sum) or local (each client "
                       "noises)")
    accountant: str = option("rdp", "rdp or pld (dp-accounting; pld: tighter, poisson "
                             "only)")
    adaptive_clipping: bool = option(False, "follow the target_quantile of the update norms "
                                     "(central)")
    target_quantile: float = option(0.5, "γ: the fraction of updates left unclipped")
    clip_lr: float = option(0.2, "η_C: the geometric step of the adaptive clip norm")
    clip_count_std: float | None = option(None, "σ_b: noise std of the unclipped count (None: "
                                          "k/20)")

    def __post_init__(self) -> None:
        f = object.__setattr__
        for name, allowed in (("sampling", SAMPLINGS), ("mode", MODES),
                              ("accountant", ACCOUNTANTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"DP option {name}={getattr(self, name)!r}; allowed: "
                                 f"{', '.join(allowed)}")
        if self.clip_norm is not None:
            f(self, "clip_norm", _num(self.clip_norm, "clip_norm", strict=True))
        if self.noise_multiplier is not None:
            f(self, "noise_multiplier", _num(self.noise_multiplier, "noise_multiplier"))
        if self.target_epsilon is not None:
            f(self, "target_epsilon",
              _num(self.target_epsilon, "target_epsilon", strict=True, inf=True))
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("DP options need noise_multiplier or target_epsilon")
        if self.delta is not None:
            f(self, "delta", _num(self.delta, "delta", strict=True))
            if self.delta >= 1:
                raise ValueError(f"DP option delta must be in (0, 1), got {self.delta!r}")
        for name in ("rounds", "clients_per_round"):
            if getattr(self, name) is not None:
                f(self, name, _int(getattr(self, name), name))
        if self.clip_norm is None and (self.noise_multiplier or self.adaptive_clipping
                                       or (self.target_epsilon or math.inf) < math.inf):
            raise ValueError("DP without clipping (clip_norm None) has no guarantee: it allows "
                             "only noise_multiplier 0, no target_epsilon and no adaptive "
                             "clipping")
        if self.mode == "local" and self.adaptive_clipping:
            raise ValueError("adaptive clipping needs mode 'central' (the server noises the "
                             "unclipped count)")
        if self.accountant == "pld" and self.sampling == "fixed" and self.mode == "central":
            raise ValueError("the PLD accountant has no fixed-size sampling: use accountant "
                             "'rdp' or sampling 'poisson'")
        if not isinstance(self.adaptive_clipping, bool):
            raise ValueError(f"DP option adaptive_clipping must be true or false, got "
                             f"{self.adaptive_clipping!r}")
        f(self, "target_quantile", _num(self.target_quantile, "target_quantile"))
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"DP option target_quantile must be in (0, 1), got "
                             f"{self.target_quantile!r}")
        f(self, "clip_lr", _num(self.clip_lr, "clip_lr"))
        if self.clip_count_std is not None:
            f(self, "clip_count_std", _num(self.clip_count_std, "clip_count_std", strict=True))


@dataclass(frozen=True)
class DPPlan:
    """The options resolved for M clients: what the accountant counts (``mechanism``: z, k,
    sampling), the noise really added to the update sum (z_Δ = ``update_noise``), σ_b, δ,
    the fixed denominator k and the ε of the whole budget (None without ``rounds``)."""

    mechanism: Mechanism
    update_noise: float
    clip_count_std: float
    delta: float
    denominator: int
    epsilon_budget: float | None


def make_plan(opts: DPOptions, num_clients: int) -> DPPlan:
    """Resolve ``opts`` for ``num_clients`` clients: solve z for the target ε, or check that
    the given z meets it; a ValueError naming the values when the target cannot be met."""
    M = int(num_clients)
    k = opts.clients_per_round if opts.clients_per_round is not None else M
    if k > M:
        raise ValueError(f"DP option clients_per_round={k} exceeds the {M} clients")
    delta = opts.delta if opts.delta is not None else 1.0 / M
    if opts.target_epsilon not in (None, math.inf) and opts.rounds is None:
        raise ValueError("DP option target_epsilon needs rounds (the budget covers them; in a "
                         "spec they default to the stage's rounds)")
    mech = Mechanism(opts.noise_multiplier or 0.0, M, k, opts.sampling, opts.mode == "local")
    if opts.noise_multiplier is None:
        z = solve_noise_multiplier(mech, opts.target_epsilon, opts.rounds, delta,
                                   opts.accountant)
        mech = Mechanism(z, M, k, opts.sampling, mech.local)
    eps = None if opts.rounds is None else epsilon(mech, opts.rounds, delta, opts.accountant)
    target = opts.target_epsilon
    if target is not None and eps is not None and eps > target:
        raise PrivacyBudgetError(
            f"DP config cannot meet target_epsilon={target:g}: {mech.describe()} gives "
            f"epsilon={eps:.4g} after rounds={opts.rounds} at delta={delta:.3g}; raise "
            "noise_multiplier (or leave it unset to have it solved)")
    z, z_upd, sb = mech.noise_multiplier, mech.noise_multiplier, 0.0
    if opts.clip_norm is not None and z * opts.clip_norm > MAX_NOISE_STD:
        raise ValueError(f"DP noise std z·C = {z:.4g} × {opts.clip_norm:.4g} exceeds "
                         f"{MAX_NOISE_STD:g}: float32 noise would overflow; lower clip_norm")
    if opts.adaptive_clipping and z > 0:
        sb = opts.clip_count_std if opts.clip_count_std is not None else k / 20
        if z >= 2 * sb:
            raise PrivacyBudgetError(
                f"adaptive clipping cannot meet noise multiplier z={z:.4g}: the unclipped "
                f"count's noise clip_count_std={sb:.4g} must exceed z/2={z / 2:.4g}; raise "
                "clip_count_std or clients_per_round")
        z_upd = (z ** -2 - (2 * sb) ** -2) ** -0.5
    return DPPlan(mech, z_upd, sb, delta, k, eps)


def row_norms(vectors: Params) -> np.ndarray:
    """``[k]`` float64: the ℓ2 norm of every client's row over all leaves of a stacked tree."""
    sq = None
    for v in vectors.values():
        a = arrays.to_numpy(v)
        s = np.square(a.reshape(a.shape[0], -1), dtype=np.float64).sum(1)
        sq = s if sq is None else sq + s
    return np.sqrt(sq)


def clip_factors(norms: np.ndarray, clip: float) -> np.ndarray:
    """min(1, C/‖u_m‖) per row (1 for a zero row; NaN rows stay NaN, ∞ rows become NaN, so the
    message path drops them)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(norms > clip, clip / norms, np.where(np.isnan(norms), np.nan, 1.0))


def _scale_rows(vectors: Params, s: np.ndarray) -> Params:
    if np.all(s == 1.0):
        return vectors
    return {n: v * arrays.per_row(s, v) for n, v in vectors.items()}


def _aggregating(alg, agg):
    """A copy of ``alg`` whose aggregate is ``agg`` (the private mean replaces the base's),
    through any wrappers around it (each delegates its server step to its ``base``)."""
    from partialfl.algorithms.wrapper import AlgorithmWrapper

    out = copy.copy(alg)
    if isinstance(alg, AlgorithmWrapper):
        out.base = _aggregating(alg.base, agg)
    else:
        out.aggregate = lambda _updates: agg
    return out


def _gaussian(tree: Params, rng: np.random.Generator, std: float) -> Params:
    """``tree`` + N(0, std² I), drawn in float64 leaf by leaf in sorted name order."""
    noise = {n: rng.standard_normal(tuple(tree[n].shape)) * std for n in sorted(tree)}
    return {n: v + arrays.as_like(noise[n], v) for n, v in tree.items()}


class DifferentiallyPrivate(AlgorithmWrapper):
    """``base`` — a plain algorithm with uniform weighting, the mean aggregator and the
    default server step (FFGG, LocalFFGG, FedAvg, FedAlt, FedSim, Ditto) — with client-level
    DP of θ under ``options`` (see the module docstring). ``idle``: a stage of 0 rounds,
    which plans nothing and refuses every round (its nodes still behave as private ones)."""

    #: the server step reads the updates only through their mean and their number (with
    #: ``server_metrics`` empty, i.e. fixed clipping: secure aggregation can carry them)
    mean_only = True

    def __init__(self, base: Algorithm, options: DPOptions, idle: bool = False) -> None:
        if isinstance(base, AlgorithmWrapper):  # a configuration's combination: a value
            # error, so a spec gets one line (a TypeError once escaped as a traceback)
            raise ValueError(f"DP wraps a plain algorithm, not the wrapper "
                             f"{type(base).__name__}: [privacy] cannot be combined with "
                             "[faults], [attack] or an aggregation rule with a trusted client "
                             "(MoNNA's trusted)")
        super().__init__(base)
        if not isinstance(options, DPOptions):
            raise TypeError(f"options must be DPOptions, got {type(options).__name__}")
        if getattr(base, "weighting", "uniform") != "uniform":
            raise ValueError(f"DP needs uniform weighting (the sum's sensitivity is the clip "
                             f"norm only if every client counts once); {base.name} has "
                             f"weighting={base.weighting!r}")
        if not isinstance(base.aggregator, Mean):
            raise ValueError(f"DP replaces the mean by a noisy sum; {base.name}'s aggregator "
                             f"is {type(base.aggregator).__name__}, not Mean")
        if type(base).server_update is not Algorithm.server_update:
            raise ValueError(f"DP covers the plain server step on θ-only updates; {base.name} "
                             "has its own server step (e.g. Scaffold's control variates)")
        if base.pseudo_gradient not in ("gradient", "delta"):
            raise ValueError(f"unknown pseudo_gradient {base.pseudo_gradient!r}")
        self.options, self.idle = options, idle
        self.name = f"dp-{base.name}"
        self.client_metrics = tuple(getattr(base, "client_metrics", ()))
        self.server_metrics = (*getattr(base, "server_metrics", ()),
                               *((UNCLIPPED,) if options.adaptive_clipping else ()))
        # the clients clip with the server's current C (adaptive: it changes every round)
        self.shared_extra = (*getattr(base, "shared_extra", ()),
                             *((CLIP,) if options.adaptive_clipping else ()))
        # M (the accountant's sampling rate) and a clip norm that does not adapt are the
        # options', whatever a resumed state says
        self.fixed_extra = (*getattr(base, "fixed_extra", ()), NUM_CLIENTS,
                            *(() if options.adaptive_clipping else (CLIP,)))
        self._plans: dict[int, DPPlan] = {}

    # -- configuration -------------------------------------------------------------------
    def plan(self, num_clients: int) -> DPPlan:
        """The options resolved for ``num_clients`` clients (cached; see :func:`make_plan`)."""
        if num_clients not in self._plans:
            self._plans[num_clients] = make_plan(self.options, num_clients)
        return self._plans[num_clients]

    def _clip(self, state: ServerState) -> float | None:
        return state.extra.get(CLIP, self.options.clip_norm)

    def init(self, problem, theta0: Params) -> ServerState:
        """The base state, after resolving the plan (a config that cannot meet its target
        raises here, before any round); the state records M and the clip norm."""
        if not self.idle:
            self.plan(problem.num_clients)
        state = self.base.init(problem, theta0)
        state.extra[NUM_CLIENTS] = int(problem.num_clients)
        if self.options.clip_norm is not None:
            state.extra[CLIP] = float(self.options.clip_norm)
        return state

    # -- sampling (asked by the runtime) -------------------------------------------------
    def sample_cohort(self, seed: int, round_: int, num_clients: int,
                      clients_per_round: int | None = None) -> np.ndarray:
        """Round ``round_``'s cohort under the options' sampling (what the accountant
        assumes). ``clients_per_round`` (the runtime's) must be None or the options' k; a
        round past the budget's ``rounds`` raises :class:`PrivacyBudgetError`."""
        self.check_budget(round_)
        k = self.plan(num_clients).mechanism.clients_per_round
        if clients_per_round is not None and clients_per_round != k:
            raise ValueError(f"DP samples its own cohorts (clients_per_round={k} in its "
                             f"options); the run asked clients_per_round={clients_per_round}: "
                             "leave it unset")
        return draw_cohort(self.options.sampling, seed, round_, num_clients, k)

    def check_budget(self, round_: int) -> None:
        """Refuse a round past the budget's ``rounds`` (:class:`PrivacyBudgetError`): asked
        by the sampling and by every client update, so a client (a SuperNode asked by an
        untrusted server) never releases more rounds than the accountant counts."""
        rounds = 0 if self.idle else self.options.rounds
        if round_ < 0:  # (not left to the cohort draw's own check of its purpose path)
            raise PrivacyBudgetError(f"DP budget covers rounds 0, 1, …; round {round_} is none")
        if rounds is not None and round_ >= rounds:
            raise PrivacyBudgetError(f"DP budget covers rounds={rounds}; round {round_} would "
                                     "spend more privacy (raise the DP option rounds)")

    def _check_cohort(self, problem, cohort: np.ndarray, ctx) -> None:
        self.check_budget(ctx.round)
        M = problem.num_clients
        drawn = draw_cohort(self.options.sampling, ctx.seed, ctx.round, M,
                            self.plan(M).mechanism.clients_per_round)
        bad = cohort[~np.isin(cohort, drawn)]
        if len(bad):
            raise ValueError(f"DP: clients {bad[:5].tolist()} of round {ctx.round} were not "
                             f"drawn by its {self.options.sampling} sampling (which the "
                             "accountant assumes): run it with partialfl.runtime.run_rounds, "
                             "which asks algorithm.sample_cohort, as the outermost wrapper")

    # -- clients -------------------------------------------------------------------------
    def client_update(self, state, problem, cohort, ctx, client_state=None) -> ClientResult:
        """The base client update with the message clipped to C (and, local DP, noised);
        the client state (personal parameters) passes through untouched."""
        cohort = np.asarray(cohort)
        self._check_cohort(problem, cohort, ctx)
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        up = res.updates
        if up.extra:
            raise ValueError(f"DP covers θ-only updates; {self.base.name} also sends "
                             f"{sorted(up.extra)}")
        vectors, metrics = up.vectors, dict(up.metrics)
        if self.options.mode == "local":  # only the noised update leaves the client: its
            metrics = {}  # exact training loss (train_loss) is no part of the mechanism
        clip = self._clip(state)
        if clip is not None:
            norms = row_norms(vectors)
            vectors = _scale_rows(vectors, clip_factors(norms, clip))
            if self.options.adaptive_clipping:
                metrics[UNCLIPPED] = (norms <= clip).astype(np.float64)
        z = self.plan(problem.num_clients).update_noise
        if self.options.mode == "local" and z > 0:
            vectors = {n: arrays.copy(v) for n, v in vectors.items()}
            for i, m in enumerate(cohort):
                rng = prng.generator(ctx.client_secret, "dp-noise", ctx.round, int(m))
                row = _gaussian({n: v[i] for n, v in vectors.items()}, rng, z * clip)
                for n, v in row.items():
                    vectors[n][i] = v
        out = ClientUpdates(vectors, np.ones(len(cohort)), cohort, up.grad_evals, metrics)
        return ClientResult(out, res.client_state)

    # -- server --------------------------------------------------------------------------
    def server_update(self, state: ServerState, updates: ClientUpdates, ctx) -> ServerState:
        """ū = (Σ clip_C(ũ_m) + N(0, z_Δ²C²))/k, then the base server step with ū for the mean
        (and, adaptive, the new clip norm)."""
        if "staleness" in updates.metrics:
            raise ValueError("DP needs synchronous rounds (a noisy sum per round); it got an "
                             "asynchronous runtime's update")
        plan = self.plan(state.extra[NUM_CLIENTS])
        clip, k, n = self._clip(state), plan.denominator, len(updates.cohort)
        if n and clip is not None and self.options.mode == "central":
            # the sensitivity C holds whatever a client sent: rows beyond C (and rounding)
            # are clipped here too; honest rows (‖ũ_m‖ ≤ C) are left bit for bit
            norms = row_norms(updates.vectors)
            s = np.where(norms > clip * (1 + 1e-5), clip_factors(norms, clip), 1.0)
            updates = replace(updates, vectors=_scale_rows(updates.vectors, s))
        if n:
            # the plain mean of the n received rows: uniform, never weights a node sends
            agg = self.base.aggregate(replace(updates, weights=np.ones(n)))
            if n != k:
                agg = {name: v * (n / k) for name, v in agg.items()}
        else:
            agg = {name: arrays.zeros_like(v) for name, v in state.theta.items()}
            updates = ClientUpdates({name: arrays.repeat_rows(v, 0)
                                     for name, v in agg.items()}, np.zeros(0),
                                    np.zeros(0, dtype=np.int64))
        if self.options.mode == "central" and plan.update_noise > 0:
            rng = prng.generator(ctx.seed, "dp-noise", ctx.round)
            agg = _gaussian(agg, rng, plan.update_noise * clip / k)
        new = _aggregating(self.base, agg).server_update(state, updates, ctx)
        if self.options.adaptive_clipping:
            new.extra[CLIP] = self._next_clip(clip, updates, plan, ctx)
        return new

    def _next_clip(self, clip: float, updates: ClientUpdates, plan: DPPlan, ctx) -> float:
        """C · exp(−η_C (b̄ − γ)) with b̄ = (Σ(b_m − ½) + N(0, σ_b²))/k + ½."""
        bits = np.asarray(updates.metrics.get(UNCLIPPED, np.zeros(0)), dtype=np.float64)
        bits = np.clip(np.nan_to_num(bits, nan=0.0), 0.0, 1.0)  # b_m ∈ [0, 1]: untrusted
        noise = (prng.generator(ctx.seed, "dp-noise-count", ctx.round).standard_normal()
                 * plan.clip_count_std)
        frac = (float(np.sum(bits - 0.5)) + noise) / plan.denominator + 0.5
        return float(clip * math.exp(-self.options.clip_lr
                                     * (frac - self.options.target_quantile)))

    def server_update_empty(self, state: ServerState, ctx) -> ServerState:
        """The round's release when no update arrived (nobody sampled, or all lost): the
        noise alone, as the mechanism the accountant counts."""
        return self.server_update(state, ClientUpdates({}, np.zeros(0),
                                                       np.zeros(0, dtype=np.int64)), ctx)

    # -- reporting -----------------------------------------------------------------------
    def epsilon(self, rounds: int, num_clients: int) -> float:
        """ε spent after ``rounds`` rounds (at the plan's δ)."""
        plan = self.plan(num_clients)
        return epsilon(plan.mechanism, rounds, plan.delta, self.options.accountant)

    def round_metrics(self, state: ServerState) -> dict:
        """The privacy entries of a metric record: ε spent so far, δ, z and C (none for an
        idle stage: it released nothing)."""
        if self.idle:
            return {}
        M = state.extra[NUM_CLIENTS]
        plan = self.plan(M)
        clip = self._clip(state)
        return {"dp_epsilon": self.epsilon(state.round, M), "dp_delta": plan.delta,
                "dp_noise_multiplier": plan.mechanism.noise_multiplier,
                "dp_clip_norm": math.inf if clip is None else float(clip)}

    def summary(self, num_clients: int, rounds: int | None = None) -> dict:
        """The privacy statement of a run of ``rounds`` rounds (default: the budget's)."""
        plan = self.plan(num_clients)
        rounds = self.options.rounds if rounds is None else rounds
        m = plan.mechanism
        return {"mechanism": m.describe(), "mode": self.options.mode,
                "sampling": m.sampling, "sampling_rate": m.rate, "neighbours": m.neighbours,
                "noise_multiplier": m.noise_multiplier, "update_noise_multiplier":
                plan.update_noise, "delta": plan.delta, "accountant": self.options.accountant,
                "rounds": rounds, "epsilon": (None if rounds is None
                                              else self.epsilon(rounds, num_clients)),
                "clip_norm": self.options.clip_norm,
                "adaptive_clipping": self.options.adaptive_clipping}


@register("wrapper", "dp", options=DPOptions, block="privacy")
def _dp(opts: DPOptions, ctx: WrapperContext) -> DifferentiallyPrivate:
    """Client-level differential privacy of θ: each client's update clipped, Gaussian noise
    on the aggregate (central) or on each update (local), ε from dp-accounting; personal
    parameters never clipped, noised or sent. A stage of 0 rounds (skipped) releases nothing:
    neither its plan nor its table's cohort is checked (``idle``)."""
    if ctx.rounds == 0:
        return DifferentiallyPrivate(ctx.base, opts, idle=True)
    fill = {}
    if opts.rounds is None and ctx.rounds:
        fill["rounds"] = ctx.rounds
    if opts.clients_per_round is None and ctx.clients_per_round:
        fill["clients_per_round"] = ctx.clients_per_round
    dp = DifferentiallyPrivate(ctx.base, replace(opts, **fill) if fill else opts)
    o = dp.options  # what the run would refuse at round `rounds` or at sampling, refused now
    if ctx.rounds and o.rounds is not None and ctx.rounds > o.rounds:
        raise PrivacyBudgetError(f"DP budget covers rounds={o.rounds}; the stage runs "
                                 f"{ctx.rounds} rounds (raise the DP option rounds)")
    if ctx.clients_per_round and ctx.clients_per_round != o.clients_per_round:
        raise ValueError(f"DP samples its own cohorts (clients_per_round={o.clients_per_round}"
                         f" in its options); the stage asks clients_per_round="
                         f"{ctx.clients_per_round}: leave it unset")
    if ctx.num_clients:
        dp.plan(ctx.num_clients)  # a target it cannot meet: refused before any round
    return dp
