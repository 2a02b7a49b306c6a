"""Builders of the Flower app: the run configuration (:mod:`partialfl.flower.config`) turned
into the same problem, server optimizer, aggregator and algorithm objects as the in-process
simulator (so Flower and the simulator run the same code)."""

from __future__ import annotations

from partialfl.config import ConfigError as CoreConfigError
from partialfl.flower.config import ConfigError, FlowerConfig, build_aggregator, w_init
from partialfl.flower.models import build_model_algorithm, build_model_problem


# -- builders: the same objects as the in-process simulator ---------------------------
def closed_form_config(cfg: FlowerConfig):
    """The least-squares part of the run mapped onto partialfl's own experiment config
    (:class:`partialfl.experiments.closed_form.ClosedFormConfig`, what ``partialfl run``
    reads from ``configs/*.toml``), validated by it."""
    from partialfl.config import from_dict
    from partialfl.experiments.closed_form import ClosedFormConfig

    name = {"ffgg": "ffgg", "br-ffgg": "ffgg", "fedavg": "local-gd"}.get(cfg.algorithm, "ffgg")
    data = {
        "problem": {"kind": "least-squares", "num_clients": cfg.ls_clients, "n": cfg.ls_n,
                    "d_theta": cfg.ls_d_theta, "d_w": cfg.ls_d_w, "seed": cfg.ls_seed},
        "algorithm": {"name": name, "solver": cfg.solver, "tau": cfg.local_steps,
                      "local_lr": cfg.local_lr or None, "init": w_init(cfg)},
        "server": {"optimizer": cfg.server_opt, "momentum": cfg.server_momentum,
                   "lr": "1/L" if cfg.server_lr == "auto" else cfg.server_lr},
        "run": {"rounds": cfg.num_rounds, "clients_per_round": cfg.clients_per_round or None,
                "seed": cfg.seed},
    }
    try:
        return from_dict(ClosedFormConfig, data)
    except CoreConfigError as e:
        raise ConfigError(f"least-squares run config: {e}") from None


def build_problem(cfg: FlowerConfig):
    """The federated problem of the run (all of it; a node only serves its partition).
    Least squares is built by partialfl's experiment builder (cached; FedAvg, which shares
    w across clients, gets the standard basis)."""
    if cfg.problem == "least-squares":
        from partialfl.experiments.closed_form import build_problem as build_cf
        from partialfl.experiments.closed_form import problem_config_for

        return build_cf(problem_config_for(closed_form_config(cfg)))

    return build_model_problem(cfg)


def build_server_opt(cfg: FlowerConfig, problem=None):
    """The server optimizer (SGD or Adam) with its schedule, built by
    :func:`partialfl.build.build_server_opt` from the run config's server keys;
    ``server-lr = 'auto'`` is 1/L (Theorem 1) for the least-squares FFGG family and 1
    otherwise (FedAvg: plain averaging)."""
    from partialfl.build import build_server_opt as build_opt
    from partialfl.spec import ServerConfig

    L = getattr(problem, "L", None)
    if isinstance(cfg.server_lr, str) and cfg.server_lr != "auto" and L is None:
        raise ConfigError(f"run-config key 'server-lr': {cfg.server_lr!r} needs a problem with "
                          "a known constant L (least squares); give a number")
    auto = 1.0 / L if (L is not None and cfg.algorithm in ("ffgg", "br-ffgg")) else 1.0
    try:
        server = ServerConfig(optimizer=cfg.server_opt, lr=cfg.server_lr,
                              momentum=cfg.server_momentum, schedule=cfg.schedule,
                              warmup=cfg.warmup_rounds, halve_every=cfg.halve_every,
                              clip_norm=cfg.server_clip or None)
        return build_opt(server, cfg.num_rounds, L, auto)
    except CoreConfigError as e:
        raise ConfigError(f"run config: {e}") from None


def build_byzantine(cfg: FlowerConfig, num_clients: int):
    """Which clients are Byzantine (``byzantine-fraction`` of them, drawn from the run seed)
    and the attack their updates are replaced with (:class:`ByzantineConfig`)."""
    from partialfl.algorithms.byzantine import ByzantineConfig
    from partialfl.build import make_attack

    try:
        attack = make_attack(cfg.attack)
    except ValueError as e:
        raise ConfigError(f"run-config key 'attack': {e}") from None
    return ByzantineConfig.sample(num_clients, cfg.byzantine_fraction, cfg.seed, attack)


def build_algorithm(cfg: FlowerConfig, problem, aggregator=None, num_clients: int | None = None):
    """The algorithm object whose ``client_update`` runs on the SuperNodes and whose
    ``server_update`` runs in the ServerApp — the same object the in-process simulator runs.

    FFGG / FedAvg / Local FFGG with mean aggregation are the plain algorithms; any other
    aggregator, or Byzantine clients, wraps them in
    :class:`~partialfl.algorithms.byzantine.ByzantineRobust` (BR-FFGG = robust FFGG, the
    paper's Algorithm 5). ``aggregator`` (a callable ``(vectors [k, d], weights [k]) -> [d]``)
    replaces the configured rule (programmatic use); ``num_clients`` is needed when
    ``problem`` is None (a server that holds no data).
    """
    robust = (aggregator is not None or cfg.aggregator != "mean" or cfg.bucket_size > 1
              or cfg.nnm or cfg.byzantine_fraction > 0 or cfg.algorithm == "br-ffgg")
    if robust and cfg.algorithm == "ffgg" and aggregator is None and cfg.aggregator != "mean":
        raise ConfigError(f"run-config key 'aggregator': {cfg.aggregator!r} is a robust rule; "
                          "robust FFGG is algorithm 'br-ffgg' (Algorithm 5)")
    # a train spec's algorithm keeps its own aggregation (its method.weighting)
    base_agg = None if robust or cfg.problem == "train" else build_aggregator(cfg)
    if cfg.problem != "least-squares":

        base = build_model_algorithm(cfg, base_agg)
    else:
        base = _least_squares_algorithm(cfg, build_server_opt(cfg, problem), base_agg)
    if not robust:
        return base
    from partialfl.algorithms.byzantine import ByzantineRobust

    M = problem.num_clients if problem is not None else num_clients
    if M is None:
        raise ValueError("build_algorithm needs problem or num_clients")
    agg = aggregator if aggregator is not None else build_aggregator(cfg)
    byz = build_byzantine(cfg, M) if cfg.byzantine_fraction > 0 else None
    return ByzantineRobust(base, agg, byz)


def _least_squares_algorithm(cfg: FlowerConfig, opt, agg):
    """FFGG (Algorithm 1) or FedAvg = Local GD from :data:`partialfl.build.REGISTRY`, with the
    run's server optimizer, aggregator and weighting."""
    from partialfl.build import lookup

    if cfg.algorithm not in ("ffgg", "br-ffgg", "fedavg"):
        raise ConfigError(
            "run-config key 'algorithm': 'local-ffgg' (Algorithm 4) is implemented for model "
            "problems (problem 'femnist'); allowed for least squares: ffgg, br-ffgg, fedavg"
        )
    a = closed_form_config(cfg).algorithm
    alg = lookup("closed-form-algorithm", a.name)(a, opt)
    if agg is not None:
        alg.aggregator = agg
    if hasattr(alg, "weighting"):
        alg.weighting = cfg.weighting
    return alg
