"""Experiments on closed-form problems (least squares, GLM): config → problem, algorithm, run.

A config file has the tables ``[problem]``, ``[algorithm]``, ``[server]``, ``[run]`` (see
``configs/`` and :class:`ClosedFormConfig`); ``partialfl run CONFIG`` executes one.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from partialfl import io as pio
from partialfl.build import Run, build
from partialfl.config import ConfigError, from_dict, toml_text
from partialfl.metrics import closed_form_metrics
from partialfl.pipeline.report import REL_DIST2, markdown_table, plot_curves
from partialfl.runtime import JsonlLogger, run_rounds
from partialfl.runtime.asynchronous import run_async
from partialfl.spec import RunSpec


def load_closed_form(data: dict, where: str = "") -> RunSpec:
    """A validated closed-form :class:`~partialfl.spec.RunSpec` from a plain dict (a parsed
    TOML file)."""
    spec = from_dict(RunSpec, data, where)
    if not spec.closed_form:
        from partialfl.config import ConfigError

        raise ConfigError("problem: give a closed-form [problem] (least-squares, glm); a "
                          "model run is started with `partialfl train`")
    return spec


def compute_time(cfg: RunSpec, num_clients: int):
    """The simulated duration model of ``cfg.asynchronous`` (see
    :class:`~partialfl.spec.AsyncSpec`)."""
    from partialfl.runtime.asynchronous import ComputeTimeModel, Distribution, device_speeds

    a = cfg.asynchronous
    try:
        speed = (device_speeds(num_clients, Distribution("log-normal", 1.0, a.speed_sigma),
                               cfg.seed) if a.speed_sigma > 0 else None)
        return ComputeTimeModel(a.duration.build(), speed=speed)
    except ValueError as e:
        raise ConfigError(f"asynchronous: {e}") from None


def run_closed_form(cfg: RunSpec, out: Path | None = None, progress: bool | str = False,
                    built: Run | None = None):
    """Run one closed-form spec (its one stage, ``[personalize]``); metrics go to
    ``out/<name>.jsonl`` when ``out`` is given."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(cfg.threads)
    built = built or build(cfg, progress=bool(progress))
    problem, algorithm = built.problem, built.algorithm
    stage = cfg.personalize
    logger = None
    if out is not None:
        logger = JsonlLogger(Path(out) / f"{cfg.name}.jsonl", method=cfg.name)
    every = stage.eval_every or max(1, stage.rounds)
    try:
        if cfg.asynchronous is not None:
            return run_async(problem, algorithm, steps=stage.rounds,
                             concurrency=cfg.asynchronous.concurrency,
                             compute_time=compute_time(cfg, problem.num_clients),
                             seed=cfg.seed, evaluate=closed_form_metrics, eval_every=every,
                             logger=logger, progress=progress,
                             max_failure_fraction=cfg.max_failure_fraction)
        return run_rounds(
            problem, algorithm, stage.rounds, clients_per_round=stage.clients_per_round,
            seed=cfg.seed, backend=cfg.backend.build(), evaluate=closed_form_metrics,
            eval_every=every, logger=logger, progress=progress,
            max_failure_fraction=cfg.max_failure_fraction,
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


def privacy_note(history: list[dict], where: str = "") -> list[str]:
    """The guarantee a differentially private run (or stage ``where``) reached (its last
    record's ε), or nothing."""
    last = history[-1] if history else {}
    if "dp_epsilon" not in last:
        return []
    return [f"Privacy{where}: client-level (ε = {last['dp_epsilon']:.2f}, δ = "
            f"{last['dp_delta']:.3g}) for θ after {last['round']} rounds (noise multiplier z = "
            f"{last['dp_noise_multiplier']:.4g}, clip norm C = {last['dp_clip_norm']:.4g}; "
            "ε from dp-accounting); the personal parameters never leave the clients."]


def write_report(cfg: RunSpec, history: list[dict], seconds: float, out: Path) -> Path:
    """What ``partialfl run`` writes beside ``<name>.jsonl``, like a reproduction:
    ``<name>.png`` (relative distance to θ* and ‖F‖² vs rounds) and ``summary.md`` (the
    configuration and the final metrics); returns the summary's path."""
    out = Path(out)
    name = cfg.name
    plot_curves(out / f"{name}.png", [{name: history}, {name: history}],
                [REL_DIST2, "‖F(θʳ)‖²"], x="round", y="rel_dist2", ylabel="",
                y_per_panel=["rel_dist2", "F_norm2"])
    p, m, st = cfg.problem.options, cfg.method, cfg.personalize
    client = st.client
    tau = client.get("tau")
    notes = [
        f"Problem: {cfg.problem.name}, {p.num_clients} clients, n = {p.n:,} rows each, d_θ = "
        f"{p.d_theta}, d_w = {p.d_w}, data seed {p.seed}. Algorithm: {m.algorithm} (client "
        f"{client.name}, w from {m.w_init})"
        + ("" if tau is None else f", τ = {tau}") + f"; server {st.server.optimizer.name} lr "
        f"{st.server.lr}; {st.rounds} rounds, "
        + (f"{st.clients_per_round} clients per round"
           if st.clients_per_round else "all clients every round")
        + f", run seed {cfg.seed}.",
        f"Metrics every {st.eval_every} rounds: `{name}.jsonl`; plot: `{name}.png`. "
        "Loss gap: (1/M)Σ f_m(θ, w_m) − min_{θ,w} f_m with the deployed w_m.",
        *privacy_note(history),
        "",
        "Configuration (as run):",
        "",
        "```toml",
        *toml_text(cfg.shown()).splitlines(),
        "```",
    ]
    path = out / "summary.md"
    pio.write_text(path, summary_markdown(
        [{"method": m.label or m.algorithm, "tau": "—" if tau is None else tau, "history": history,
          "seconds": seconds}], f"{name}: {m.algorithm} on {cfg.problem.name}", notes))
    return path


def run_and_report(cfg: RunSpec, out: Path, progress: bool | str = False):
    """``partialfl run``: :func:`run_closed_form` into ``out``, then :func:`write_report`;
    returns ``(result, summary path)``."""
    from partialfl.pipeline.run_files import refuse_users_entries

    refuse_users_entries(Path(out), (f"{cfg.name}.png", "summary.md"), f"{cfg.name}.jsonl")
    t0 = time.perf_counter()
    res = run_closed_form(cfg, out, progress=progress)
    return res, write_report(cfg, res.history, time.perf_counter() - t0, out)


__all__ = ["load_closed_form", "run_and_report", "run_closed_form", "summary_markdown",
           "write_report"]
