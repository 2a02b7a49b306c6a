"""Experiments on closed-form problems (least squares, GLM): config → problem, algorithm, run.

A config file has the tables ``[problem]``, ``[algorithm]``, ``[server]``, ``[run]`` (see
``configs/`` and :class:`ClosedFormConfig`); ``partialfl run CONFIG`` executes one.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from partialfl.algorithms import FFGG, L2GD, LocalGD, Scaffold
from partialfl.config import ConfigError, check_choice, from_dict, to_dict
from partialfl.experiments.report import REL_DIST2, markdown_table, plot_curves
from partialfl.local import make_solver
from partialfl.local.solvers import INITS, SOLVERS
from partialfl.metrics import closed_form_metrics
from partialfl.problems import GeneralizedLinearProblem, GLMSpec, LeastSquaresProblem
from partialfl.problems.least_squares import LeastSquaresSpec
from partialfl.runtime import JsonlLogger, make_backend, run_rounds
from partialfl.server import OPTIMIZERS, make_optimizer

PROBLEMS = ("least-squares", "glm")
#: the largest closed-form problem a config may ask for (data and per-client matrices)
MAX_PROBLEM_BYTES = 8 * 2**30
#: what a run's name (its output file name) may look like
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
METHODS = ("ffgg", "local-gd", "scaffold", "l2gd")


_choice = check_choice


@dataclass(frozen=True)
class ProblemConfig:
    """``[problem]``: which closed-form problem (``least-squares`` or ``glm``) and its sizes."""

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
        for key in ("num_clients", "n", "d_theta", "d_w"):
            if getattr(self, key) < 1:
                raise ConfigError(f"problem.{key}: {key} must be a positive integer, got "
                                  f"{getattr(self, key)}")
        d = self.d_theta + self.d_w
        need = 8 * self.num_clients * (self.n * d + d * d)
        if need > MAX_PROBLEM_BYTES:
            raise ConfigError(
                f"problem: num_clients={self.num_clients}, n={self.n}, d_theta+d_w={d} need "
                f"about {need / 2**30:.3g} GiB of data; the limit is "
                f"{MAX_PROBLEM_BYTES / 2**30:.3g} GiB (partialfl.experiments.closed_form."
                "MAX_PROBLEM_BYTES)")


@dataclass(frozen=True)
class AlgorithmConfig:
    """``[algorithm]``: the method, its local solver or steps τ, local stepsize and options."""

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
        for key in ("local_lr", "p"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise ConfigError(f"algorithm.{key} must be > 0, got {v}")


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: the server optimizer, its stepsize (a number or ``"c/L"``) and momentum."""

    optimizer: str = "sgd"
    lr: float | str = "1/L"       # a number, or "c/L" with L the problem's constant
    momentum: float = 0.0

    def __post_init__(self) -> None:
        _choice("server.optimizer", self.optimizer, OPTIMIZERS)
        parse_lr(self.lr, 1.0)


@dataclass(frozen=True)
class RunConfig:
    """``[run]``: rounds, clients per round (all by default), seed, evaluation interval, backend."""

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
        _choice("run.backend", self.backend, ("batched", "sequential", "processes"))


@dataclass(frozen=True)
class ClosedFormConfig:
    """One closed-form experiment: the four tables and the run's name."""

    problem: ProblemConfig = field(default_factory=ProblemConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    name: str = "run"

    def __post_init__(self) -> None:
        if not re.fullmatch(NAME_PATTERN, self.name):
            raise ConfigError(f"name: {self.name!r} is not allowed; a run's name is a plain "
                              "file name (letters, digits, '.', '_', '-'; no folders)")


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


def build_problem(cfg: ProblemConfig, progress: bool = False):
    """The problem (the two most recent are cached: building least squares reads n×d data;
    ``progress`` shows a bar over its clients)."""
    if cfg not in _CACHE:
        try:
            if cfg.kind == "least-squares":
                spec = LeastSquaresSpec(cfg.num_clients, cfg.n, cfg.d_theta, cfg.d_w, cfg.seed)
                problem = LeastSquaresProblem(spec, basis=cfg.basis, progress=progress and (
                    f"building the problem ({cfg.num_clients} clients × {cfg.n:,} rows)"))
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
    """The algorithm of ``cfg.algorithm`` (FFGG with its fine-tuner and server optimizer, or a
    baseline) with stepsizes resolved against ``problem``'s constants."""
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
    """A validated :class:`ClosedFormConfig` from a plain dict (a parsed TOML file)."""
    return from_dict(ClosedFormConfig, data, where)


def run_closed_form(cfg: ClosedFormConfig, out: Path | None = None, progress: bool | str = False):
    """Run one configuration; metrics go to ``out/<name>.jsonl`` when ``out`` is given."""
    problem = build_problem(problem_config_for(cfg), progress=bool(progress))
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


def _first_round_below(history, key: str, thr: float):
    for h in history:
        if h.get(key, math.inf) <= thr:
            return h["round"]
    return None


def summary_markdown(rows: list[dict], title: str, notes: list[str]) -> str:
    """A markdown summary: ``# title``, one table row per run (``rows``: dicts with
    ``method``, ``tau``, ``history`` and ``seconds``) with its final metrics, then ``notes``."""
    table = []
    for r in rows:
        last = r["history"][-1]
        hit = _first_round_below(r["history"], "rel_dist2", 1e-8)
        table.append([
            r["method"], r["tau"], last["round"], f"{last['rel_dist2']:.3e}",
            f"{last['F_norm2']:.3e}", f"{last['loss_gap']:.6g}", last["local_grads"],
            "—" if hit is None else hit, f"{r['seconds']:.2f}",
        ])
    header = ["method", "τ", "rounds", REL_DIST2.replace(" ", ""), "‖F(θʳ)‖²", "loss gap",
              "local grads/client", "rounds to 1e-8", "seconds"]
    return "\n".join([f"# {title}", "", markdown_table(header, table), "", *notes, ""])


def write_report(cfg: ClosedFormConfig, history: list[dict], seconds: float, out: Path) -> Path:
    """What ``partialfl run`` writes beside ``<name>.jsonl``, like a reproduction:
    ``<name>.png`` (relative distance to θ* and ‖F‖² vs rounds) and ``summary.md`` (the
    configuration and the final metrics); returns the summary's path."""
    out = Path(out)
    name = cfg.name
    plot_curves(out / f"{name}.png", [{name: history}, {name: history}],
                [REL_DIST2, "‖F(θʳ)‖²"], x="round", y="rel_dist2", ylabel="",
                y_per_panel=["rel_dist2", "F_norm2"])
    p, a = cfg.problem, cfg.algorithm
    notes = [
        f"Problem: {p.kind}, {p.num_clients} clients, n = {p.n:,} rows each, d_θ = "
        f"{p.d_theta}, d_w = {p.d_w}, data seed {p.seed}. Algorithm: {a.name}"
        + (f" ({a.solver} fine-tuner, init {a.init})" if a.name == "ffgg" else "")
        + f", τ = {a.tau}; server {cfg.server.optimizer} lr {cfg.server.lr}; "
        f"{cfg.run.rounds} rounds, "
        + (f"{cfg.run.clients_per_round} clients per round"
           if cfg.run.clients_per_round else "all clients every round")
        + f", run seed {cfg.run.seed}.",
        f"Metrics every {cfg.run.eval_every} rounds: `{name}.jsonl`; plot: `{name}.png`. "
        "Loss gap: (1/M)Σ f_m(θ, w_m) − min_{θ,w} f_m with the deployed w_m.",
        "",
        "Configuration (as run):",
        "",
        "```toml",
        *_toml_lines(to_dict(cfg)),
        "```",
    ]
    path = out / "summary.md"
    _write_text(path, summary_markdown(
        [{"method": a.name, "tau": a.tau, "history": history, "seconds": seconds}],
        f"{name}: {a.name} on {p.kind}", notes))
    return path


def _toml_lines(d: dict) -> list[str]:
    def val(v) -> str:
        if v is None:
            return '""  # default'
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'"{v}"'
        return repr(v)

    lines = [f"{k} = {val(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for k, v in d.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]", *(f"{kk} = {val(vv)}" for kk, vv in v.items()
                                     if vv is not None)]
    return lines


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run_and_report(cfg: ClosedFormConfig, out: Path, progress: bool | str = False):
    """``partialfl run``: :func:`run_closed_form` into ``out``, then :func:`write_report`;
    returns ``(result, summary path)``."""
    t0 = time.perf_counter()
    res = run_closed_form(cfg, out, progress=progress)
    return res, write_report(cfg, res.history, time.perf_counter() - t0, out)


__all__ = ["ClosedFormConfig", "build_algorithm", "build_problem", "load_closed_form",
           "run_and_report", "run_closed_form", "summary_markdown", "to_dict", "write_report"]
