"""Per-round overhead of running partialfl on Flower vs the in-process simulator.

One configuration (FFGG on the least-squares problem by default), three ways, in one run:

1. in-process: :func:`partialfl.runtime.sync.run_rounds` (batched backend);
2. Flower simulation: :func:`partialfl.flower.simulation.run_simulation` (Ray actors as
   ClientApps, the ServerApp in this process);
3. Flower deployment: ``flower-superlink`` + N ``flower-supernode`` processes on 127.0.0.1 and
   ``flwr run`` (:class:`partialfl.flower.project.LocalFederation`); every ClientApp message
   runs in a fresh ``flwr-clientapp`` process, as Flower deploys it.

Per-round time excludes start-up (Ray, processes, discovering the SuperNodes): it is
(run time − setup time) / rounds, with the setup time measured by the ServerApp. θ after the
run is compared with the in-process θ. Usage::

    python benchmarks/flower_overhead.py              # least squares, 2 SuperNodes
    python benchmarks/flower_overhead.py --quick      # fewer rounds
    python benchmarks/flower_overhead.py --problem femnist --rounds 3 --deploy-rounds 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problem", choices=("least-squares", "femnist"), default="least-squares")
    ap.add_argument("--rounds", type=int, default=30, help="in-process and simulation rounds")
    ap.add_argument("--deploy-rounds", type=int, default=6, help="deployment rounds")
    ap.add_argument("--supernodes", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="8 / 3 rounds")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.deploy_rounds = 8, 3

    from partialfl.flower.env import apply_flower_env

    apply_flower_env()
    from partialfl.flower.builders import build_algorithm, build_problem
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.project import LocalFederation
    from partialfl.flower.simulation import run_simulation
    from partialfl.runtime.sync import run_rounds

    if args.problem == "least-squares":
        # Example 1 with n = 1000 rows per client; FFGG with 40 CG steps, 8 of 32 clients.
        base = {"ls-clients": 32, "ls-n": 1000, "ls-d-theta": 100, "ls-d-w": 50,
                "solver": "cg", "local-steps": 40, "clients-per-round": 8}
    else:
        base = {"problem": "femnist", "algorithm": "ffgg", "local-lr": 0.01, "server-lr": 0.2,
                "clients-per-round": 10}
    base["eval-every"] = 0

    def config(rounds: int) -> dict:
        return {**base, "num-rounds": rounds}

    print(f"problem {args.problem}, {args.supernodes} SuperNodes, config {base}")
    print("(shared 2-core machine, timings are noisy; ratios are within this run)")

    # 1. in-process
    cfg = parse_run_config(config(args.rounds))
    problem = build_problem(cfg)
    algorithm = build_algorithm(cfg, problem)
    t = time.perf_counter()
    ref = run_rounds(problem, algorithm, args.rounds, clients_per_round=cfg.clients_per_round,
                     seed=cfg.seed)
    inproc = (time.perf_counter() - t) / args.rounds
    ref_short = run_rounds(problem, algorithm, args.deploy_rounds,
                           clients_per_round=cfg.clients_per_round, seed=cfg.seed)

    def err(theta, reference) -> float:
        return max(float(np.abs(np.asarray(theta[n]) - _np(reference.state.theta[n])).max())
                   for n in reference.state.theta)

    # 2. Flower simulation (Ray)
    t = time.perf_counter()
    rep = run_simulation(config(args.rounds), num_supernodes=args.supernodes,
                         num_cpus=2)
    sim_total = time.perf_counter() - t
    sim = rep.summary()["seconds_per_round"]
    sim_err = err(rep.theta, ref)
    import ray

    ray.shutdown()

    # 3. Flower deployment (SuperLink + SuperNodes + flwr run)
    t = time.perf_counter()
    with LocalFederation(args.supernodes) as fed:
        started = time.perf_counter() - t
        dep_rep = fed.run(config(args.deploy_rounds), timeout=3600)
    dep_total = time.perf_counter() - t
    dep = dep_rep["summary"]["seconds_per_round"]
    dep_err = err(dep_rep["theta"], ref_short)

    print()
    print(f"{'mode':<22}{'s/round':>10}{'x in-process':>14}{'total s':>10}"
          f"{'setup s':>10}{'max|Δθ|':>11}")
    print(f"{'in-process':<22}{inproc:>10.4f}{1.0:>14.1f}{inproc * args.rounds:>10.2f}"
          f"{0.0:>10.2f}{0.0:>11.1e}")
    print(f"{'Flower simulation':<22}{sim:>10.4f}{sim / inproc:>14.1f}{sim_total:>10.2f}"
          f"{rep.setup_seconds:>10.2f}{sim_err:>11.1e}")
    print(f"{'Flower deployment':<22}{dep:>10.4f}{dep / inproc:>14.1f}{dep_total:>10.2f}"
          f"{dep_rep['summary']['setup_seconds'] + started:>10.2f}{dep_err:>11.1e}")
    print(f"\nrounds: in-process and simulation {args.rounds}, deployment {args.deploy_rounds}")
    print(f"deployment / simulation per round: {dep / sim:.1f}x")


def _np(v):
    return v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)


if __name__ == "__main__":
    main()
