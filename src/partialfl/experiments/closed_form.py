"""Experiments on closed-form problems (least squares, GLM): config → problem, algorithm, run.

A config file has the tables ``[problem]``, ``[algorithm]``, ``[server]``, ``[run]`` (see
``configs/`` and :class:`ClosedFormConfig`); ``partialfl run CONFIG`` executes one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from partialfl.algorithms import FFGG, L2GD, LocalGD, Scaffold
from partialfl.config import ConfigError, check_choice, from_dict, to_dict
from partialfl.local import make_solver
from partialfl.local.solvers import INITS, SOLVERS
from partialfl.metrics import closed_form_metrics
from partialfl.problems import GeneralizedLinearProblem, GLMSpec, LeastSquaresProblem
from partialfl.problems.least_squares import LeastSquaresSpec
from partialfl.runtime import JsonlLogger, make_backend, run_rounds
from partialfl.server import OPTIMIZERS, make_optimizer

PROBLEMS = ("least-squares", "glm")
METHODS = ("ffgg", "local-gd", "scaffold", "l2gd")


_choice = check_choice


@dataclass(frozen=True)
class ProblemConfig:
    kind: str = "least-squares"
    num_clients: int = 32
    n: int = 10_000
    d_theta: int = 100
    d_w: int = 50
    seed: int = 0
    basis: str = "eigen"          # least squares: personal coordinates (see LeastSquaresProblem)
    psi: str = "logcosh"          # glm only
    ridge: float = 1e-3           # glm only
    huber_delta: float = 1.0      # glm only

    def __post_init__(self) -> None:
        _choice("problem.kind", self.kind, PROBLEMS)
        _choice("problem.basis", self.basis, ("eigen", "standard"))


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "ffgg"
    solver: str = "cg"            # ffgg: gd | cg | exact
    tau: int = 40                 # local steps (fine-tuning steps for FFGG)
    local_lr: float | None = None  # default: 1/L of the local problem
    init: str = "zero"            # ffgg: fresh w each round from zero or random
    lam: float = 0.1              # l2gd
    p: float | None = None        # l2gd: communication probability (default 1/tau)

    def __post_init__(self) -> None:
        _choice("algorithm.name", self.name, METHODS)
        _choice("algorithm.solver", self.solver, SOLVERS)
        _choice("algorithm.init", self.init, INITS)
        if self.tau < 1:
            raise ConfigError(f"algorithm.tau must be >= 1, got {self.tau}")


@dataclass(frozen=True)
class ServerConfig:
    optimizer: str = "sgd"
    lr: float | str = "1/L"       # a number, or "c/L" with L the problem's constant
    momentum: float = 0.0

    def __post_init__(self) -> None:
        _choice("server.optimizer", self.optimizer, OPTIMIZERS)
        parse_lr(self.lr, 1.0)


@dataclass(frozen=True)
class RunConfig:
    rounds: int = 3000
    clients_per_round: int | None = None
    seed: int = 0
    eval_every: int = 10
    backend: str = "batched"

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ConfigError(f"run.rounds must be >= 0, got {self.rounds}")
        if self.eval_every < 1:
            raise ConfigError(f"run.eval_every must be >= 1, got {self.eval_every}")
        _choice("run.backend", self.backend, ("batched", "sequential"))


@dataclass(frozen=True)
class ClosedFormConfig:
    problem: ProblemConfig = field(default_factory=ProblemConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    name: str = "run"


def parse_lr(lr: float | str, L: float) -> float:
    """A stepsize given as a number or as ``"c/L"`` (e.g. ``"1/L"``, ``"0.5/L"``)."""
    if isinstance(lr, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*/\s*L\s*", lr)
        if not m:
            raise ConfigError(f"server.lr: {lr!r} is neither a number nor of the form 'c/L'")
        value = float(m.group(1)) / L
    else:
        value = float(lr)
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"server.lr must be positive, got {lr!r}")
    return value


_CACHE: dict = {}


def build_problem(cfg: ProblemConfig):
    """The problem (the two most recent are cached: building least squares reads n×d data)."""
    if cfg not in _CACHE:
        try:
            if cfg.kind == "least-squares":
                spec = LeastSquaresSpec(cfg.num_clients, cfg.n, cfg.d_theta, cfg.d_w, cfg.seed)
                problem = LeastSquaresProblem(spec, basis=cfg.basis)
            else:
                spec = GLMSpec(cfg.num_clients, cfg.n, cfg.d_theta, cfg.d_w, cfg.psi,
                               cfg.huber_delta, cfg.ridge, seed=cfg.seed)
                problem = GeneralizedLinearProblem(spec)
        except ValueError as e:
            raise ConfigError(f"problem: {e}") from e
        while len(_CACHE) >= 2:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[cfg] = problem
    return _CACHE[cfg]


def problem_config_for(cfg: ClosedFormConfig) -> ProblemConfig:
    """Non-personalized baselines share w across clients, so they need the standard basis."""
    if cfg.algorithm.name != "ffgg" and cfg.problem.basis != "standard":
        return dataclasses.replace(cfg.problem, basis="standard")
    return cfg.problem


def build_algorithm(cfg: ClosedFormConfig, problem):
    a = cfg.algorithm
    if a.name == "ffgg":
        opt = make_optimizer(cfg.server.optimizer, parse_lr(cfg.server.lr, problem.L),
                             **({"momentum": cfg.server.momentum} if cfg.server.momentum else {}))
        return FFGG(make_solver(a.solver, a.tau, a.local_lr, a.init), opt)
    if a.name == "local-gd":
        return LocalGD(a.tau, a.local_lr)
    if a.name == "scaffold":
        return Scaffold(a.tau, a.local_lr)
    return L2GD(a.tau, lam=a.lam, p=a.p)


def load_closed_form(data: dict, where: str = "") -> ClosedFormConfig:
    return from_dict(ClosedFormConfig, data, where)


def run_closed_form(cfg: ClosedFormConfig, out: Path | None = None, progress: bool | str = False):
    """Run one configuration; metrics go to ``out/<name>.jsonl`` when ``out`` is given."""
    problem = build_problem(problem_config_for(cfg))
    algorithm = build_algorithm(cfg, problem)
    if cfg.run.clients_per_round is not None and not (
        1 <= cfg.run.clients_per_round <= problem.num_clients
    ):
        raise ConfigError(
            f"run.clients_per_round={cfg.run.clients_per_round} but the problem has "
            f"{problem.num_clients} clients"
        )
    logger = None
    if out is not None:
        logger = JsonlLogger(Path(out) / f"{cfg.name}.jsonl", method=cfg.name)
    try:
        return run_rounds(
            problem, algorithm, cfg.run.rounds, clients_per_round=cfg.run.clients_per_round,
            seed=cfg.run.seed, backend=make_backend(cfg.run.backend),
            evaluate=closed_form_metrics, eval_every=cfg.run.eval_every, logger=logger,
            progress=progress,
        )
    finally:
        if logger is not None:
            logger.close()


__all__ = ["ClosedFormConfig", "build_algorithm", "build_problem", "load_closed_form",
           "run_closed_form", "to_dict"]
