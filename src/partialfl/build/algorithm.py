"""The algorithm of one stage: the entry of ``[method]`` built with the stage's client and
server optimizers and the run's aggregation rule, inside the run's wrappers."""


from __future__ import annotations

from partialfl.config import ConfigError
from partialfl.spec import RunSpec, ServerConfig, StageConfig, parse_lr


# ----------------------------------------------------------------------------- optimizers
def build_server_opt(server: ServerConfig, rounds: int, L: float | None = None,
                     auto_lr: float = 1.0):
    """The server optimizer of ``server`` over ``rounds`` rounds: the schedule, ``lr``
    resolved (``"auto"`` → ``auto_lr``; ``"c/L"`` → c/L), optional clipping."""
    from partialfl.server import Clipped, OptimizerContext, ScheduleContext

    try:
        sched = server.schedule.build(ScheduleContext(total=max(rounds, 1)))
    except ValueError as e:
        raise ConfigError(f"server.schedule: {e}") from None
    lr = auto_lr if server.lr == "auto" else parse_lr(server.lr, L)
    opt = server.optimizer.build(OptimizerContext(lr, sched))
    return Clipped(opt, server.clip_norm) if server.clip_norm else opt


def build_aggregator(spec: RunSpec, seed: int | None = None):
    """The server's aggregation rule (None: the algorithm's default, the mean)."""
    if spec.aggregation is None:
        return None
    from partialfl.aggregation.compose import AggregatorContext

    try:
        return spec.aggregation.build(AggregatorContext(seed=spec.seed if seed is None
                                                        else seed))
    except ValueError as e:
        raise ConfigError(f"aggregation: {e}") from None


# ----------------------------------------------------------------------------- algorithms
def build_algorithm(spec: RunSpec, stage: StageConfig, *, method=None, problem=None,
                    num_clients: int | None = None, wrap: bool = True):
    """The algorithm of ``method`` (default ``spec.method``) for one stage: its entry built
    with the stage's client optimizer and server optimizer, the run's aggregation rule,
    weighting and w initialisation; then (``wrap``) the run's wrappers, innermost first:
    fault injection, Byzantine clients (with the robust aggregation rule), differential
    privacy. ``problem`` (closed forms) resolves ``lr = "auto"`` / ``"c/L"`` against its
    smoothness constant L."""
    from partialfl.algorithms.context import AlgorithmContext

    method = method or spec.method
    e = method.entry
    L = getattr(problem, "L", None)
    auto = 1.0 / L if (L is not None and e.trait("sends") == "gradient") else 1.0
    opt = build_server_opt(stage.server, stage.rounds, L, auto)
    agg = _weighting(spec, method, build_aggregator(spec))
    n = num_clients if num_clients is not None else getattr(problem, "num_clients", None)
    k = stage.clients_per_round  # a model run draws min(k, M) clients (pipeline.stages)
    k = min(k, n) if k is not None and n is not None else k
    check_protected(agg, server_cohort(spec, k or n),
                    "" if spec.asynchronous is None else
                    " (an asynchronous step aggregates the updates that arrived: 1 under "
                    "fedasync, the buffer K under fedbuff)")
    ctx = AlgorithmContext(stage.client.build(), opt, agg, method.weighting, method.w_init,
                           e.name)
    try:
        alg = e.create(method.options, ctx)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"method: {err}") from None
    if wrap:
        alg = wrap_algorithm(spec, alg, n, k, agg, stage.rounds)
    return alg


def _weighting(spec: RunSpec, method, agg):
    """The aggregation rule that applies ``method.weighting``: the default mean weights by
    the clients' example counts under ``"examples"``; an explicit rule that drops the
    weights (its ``weighted`` is False, or behind bucketing, which averages buckets
    uniformly) is refused then, rather than the weighting silently doing nothing."""
    if method.weighting != "examples":
        return agg
    from partialfl.aggregation import Mean
    from partialfl.aggregation.wrappers import Bucketing

    if agg is None:
        return Mean(weighted=True)
    rule = agg
    while hasattr(rule, "inner") and not isinstance(rule, Bucketing):
        rule = rule.inner
    # a rule says whether it weighs (``weighted``); a researcher's rule that does not say is
    # taken at its word that it uses the weights it is given
    if isinstance(rule, Bucketing) or getattr(rule, "weighted", True) is False:
        raise ConfigError(f"method.weighting = 'examples': aggregation "
                          f"{spec.aggregation.name!r} does not weight the clients' updates; "
                          "allowed: weighted = true in [aggregation] (mean, gm; without "
                          "bucketing), or method.weighting = 'uniform'")
    return agg


def server_cohort(spec: RunSpec, k: int | None) -> int | None:
    """The updates one server step aggregates: the round's k clients, or under
    ``[asynchronous]`` the rule's (FedAsync: 1, FedBuff: its buffer K) — a robust rule that
    saw one arriving update per step once ran unprotected at every step, with a warning."""
    if spec.asynchronous is None:
        return k
    return int(spec.asynchronous.rule.get("buffer", 1))


def check_protected(agg, k: int | None, where: str = "") -> None:
    """Refuse, when the spec is built (so ``--dry-run`` says it), a robust rule that would
    tolerate no Byzantine input, or break its own bound, at the stage's planned cohort of k
    clients (:func:`partialfl.aggregation.protection.tolerated`; the rule checks again on
    every call, with the cohort as it arrives)."""
    from partialfl.aggregation.protection import UnprotectedError, tolerated

    if agg is None or not k:
        return
    try:
        tolerated(agg, int(k))
    except UnprotectedError as err:
        raise ConfigError(f"aggregation{where}: {err}") from None


def stage_algorithm(spec: RunSpec, stage: str, *, problem=None, num_clients: int | None = None):
    """The algorithm of one federated stage of a model run, with its wrappers: ``pretrain``
    is FedAvg on every parameter with ``[pretrain]``'s optimizers, ``personalize`` the
    spec's method with ``[personalize]``'s (what the pipeline's stages build; a Flower
    ServerApp, which holds no data, builds it from this and the number of clients)."""
    from partialfl.spec import MethodConfig

    if stage == "pretrain":
        return build_algorithm(spec, spec.pretrain, method=MethodConfig(algorithm="fedavg"),
                               problem=problem, num_clients=num_clients)
    return build_algorithm(spec, spec.personalize, problem=problem, num_clients=num_clients)


def wrap_algorithm(spec: RunSpec, alg, num_clients: int | None,
                   clients_per_round: int | None, aggregator=None, rounds: int | None = None):
    """``alg`` inside the run's wrappers (faults, attack, privacy), innermost first. A rule
    that trusts a client (MoNNA's ``trusted``) gets the robust server even without an
    ``[attack]`` block (no simulated attacker: a deployment's attackers are real), since only
    that server puts the client in every cohort and finds its row."""
    from partialfl.aggregation.distance import trusted_client
    from partialfl.algorithms.context import WrapperContext

    attack = spec.attack
    if attack is None and trusted_client(aggregator) is not None:
        from partialfl.registry import component

        attack = component("wrapper", "byzantine")
    for block in (spec.faults, attack, spec.privacy):
        if block is None:
            continue
        # the Byzantine wrapper plans f on what one server step aggregates (an asynchronous
        # step: FedBuff's buffer K, not the rounds' cohort it would count as lost clients)
        k = server_cohort(spec, clients_per_round) if block is attack else clients_per_round
        ctx = WrapperContext(alg, spec.seed, num_clients, k, aggregator, rounds)
        try:
            alg = block.build(ctx)
        except ValueError as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"{block.entry.trait('block')}: {err}") from None
    return alg


def async_rule(spec: RunSpec, alg):
    """``alg`` inside the asynchronous rule of ``spec.asynchronous`` (FedAsync, FedBuff)."""
    from partialfl.algorithms.context import WrapperContext

    ctx = WrapperContext(alg, spec.seed, rounds=spec.personalize.rounds)
    try:
        return spec.asynchronous.rule.build(ctx)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"asynchronous.rule: {err}") from None
