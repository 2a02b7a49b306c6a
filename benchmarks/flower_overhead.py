"""What running on Flower costs per round: one spec in process, in Flower's simulation engine
(``flower-superlink --simulation``), on live SuperNodes on this machine (TLS, SuperNode
authentication, each node with its own data: what ``partialfl flower local`` starts) and on
the same live nodes with SecAgg+ — seconds per round (start-up excluded; evaluations before
the first and after the last round included) and max |θ − θ_in-process|.

    python benchmarks/flower_overhead.py                        # least squares, FFGG
    python benchmarks/flower_overhead.py configs/train/quickstart.toml --rounds 3 \\
        --set data.num_clients=9 --set data.holdout=0

A model config runs its personalization stage only (``stages = ["personalize"]``). Every
live ClientApp message runs in a fresh ``flwr-clientapp`` process (Python start, imports,
building the node's problem) and an idle SuperNode polls the SuperLink every 3 s, so a live
round costs seconds however small the model; SecAgg+ makes one exchange four.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LS_SETS = ["problem.num_clients=12", "problem.n=1000", "problem.d_theta=100",
           "problem.d_w=50", "personalize.clients_per_round=6"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "ls-ffgg.toml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--no-secagg", action="store_true")
    args = ap.parse_args()

    from partialfl.build import build
    from partialfl.flower.deployment import LocalFederation
    from partialfl.flower.env import apply_flower_env
    from partialfl.flower.local import node_view, write_node_stores
    from partialfl.flower.train import stage_run_config
    from partialfl.pipeline.train import load_run_spec

    apply_flower_env()
    default = args.config == str(ROOT / "configs" / "ls-ffgg.toml")
    sets = [*(LS_SETS if default else []), *args.set, f"personalize.rounds={args.rounds}",
            f"personalize.eval_every={args.rounds}"]
    spec = load_run_spec(args.config, sets)
    if not spec.closed_form:
        spec = load_run_spec(args.config, [*sets, "stages=['personalize']"])
    run = build(spec)
    eff = spec.effective()
    print(f"{args.config} ({' '.join(sets)}), {args.nodes} SuperNodes, load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

    # in process
    t0 = time.perf_counter()
    if spec.closed_form:
        from partialfl.pipeline.closed_form import run_closed_form

        ref = {n: np.asarray(v) for n, v in
               run_closed_form(spec, built=run).state.theta.items()}
    else:
        from partialfl.pipeline.stages import stage2_setup
        from partialfl.runtime.sync import run_rounds

        theta1 = {n: p.detach().clone() for n, p in
                  run.task.model_fn(eff.stage1_seed).named_parameters()}
        _, problem, alg, theta0 = stage2_setup(eff, run.task, theta1)
        st = eff.personalize
        res = run_rounds(problem, alg, st.rounds, clients_per_round=st.clients_per_round,
                         seed=eff.seed, theta0=theta0, eval_every=st.rounds,
                         backend=eff.backend.build())
        ref = {n: v.detach().numpy() for n, v in res.state.theta.items()}
    rows = [("in process", (time.perf_counter() - t0) / args.rounds, 0.0)]

    def measure(label, fed, **flower):
        with tempfile.TemporaryDirectory() as out:
            rep = fed.run(stage_run_config(spec, **flower), out_dir=Path(out) / "r",
                          timeout=3600)
        diff = max(float(np.abs(rep["theta"][n] - ref[n]).max()) for n in ref)
        s = rep["summary"]
        rows.append((label, s["seconds_per_round"], diff))
        print(f"{label}: {s['seconds_per_round']:.3f} s/round (setup {s['setup_seconds']:.1f} "
              f"s), max |Δθ| {diff:.2e}", flush=True)

    with LocalFederation(args.nodes, simulation=True) as fed:
        measure("Flower simulation", fed)
    with tempfile.TemporaryDirectory() as work:
        stores = None if spec.closed_form else write_node_stores(node_view(run), args.nodes,
                                                                 Path(work) / "data")
        with LocalFederation(args.nodes, secure=True, node_data=stores,
                             work_dir=Path(work) / "fed") as fed:
            measure("live SuperNodes (TLS, node auth)", fed)
            if not args.no_secagg:
                measure("live SuperNodes + SecAgg+", fed, secagg=True)
    base = rows[0][1]
    print("\n| engine | s/round | × in process | max \\|θ − θ_in-process\\| |")
    print("| --- | --- | --- | --- |")
    for label, sec, diff in rows:
        print(f"| {label} | {sec:.3f} | {sec / base:.0f}× | {diff:.1e} |")


if __name__ == "__main__":
    main()
