"""The FEMNIST example on one machine: a SuperLink and N SuperNodes on 127.0.0.1 (insecure),
each SuperNode holding its own writers, trained with ``flwr run`` in two stages of the paper's
pipeline:

1. FedAvg (every parameter global) from the seeded initialisation → ``stage1/theta.npz``;
2. FFGG with the output layer personal, started from stage 1 (``init-from``): every round,
   each sampled writer re-initialises its head from the stage-1 head, fine-tunes it on its
   own images and sends only the gradient of the rest of the network.

The same commands, one per machine, are in ``README.md``. Usage::

    python examples/flower/femnist_local.py --supernodes 4 --out results/flower-femnist
    python examples/flower/femnist_local.py --quick          # a few rounds, to try it

It prints what it starts and one line per round of each stage as the ServerApp reports it
(on a 2-core machine, starting the SuperNodes and the first round take longest: each
ClientApp imports torch and loads its writers), then a summary of each stage.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--supernodes", type=int, default=4)
    ap.add_argument("--stage1-rounds", type=int, default=100)
    ap.add_argument("--stage2-rounds", type=int, default=50)
    ap.add_argument("--clients-per-round", type=int, default=10)
    ap.add_argument("--data-dir", default="", help="folder of femnist_leaf_subset.npz")
    ap.add_argument("--out", default="results/flower-femnist")
    ap.add_argument("--quick", action="store_true",
                    help="a try-out: 2 SuperNodes, 4 writers per round, 3 + 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.supernodes, args.clients_per_round = 2, 4
        args.stage1_rounds, args.stage2_rounds = 3, 2

    from partialfl.flower.project import LocalFederation

    out = Path(args.out).resolve()
    common = {"problem": "femnist", "clients-per-round": args.clients_per_round,
              "data-dir": args.data_dir, "round-timeout": 900.0}
    stage1 = {**common, "algorithm": "fedavg", "local-lr": 0.5, "server-lr": 1.0,
              "num-rounds": args.stage1_rounds, "eval-every": args.stage1_rounds}
    stage2 = {**common, "algorithm": "ffgg", "split": "output", "w-init": "pretrained",
              "local-lr": 0.01, "server-lr": 0.05, "num-rounds": args.stage2_rounds,
              "eval-every": args.stage2_rounds, "init-from": str(out / "stage1" / "theta.npz")}
    print(f"starting a SuperLink and {args.supernodes} SuperNodes on 127.0.0.1 ...", flush=True)
    with LocalFederation(args.supernodes, work_dir=out / "federation") as fed:
        print(f"SuperLink on 127.0.0.1:{fed.port}, {args.supernodes} SuperNodes; logs in "
              f"{fed.logs}", flush=True)
        for name, cfg in (("stage1", stage1), ("stage2", stage2)):
            print(f"{name}: {cfg['algorithm']}, {cfg['num-rounds']} rounds of "
                  f"{cfg['clients-per-round']} writers ...", flush=True)
            rep = fed.run(cfg, out_dir=out / name, timeout=24 * 3600, progress=name)
            print(stage_summary(name, cfg, rep), flush=True)
    print(f"results (result.json, metrics.jsonl, theta.npz per stage) in {out}")


def stage_summary(name: str, cfg: dict, rep: dict) -> str:
    """One line per stage from its result.json: rounds, time, final test accuracy and the
    mean per-writer accuracy (the SuperNodes send sums only: no percentiles over writers),
    failures."""
    last = rep["history"][-1]
    s = rep["summary"]
    return (f"{name}: {cfg['algorithm']} {cfg['num-rounds']} rounds in {s['seconds']:.0f} s "
            f"(setup {s['setup_seconds']:.0f} s); test accuracy "
            f"{last.get('eval_acc', float('nan')):.4f} (mean over writers "
            f"{last.get('eval_acc_client_mean', float('nan')):.3f}); failures {s['failures']}")


if __name__ == "__main__":
    main()
