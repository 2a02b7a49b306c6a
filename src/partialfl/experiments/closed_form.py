"""Experiments on closed-form problems (least squares, GLM): config → problem, algorithm, run.

A config file has the tables ``[problem]``, ``[algorithm]``, ``[server]``, ``[run]`` (see
``configs/`` and :class:`ClosedFormConfig`); ``partialfl run CONFIG`` executes one.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from partialfl import io as pio
from partialfl.build import (
    build,
    build_backend,
    build_closed_form_algorithm,
    build_problem,
    problem_config_for,
)
from partialfl.config import from_dict, to_dict
from partialfl.experiments.report import REL_DIST2, markdown_table, plot_curves
from partialfl.metrics import closed_form_metrics
from partialfl.runtime import JsonlLogger, run_rounds
from partialfl.spec import (
    MAX_PROBLEM_BYTES,
    NAME_PATTERN,
    AlgorithmConfig,
    ClosedFormConfig,
    ProblemConfig,
    RunConfig,
    ServerConfig,
    parse_lr,
)


def build_algorithm(cfg: ClosedFormConfig, problem):
    """The algorithm of ``cfg.algorithm`` (FFGG with its fine-tuner, or a baseline) with its
    ``[server]`` optimizer, stepsizes resolved against ``problem``'s constants (see
    :mod:`partialfl.build`)."""
    return build_closed_form_algorithm(cfg, problem)


def load_closed_form(data: dict, where: str = "") -> ClosedFormConfig:
    """A validated :class:`ClosedFormConfig` from a plain dict (a parsed TOML file)."""
    return from_dict(ClosedFormConfig, data, where)


def run_closed_form(cfg: ClosedFormConfig, out: Path | None = None, progress: bool | str = False):
    """Run one configuration; metrics go to ``out/<name>.jsonl`` when ``out`` is given."""
    built = build(cfg, progress=bool(progress))
    problem, algorithm = built.problem, built.algorithm
    logger = None
    if out is not None:
        logger = JsonlLogger(Path(out) / f"{cfg.name}.jsonl", method=cfg.name)
    try:
        return run_rounds(
            problem, algorithm, cfg.run.rounds, clients_per_round=cfg.run.clients_per_round,
            seed=cfg.run.seed, backend=build_backend(cfg.run.backend),
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
    ``method``, ``tau``, ``history`` and ``seconds``) with its final metrics, then ``notes``;
    rows of several seeds (``seed``) get a seed column."""
    seeded = len({r.get("seed") for r in rows}) > 1
    table = []
    for r in rows:
        last = r["history"][-1]
        hit = _first_round_below(r["history"], "rel_dist2", 1e-8)
        table.append([
            r["method"], r["tau"], *([r["seed"]] if seeded else []), last["round"],
            f"{last['rel_dist2']:.3e}",
            f"{last['F_norm2']:.3e}", f"{last['loss_gap']:.6g}", last["grad_evals"],
            "—" if hit is None else hit, f"{r['seconds']:.2f}",
        ])
    header = ["method", "τ", *(["seed"] if seeded else []), "rounds", REL_DIST2.replace(" ", ""),
              "‖F(θʳ)‖²", "loss gap",
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
    pio.write_text(path, summary_markdown(
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


def run_and_report(cfg: ClosedFormConfig, out: Path, progress: bool | str = False):
    """``partialfl run``: :func:`run_closed_form` into ``out``, then :func:`write_report`;
    returns ``(result, summary path)``."""
    t0 = time.perf_counter()
    res = run_closed_form(cfg, out, progress=progress)
    return res, write_report(cfg, res.history, time.perf_counter() - t0, out)


__all__ = ["MAX_PROBLEM_BYTES", "NAME_PATTERN", "AlgorithmConfig", "ClosedFormConfig",
           "ProblemConfig", "RunConfig", "ServerConfig",
           "build_algorithm", "build_problem", "load_closed_form", "parse_lr",
           "problem_config_for", "run_and_report", "run_closed_form", "summary_markdown",
           "to_dict", "write_report"]
