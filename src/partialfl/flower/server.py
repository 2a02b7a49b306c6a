"""The ServerApp: θ, the server optimizer and the aggregation live here; data never does.

The loops are the simulator's own, over a Flower transport (so sampling, evaluation cadence,
counting, staleness, checkpoint and resume are written once, in :mod:`partialfl.runtime`):

* :mod:`partialfl.flower.federation` — the message link, the SuperNodes' (checked)
  descriptions: who holds which clients, θ⁰;
* :mod:`partialfl.flower.rounds` — synchronous rounds (:func:`partialfl.runtime.sync.run_rounds`
  over ``train`` messages) and the out-dir checkpoint;
* :mod:`partialfl.flower.jobs` — asynchronous push/pull (Algorithm 3, FedBuff buffer K) over
  :func:`partialfl.runtime.asynchronous.drive`;
* :mod:`partialfl.flower.evaluate` — the SuperNodes' evaluation (sums over at least
  ``eval-min-clients`` clients);
* :mod:`partialfl.flower.report` — :class:`FlowerRunReport` and how failures are counted.

Every reply is checked by :mod:`partialfl.flower.codec`; a reply it refuses is a counted
failure of its SuperNode, never an exception in the ServerApp.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from partialfl import arrays
from partialfl import rng as prng
from partialfl.flower.config import parse_run_config
from partialfl.flower.federation import Link, MessageHook, ServerProblem, describe, wait_for_nodes
from partialfl.flower.jobs import ASYNC_CHECKPOINT, async_checkpoint, run_async
from partialfl.flower.report import (
    Failure,
    FlowerRunReport,
    RunAborted,
    ServerStopped,
    check_failures,
    log,
)
from partialfl.flower.rounds import run_sync
from partialfl.flower.stage import expected_federation, server_parts


def run_server(grid: Grid, run_config: dict[str, Any], *,
               message_hook: MessageHook | None = None,
               algorithm_factory=None) -> FlowerRunReport:
    """Run the spec's stage over ``grid`` and return the report (also written to ``out-dir``
    when set). ``message_hook`` sees every message the server receives (before it is
    decoded); ``algorithm_factory(cfg, problem)`` (problem None when the server holds no
    data) builds the algorithm instead of the spec (the ClientApps must use the same
    factory)."""
    cfg = parse_run_config(run_config)
    t0 = time.perf_counter()
    link = Link(grid, cfg, message_hook)
    fed = describe(link, cfg, wait_for_nodes(grid, cfg), expected_federation(cfg))
    # Only a closed-form problem (a public generator and seed) is rebuilt on the server: for
    # 'lr = "auto"' (1/L) and the reference metrics ‖θ − θ*‖², ‖F(θ)‖².
    ref, algorithm = server_parts(cfg, fed.num_clients)
    if algorithm_factory is not None:
        algorithm = algorithm_factory(cfg, ref)
    if cfg.secagg:
        from partialfl.flower.secagg import check_algorithm, check_nodes

        check_algorithm(algorithm)
        check_nodes(cfg, len(fed.nodes))
    # θ⁰ of a closed form is the server's own (what every node computes from the public seed),
    # never what the node claiming partition 0 sent; a model's comes from partition 0
    theta0 = (fed.theta0 if ref is None else
              ref.init_theta(prng.generator(cfg.seed, "init")))
    state = algorithm.init(ref if ref is not None else ServerProblem(
        fed.num_clients, fed.examples, theta0), theta0)
    report = FlowerRunReport({**cfg.to_run_config(), "spec": cfg.run.to_dict()}, state.theta,
                             failures=list(fed.failures),
                             nodes=[{"node": n, **i} for n, i in fed.nodes.items()],
                             setup_seconds=time.perf_counter() - t0, rounds=cfg.rounds,
                             label=describe_run(cfg))
    log.info("partialfl: %s (%s) on %d SuperNodes holding %d clients", report.label,
             "async" if cfg.asynchronous else "sync", len(fed.nodes), fed.num_clients)
    loop = run_sync if cfg.asynchronous is None else run_async
    try:
        state = loop(link, cfg, fed, algorithm, state, ref, report, t0)
        check_failures(cfg, report, when="end")
    except RunAborted as e:
        report.aborted, report.stopped = True, str(e)
        report.seconds = time.perf_counter() - t0
        log.error("partialfl: %s", e)
        if cfg.out_dir:
            report.write(cfg.out_dir)
        raise
    report.theta = {n: arrays.to_numpy(v) for n, v in state.theta.items()}
    report.server_steps = state.round
    report.seconds = time.perf_counter() - t0
    if report.failures:
        log.warning("partialfl: %d failed replies (%s), %d client updates lost, %d rounds "
                    "skipped", len(report.failures), report.failure_counts,
                    report.failed_client_updates, report.skipped_rounds)
    if cfg.out_dir:
        path = report.write(cfg.out_dir)
        log.info("partialfl: wrote %s", path)
    return report


def describe_run(cfg) -> str:
    """``"METHOD on PROBLEM-OR-DATA, stage STAGE"`` (stage 1 trains FedAvg, whatever the
    method of stage 2)."""
    run = cfg.run
    what = run.problem.name if run.closed_form else f"{run.data.source}/{run.model.name}"
    method = ("FedAvg pre-training" if cfg.stage == "pretrain" else
              run.method.label or run.method.algorithm if run.closed_form else run.method.name)
    return f"{method} on {what}, stage {cfg.stage}"


def make_server_app(*, run_config: dict[str, Any] | None = None,
                    message_hook: MessageHook | None = None,
                    on_report: Callable[[FlowerRunReport], None] | None = None) -> ServerApp:
    """A ServerApp running :func:`run_server` on ``context.run_config`` (what ``flwr run -c``
    fused), or on ``run_config`` when given. The keyword arguments are for programmatic use
    (Python simulation, message capture, getting the report)."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        from partialfl.flower.env import exit_with_parent, started_by_superlink

        if started_by_superlink():  # a SuperLink killed mid-round orphans no ServerApp
            exit_with_parent()
        cfg = dict(context.run_config) if run_config is None else dict(run_config)
        report = run_server(grid, cfg, message_hook=message_hook)
        if on_report is not None:
            on_report(report)

    return server


app = make_server_app()

__all__ = ["ASYNC_CHECKPOINT", "Failure", "FlowerRunReport", "MessageHook", "RunAborted",
           "ServerStopped", "app", "async_checkpoint", "make_server_app", "run_server"]
