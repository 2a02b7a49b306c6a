"""Flower's side of ``benchmarks/peers.py``: the round in Flower's simulation engine.

``flwr.simulation.run_simulation`` with 10 virtual SuperNodes (one per writer of the cohort;
``flower_client.py`` is their ClientApp, run by Ray actors of ``num_cpus = 1`` each, so
``--workers`` of them train at once) and a ServerApp running the Message API's ``FedAvg``
(every node each round, weighted by ``num-examples``, no federated evaluation; FFGG: the
clients send ∇_θ and the server steps θ ← θ − mean g after the weighted mean). The strategy
is FedAvg with two hooks: ``configure_train`` waits for the next command, starts the clock
and sends θ⁰ (every round is the same work); ``aggregate_train`` stops the clock after the
weighted average and reports. Flower runs a fixed number of rounds: ``--rounds``.

    python benchmarks/peers/flower_runner.py --cohort FILE --rounds 6 [--workers 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cohort", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--workers", type=int, default=2, help="Ray CPUs (one per ClientApp)")
    ap.add_argument("--weights-out", default=None)
    args = ap.parse_args()
    os.environ["PEERS_COHORT"] = str(Path(args.cohort).resolve())
    for k, v in {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                 "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}.items():
        os.environ.setdefault(k, v)
    common.one_thread()

    from flower_client import app as client_app
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    cohort = common.Cohort(args.cohort)
    theta0 = ArrayRecord(cohort.model().state_dict())
    timer = common.RoundTimer(cohort, args.weights_out)
    cmds = common.commands()

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            if next(cmds, None) is None:  # told to quit: end the run now
                os._exit(0)
            self.t = common.now()
            return super().configure_train(server_round, theta0, config, grid)

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            arrays, metrics = super().aggregate_train(server_round, replies)
            if cohort.algorithm == "ffgg":  # the weighted mean of the gradients: step θ
                g = arrays.to_torch_state_dict()
                arrays = ArrayRecord({n: v - g[n] if n in g else v
                                      for n, v in theta0.to_torch_state_dict().items()})
            dt = common.now() - self.t
            examples = sum(int(r.content["metrics"]["num-examples"]) for r in replies
                           if r.has_content())
            timer.report(dt, examples, arrays.to_torch_state_dict(), nodes=len(replies))
            return arrays, metrics

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                               min_train_nodes=cohort.k, min_available_nodes=cohort.k)
        common.emit(ready=True)
        strategy.start(grid=grid, initial_arrays=theta0, num_rounds=args.rounds,
                       train_config=ConfigRecord({}))

    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": args.workers, "include_dashboard": False,
                             "logging_level": logging.ERROR}}
    run_simulation(server_app=server, client_app=client_app, num_supernodes=cohort.k,
                   backend_name="ray", backend_config=backend)


if __name__ == "__main__":
    main()
