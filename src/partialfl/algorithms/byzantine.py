"""Byzantine-robust training: BR-FFGG (the paper's Algorithm 5) and robust baselines.

:class:`ByzantineRobust` wraps any :class:`~partialfl.algorithms.base.Algorithm`:

1. clients run the base algorithm's ``client_update`` (Byzantine clients too: an omniscient
   adversary knows what they would honestly send);
2. the adversary replaces the rows of the Byzantine clients of the cohort by
   ``attack(honest rows, Byzantine rows' honest values, rng)`` with
   ``rng = generator(seed, "attack", round)``; attacks that tune their scale against the
   defence (``alie-opt``, ``ipm-opt``) are given the round's aggregator;
3. the server drops every update containing NaN or ±inf, aggregates the rest with the robust
   ``aggregator`` (randomized rules such as bucketing are bound to the round), and steps with
   the base algorithm's own server update; a step that would make θ non-finite is rejected
   (θ is kept). So a non-finite value sent by a client never reaches θ.

BR-FFGG is ``ByzantineRobust(FFGG(solver, SGD(γ)), aggregator, byzantine, attack)``
(:func:`br_ffgg`): g_m = ∇₁f_m(θ, w_m) after fine-tuning, θ ← θ − γ·Agg({g_m}). The robust
non-personalized baseline wraps gradient steps on the shared model x = (θ, w)
(:func:`partialfl.algorithms.asynchronous.joint_sgd`), so the same aggregators see full
gradients ∇f_m(x).

The set of Byzantine clients and their attack are part of the run's configuration
(:class:`ByzantineConfig`). Counters in ``state.extra``: ``byz_dropped`` (non-finite updates
dropped so far), ``byz_rejected`` (server steps rejected), ``byz_excess`` (rounds whose cohort
held more Byzantine clients than the aggregator tolerates, e.g. by the chance of sampling),
``rounds_unprotected`` (rounds skipped because so few clients replied that the aggregator could
not tolerate the planned f; the runtimes' name for such rounds) and ``byz_no_reference`` (rounds
skipped because the client a MoNNA trusts sent no usable update); a warning the first time of
each. A rule that trusts a client (MoNNA's ``trusted``) has it in every cohort
(:meth:`ByzantineRobust.sample_cohort`), never Byzantine, and its row found by id each round.

Protection (:mod:`partialfl.aggregation.protection`) is checked where it can fail silently:
``init`` refuses a Byzantine fraction (of all clients) above the aggregator's δ and, given
``clients_per_round``, a cohort size in which the aggregator tolerates no Byzantine client
(e.g. 5 clients per round with δ = 0.1: ⌊0.5⌋ = 0). Each round checks the cohort as it
arrived, after non-finite rows are dropped: a cohort as large as planned
(``clients_per_round``, else the first round's) that is not protected is refused; with fewer
usable updates (clients failed or sent non-finite rows) the rule keeps the planned cohort's f
(:func:`~partialfl.aggregation.protection.cohort_checked`), so a failing client neither stops
the run nor lets an attacker within δ through; where the rule's own bound no longer holds for
that f, the round's step is skipped (θ kept), warned and counted. ``allow_unprotected=True``
(here for the fraction, on the rule for the cohort) turns the refusals into warnings.
Byzantine clients under the plain mean (a baseline: it tolerates none), also inside wrappers
(NNM, bucketing, clipping), or under a rule that states no tolerance, run with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partialfl import arrays
from partialfl import rng as prng
from partialfl.aggregation import Mean, bind, finite_rows, to_numpy
from partialfl.aggregation.common import chain_of, check_int, inner_delta
from partialfl.aggregation.distance import at_row, trusted_client
from partialfl.aggregation.protection import (
    UnprotectedError,
    check_flag,
    check_fraction,
    cohort_checked,
    tolerated,
    warn_once,
)
from partialfl.algorithms.base import UNPROTECTED, Algorithm, ServerState, skipped_step
from partialfl.algorithms.context import WrapperContext
from partialfl.algorithms.wrapper import AlgorithmWrapper, with_aggregator
from partialfl.attacks import Attack, NoAttack
from partialfl.registry import component_field, option, register
from partialfl.tree import flatten_stacked
from partialfl.types import ClientUpdates, Params


@dataclass(frozen=True)
class ByzantineConfig:
    """Which clients are Byzantine and what they send."""

    clients: tuple[int, ...] = ()
    attack: Any = field(default_factory=NoAttack)

    def __post_init__(self) -> None:
        ids = tuple(int(c) for c in self.clients)
        if any(c < 0 for c in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"Byzantine client ids must be distinct and non-negative, got {ids}")
        object.__setattr__(self, "clients", tuple(sorted(ids)))
        if not callable(self.attack):
            raise TypeError(f"attack must be callable (honest, own, rng) -> [b, d], "
                            f"got {self.attack!r}")

    @staticmethod
    def sample(num_clients: int, fraction: float, seed: int, attack: Attack,
               exclude: int | None = None) -> ByzantineConfig:
        """⌊fraction·M⌋ Byzantine clients drawn from generator(seed, "byzantine") (among the
        clients other than ``exclude``, a client the server trusts)."""
        if not 0 <= fraction < 0.5:
            raise ValueError(f"Byzantine fraction must be in [0, 0.5), got {fraction!r}")
        b = int(np.floor(fraction * num_clients + 1e-9))
        if exclude is not None and not 0 <= exclude < num_clients:
            raise ValueError(f"the aggregator's trusted client {exclude} is outside [0, "
                             f"{num_clients})")
        pool = np.arange(num_clients) if exclude is None else np.delete(
            np.arange(num_clients), exclude)
        ids = prng.generator(seed, "byzantine").choice(pool, b, replace=False)
        return ByzantineConfig(tuple(int(i) for i in ids), attack)


class ByzantineRobust(AlgorithmWrapper):
    """Any algorithm, with an adversary between clients and server and a robust server.

    Args:
        base: the algorithm whose clients compute and whose server steps (FFGG for BR-FFGG).
        aggregator: any aggregator (see :func:`partialfl.build.make_aggregator`).
        byzantine: a :class:`ByzantineConfig` (or None: no Byzantine clients).
        allow_unprotected: run (with a warning) when the Byzantine fraction exceeds the
            aggregator's δ, instead of refusing.
        clients_per_round: the planned cohort size, checked by ``init`` (None: the first
            round's cohort is the plan).
    """

    def __init__(self, base: Algorithm, aggregator, byzantine: ByzantineConfig | None = None,
                 allow_unprotected: bool = False, clients_per_round: int | None = None):
        if isinstance(base, ByzantineRobust):
            raise TypeError("ByzantineRobust wraps a plain algorithm, not another wrapper")
        if not callable(aggregator):
            raise TypeError(f"aggregator must be callable, got {aggregator!r}")
        check_flag(allow_unprotected, "ByzantineRobust: allow_unprotected")
        if clients_per_round is not None:
            check_int(clients_per_round, "ByzantineRobust: clients_per_round", 1)
        super().__init__(base)
        self.allow_unprotected = allow_unprotected
        self.clients_per_round = clients_per_round
        self.aggregator = aggregator
        self.byzantine = byzantine or ByzantineConfig()
        self._byz = np.asarray(self.byzantine.clients, dtype=np.int64)
        if any(getattr(r, "name", None) == "monna" and getattr(r, "index", None) is not None
               for r in chain_of(aggregator)):
            raise ValueError("monna: index (a position among the rows) means nothing in a "
                             "training run, whose cohorts are sampled and rows dropped (an "
                             "attacker would hold that position in some rounds): give "
                             "trusted=<client id> instead")
        self.trusted = trusted_client(aggregator)  # MoNNA's trusted client id, if any
        if self.trusted is not None and self.trusted in self.byzantine.clients:
            raise ValueError(f"client {self.trusted} is the aggregator's trusted client and "
                             "cannot be Byzantine")
        self.name = f"br-{base.name}"
        self.fixed_extra = (*base.fixed_extra, "byz_cohort")  # the planned cohort size

    def sample_cohort(self, seed: int, round_: int, num_clients: int,
                      k: int | None) -> np.ndarray:
        """The base's cohort; with a trusted client, that client is in every cohort (in
        place of the last one drawn when the draw missed it)."""
        from partialfl.sampling import sample_cohort

        cohort = np.asarray(getattr(self.base, "sample_cohort", sample_cohort)(
            seed, round_, num_clients, k), dtype=np.int64)
        t = self.trusted
        if t is None or t in cohort or not len(cohort):
            return cohort
        if t >= num_clients:
            raise ValueError(f"the aggregator's trusted client {t} is outside [0, "
                             f"{num_clients})")
        return np.sort(np.concatenate([cohort[:-1], [t]]))

    def init(self, problem, theta0: Params) -> ServerState:
        """The base algorithm's state (after checking the Byzantine ids, their fraction
        against the aggregator's δ and the planned cohort size), with the counters."""
        if len(self._byz) and self._byz.max() >= problem.num_clients:
            raise ValueError(f"Byzantine client ids {self.byzantine.clients} outside "
                             f"[0, {problem.num_clients})")
        if self.trusted is not None and self.trusted >= problem.num_clients:
            raise ValueError(f"the aggregator's trusted client {self.trusted} is outside "
                             f"[0, {problem.num_clients})")
        if len(self._byz):
            check_fraction(self.aggregator, len(self._byz) / problem.num_clients,
                           self.allow_unprotected)
            rules = list(chain_of(self.aggregator))
            if getattr(rules[-1], "tolerated", None) is None:  # the mean, however wrapped:
                # a baseline, run but never silently
                under = ("the plain mean" if isinstance(rules[-1], Mean)
                         else f"{type(rules[-1]).__name__} (a rule that states no tolerance)")
                wrapped = ("" if len(rules) == 1 else " wrapped in " + ", ".join(
                    getattr(r, "name", type(r).__name__) for r in rules[:-1]))
                warn_once(f"{self.name}: {len(self._byz)} Byzantine clients under {under}"
                          f"{wrapped}, which tolerates none (one attacker moves θ anywhere; "
                          "wrappers do not make the mean robust); give [aggregation] a robust "
                          "rule to defend", ("byz_mean", id(self)))
        state = self.base.init(problem, theta0)
        for key in ("byz_dropped", "byz_rejected", "byz_excess", UNPROTECTED,
                    "byz_no_reference"):
            state.extra.setdefault(key, 0)
        if self.clients_per_round is not None:
            tolerated(self.aggregator, self.clients_per_round)  # refuses an unprotected plan
            state.extra["byz_cohort"] = self.clients_per_round
        return state

    # -- adversary -----------------------------------------------------------------------
    def corrupt(self, updates: ClientUpdates, ctx) -> ClientUpdates:
        """The updates as the server receives them: Byzantine rows replaced by the attack."""
        bad = np.isin(np.asarray(updates.cohort), self._byz)
        if not bad.any():
            return updates
        mat, unflatten = flatten_stacked(updates.vectors)
        arr, restore = to_numpy(mat)
        arr = np.array(arr, dtype=np.float64)
        attack = self.byzantine.attack
        if hasattr(attack, "against") and getattr(attack, "aggregator", None) is None:
            # Optimised attacks tune their scale against the round's defence (omniscient).
            attack = attack.against(bind(self.aggregator, ctx.seed, ctx.round))
        sent = attack(arr[~bad], arr[bad], prng.generator(ctx.seed, "attack", ctx.round))
        sent = np.asarray(sent, dtype=np.float64)
        if sent.shape != arr[bad].shape:
            raise ValueError(f"attack returned shape {sent.shape}, expected {arr[bad].shape}")
        arr[bad] = sent
        out = restore(arr if arrays.is_torch(mat) else arr.astype(mat.dtype, copy=False))
        return ClientUpdates(unflatten(out), updates.weights, updates.cohort,
                             updates.grad_evals, updates.metrics, updates.extra)

    # -- robust server -------------------------------------------------------------------
    def server_update(self, state: ServerState, updates: ClientUpdates, ctx) -> ServerState:
        """Algorithm 5's server: the Byzantine rows replaced by the attack, non-finite rows dropped,
        then the robust aggregate and the base algorithm's step (a step that would make θ
        non-finite is rejected)."""
        updates = self.corrupt(updates, ctx)
        cohort = np.asarray(updates.cohort)
        extra = dict(state.extra)
        byz = int(np.isin(cohort, self._byz).sum())
        mat, _ = flatten_stacked(updates.vectors)
        ok = finite_rows(mat)
        for tree in updates.extra.values():  # extras (e.g. Scaffold's Δc) must be finite too
            if tree:
                ok &= finite_rows(flatten_stacked(tree)[0])
        dropped = int((~ok).sum())
        extra["byz_dropped"] = extra.get("byz_dropped", 0) + dropped
        run, f = self._protection(int(ok.sum()), len(cohort), extra, ctx.round,
                                  int(np.isin(cohort[ok], self._byz).sum()))
        if not run:  # too few usable updates left for the planned f: θ kept
            return skipped_step(state, extra)
        if f is not None and byz > f:
            extra["byz_excess"] = extra.get("byz_excess", 0) + 1
            warn_once(f"{self.name}: round {ctx.round}: {byz} Byzantine clients among the "
                      f"k = {len(cohort)} of the cohort, more than the f = {f} the aggregator "
                      "tolerates (counted in state.extra['byz_excess'])",
                      ("byz_excess", id(self)))
        if not ok.any():
            extra["byz_rejected"] = extra.get("byz_rejected", 0) + 1
            return ServerState(state.theta, state.opt_state, state.round + 1, extra)
        kept = updates if ok.all() else updates.select(np.flatnonzero(ok))
        rule = bind(self.aggregator, ctx.seed, ctx.round)
        if self.trusted is not None:
            rows = np.flatnonzero(np.asarray(kept.cohort) == self.trusted)
            if not len(rows):  # the trusted client failed this round: no honest reference
                extra["byz_no_reference"] = extra.get("byz_no_reference", 0) + 1
                extra["byz_rejected"] = extra.get("byz_rejected", 0) + 1
                warn_once(f"{self.name}: round {ctx.round}: the trusted client {self.trusted} "
                          "sent no usable update, so the round has no honest reference and "
                          "θ is kept (counted in state.extra['byz_no_reference'])",
                          ("byz_no_reference", id(self)))
                return ServerState(state.theta, state.opt_state, state.round + 1, extra)
            rule = at_row(rule, int(rows[0]))
        server = with_aggregator(self.base, rule)
        with cohort_checked(f or 0):  # the planned f, whichever clients were lost
            new = server.server_update(ServerState(state.theta, state.opt_state, state.round,
                                                   extra), kept, ctx)
        if not _all_finite(new.theta):
            extra["byz_rejected"] = extra.get("byz_rejected", 0) + 1
            return ServerState(state.theta, state.opt_state, state.round + 1, extra)
        return new


    def _protection(self, k: int, replied: int, extra: dict, round_: int, byz_kept: int
                    ) -> tuple[bool, int | None]:
        """``(aggregate?, f)`` for the k usable (finite) updates of the ``replied`` clients. A
        cohort as planned (``clients_per_round``, else the first round's) that the rule cannot
        protect is refused. With fewer usable updates (clients failed, rows dropped) a rule
        with δ keeps the planned f, so it protects the k left whichever clients were lost
        (⌊δk⌋ alone could be 0: one attacker within δ would move θ anywhere); a rule without
        δ (CM, GM: its tolerance is its breakdown point, no plan) must tolerate the
        ``byz_kept`` Byzantine rows this simulation left among the k. Otherwise the round's
        step is skipped (θ kept), warned and counted."""
        planned = extra.setdefault("byz_cohort", replied)
        if k >= planned:
            return True, tolerated(self.aggregator, k)
        if inner_delta(self.aggregator) is None:
            with cohort_checked(0):  # its own tolerance among k, not a plan's
                f = tolerated(self.aggregator, k)
            if f is None or byz_kept <= f:
                return True, f
            return self._skip(extra, round_, k, planned, f"{byz_kept} Byzantine updates among "
                              f"them exceed the f = {f} the rule tolerates there"), f
        f_plan = tolerated(self.aggregator, planned)
        try:
            with cohort_checked(f_plan):
                return True, tolerated(self.aggregator, k)
        except UnprotectedError as e:
            return self._skip(extra, round_, k, planned, f"too few for the robust rule to "
                              f"tolerate the planned f = {f_plan}: {e}"), f_plan

    def _skip(self, extra: dict, round_: int, k: int, planned: int, why: str) -> bool:
        """Warn about a round whose step is skipped for want of protection (the caller
        counts it: :func:`~partialfl.algorithms.base.skipped_step`)."""
        warn_once(f"{self.name}: round {round_}: only {k} of the {planned} clients of the "
                  f"cohort sent a usable update, {why}; the round's step is skipped and θ kept "
                  f"(counted in state.extra['{UNPROTECTED}']; plan a larger cohort for "
                  f"slack)", (UNPROTECTED, id(self)))
        return False


def _all_finite(tree: Params) -> bool:
    for v in tree.values():
        arr, _ = to_numpy(v)
        if not np.isfinite(arr).all():
            return False
    return True


def br_ffgg(solver, lr: float, aggregator, byzantine: ByzantineConfig | None = None,
            allow_unprotected: bool = False, clients_per_round: int | None = None,
            **ffgg_kw) -> ByzantineRobust:
    """BR-FFGG (Algorithm 5): FFGG with server SGD(γ = ``lr``) and a robust aggregator
    (``allow_unprotected``, ``clients_per_round``: see :class:`ByzantineRobust`)."""
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.server import SGD

    return ByzantineRobust(FFGG(solver, SGD(lr=lr), **ffgg_kw), aggregator, byzantine,
                           allow_unprotected=allow_unprotected,
                           clients_per_round=clients_per_round)



@dataclass(frozen=True)
class ByzantineOptions:
    """Which clients are Byzantine and what they send (the ``[attack]`` block)."""

    fraction: float = option(0.0, "fraction of the clients that are Byzantine, in [0, 0.5)")
    attack: Any = component_field("attack", "none", "what they send instead of their update")

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, int | float) and 0 <= self.fraction < 0.5):
            raise ValueError(f"fraction must be in [0, 0.5), got {self.fraction!r}")


@register("wrapper", "byzantine", options=ByzantineOptions, block="byzantine")
def _byzantine(opts: ByzantineOptions, ctx: WrapperContext) -> ByzantineRobust:
    """Byzantine-robust training (Algorithm 5): ⌊fraction·M⌋ clients send the attack; the
    server drops non-finite rows and aggregates with the run's (robust) aggregation rule."""
    from partialfl.config import ConfigError

    if ctx.num_clients is None:
        raise ConfigError("attack: the number of clients must be known")
    agg = ctx.aggregator if ctx.aggregator is not None else Mean()
    byz = ByzantineConfig.sample(ctx.num_clients, opts.fraction, ctx.seed,
                                 opts.attack.build(), exclude=trusted_client(agg))
    if len(byz.clients):  # at build (a dry run says it), as init does at the run's start
        try:
            check_fraction(agg, len(byz.clients) / ctx.num_clients,
                           bool(getattr(agg, "allow_unprotected", False)))
        except ValueError as e:
            raise ConfigError(f"attack: {e}") from None
    return ByzantineRobust(ctx.base, agg, byz, clients_per_round=ctx.clients_per_round,
                           allow_unprotected=bool(getattr(agg, "allow_unprotected", False)))
