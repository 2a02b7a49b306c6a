"""Run the partialfl Flower app in Flower's simulation engine from Python.

:func:`run_simulation` starts ``num_supernodes`` virtual SuperNodes (each holding one
partition of the clients) whose ClientApps run in Ray actors, and the ServerApp in a thread of
this process; it returns the :class:`~partialfl.flower.server.FlowerRunReport`. It is the
Python form of ``flwr run APP`` against a simulation SuperLink (see
:mod:`partialfl.flower.deployment` and ``docs/flower.md``) and accepts what a command
line cannot: a hook that sees every message the server receives, an algorithm factory.
:func:`run_simulations` runs several configurations one after the other on the same simulated
federation (one Ray start-up for all of them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from partialfl.flower.client import AlgorithmFactory, app, make_client_app
from partialfl.flower.config import parse_run_config
from partialfl.flower.env import apply_flower_env
from partialfl.flower.server import FlowerRunReport, MessageHook, run_server


def run_simulations(run_configs: Sequence[dict[str, Any]], *, num_supernodes: int = 2,
                    message_hooks: Sequence[MessageHook | None] | None = None,
                    num_cpus: int | None = None, cpus_per_client: float = 1.0,
                    verbose: bool = False, raise_errors: bool = True,
                    algorithm_factory: AlgorithmFactory | None = None
                    ) -> list[FlowerRunReport | Exception]:
    """Simulate each run of ``run_configs`` (kebab-case keys of
    :data:`partialfl.flower.config.FIELDS`; ``spec``: a :class:`~partialfl.spec.RunSpec`,
    its dict or its text), in order, on ``num_supernodes`` SuperNodes.

    ``message_hooks[i]`` sees every message the server receives in run i. ``num_cpus`` caps
    Ray's CPUs (default: all); ``cpus_per_client`` is what one ClientApp actor takes, so
    ``num_cpus / cpus_per_client`` ClientApps run at once. Ray stays initialised afterwards
    (reused by the next call); ``ray.shutdown()`` stops it.

    ``algorithm_factory(cfg, problem)`` builds the algorithm of every run, on the server and
    the SuperNodes, instead of the spec's (an algorithm written outside partialfl; its module
    must be importable in the ClientApp actors, or registered with
    ``ray.cloudpickle.register_pickle_by_value``; a registered plugin is the simpler way).

    A run that raises (e.g. :class:`~partialfl.flower.server.RunAborted` past
    ``max-failure-fraction``) does not stop the next ones; its error is raised at the end, or,
    with ``raise_errors=False``, returned in its place.
    """
    apply_flower_env()
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation as flwr_run_simulation

    client = make_client_app(algorithm_factory) if algorithm_factory is not None else app

    # Ray >= 2.5x warns that it will stop overriding CUDA_VISIBLE_DEVICES for num_gpus=0;
    # opting in to the future behaviour silences it (CPU-only ClientApps either way).
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    configs = [parse_run_config(c).to_run_config() for c in run_configs]  # fail fast
    hooks = list(message_hooks) if message_hooks is not None else [None] * len(configs)
    if len(hooks) != len(configs):
        raise ValueError(f"{len(hooks)} message hooks for {len(configs)} runs")
    if not isinstance(num_supernodes, int) or num_supernodes < 1:
        raise ValueError(f"num_supernodes must be an integer >= 1, got {num_supernodes!r}")
    reports: list[FlowerRunReport] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for cfg, hook in zip(configs, hooks):
            try:
                reports.append(run_server(grid, cfg, message_hook=hook,
                                          algorithm_factory=algorithm_factory))
            except Exception as e:  # noqa: BLE001 - reported to the caller below
                reports.append(e)

    init_args: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR}
    if num_cpus is not None:
        init_args["num_cpus"] = num_cpus
    backend = {"client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0},
               "init_args": init_args}
    flwr_run_simulation(server_app=server, client_app=client, num_supernodes=num_supernodes,
                        backend_name="ray", backend_config=backend, verbose_logging=verbose)
    if len(reports) != len(configs):
        raise RuntimeError(f"the ServerApp finished {len(reports)} of {len(configs)} runs "
                           "(see the log above)")
    errors = [r for r in reports if isinstance(r, Exception)]
    if errors and raise_errors:
        raise errors[0]
    return reports


def run_simulation(run_config: dict[str, Any], *, num_supernodes: int = 2,
                   message_hook: MessageHook | None = None, num_cpus: int | None = None,
                   cpus_per_client: float = 1.0, verbose: bool = False,
                   algorithm_factory: AlgorithmFactory | None = None) -> FlowerRunReport:
    """Simulate one run (see :func:`run_simulations`)."""
    return run_simulations([run_config], num_supernodes=num_supernodes,
                           message_hooks=[message_hook], num_cpus=num_cpus,
                           cpus_per_client=cpus_per_client, verbose=verbose,
                           algorithm_factory=algorithm_factory)[0]  # type: ignore
