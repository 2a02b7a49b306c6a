"""The FEMNIST quickstart on a real Flower federation on this machine, in one call: a
SuperLink and N SuperNodes on 127.0.0.1 with TLS and SuperNode authentication, each SuperNode
holding only its own writers (a client store per node), the quickstart config run on them as
``partialfl train --engine flower`` does (stage 1 FedAvg, stage 2 FFGG with a personal output
layer, stage 3 fine-tuning and evaluation where the data is), every process stopped at the
end. The command line does the same::

    partialfl flower local configs/train/quickstart.toml --nodes 4 --out runs/flower-quickstart

Usage::

    python examples/flower/femnist_local.py --nodes 4 --out runs/flower-quickstart
    python examples/flower/femnist_local.py --quick        # 3 nodes, 2 + 2 rounds, to try it
    python examples/flower/femnist_local.py --quick --secagg   # θ aggregated with SecAgg+

It prints one line per round of each stage as the ServerApp reports it, then the test
accuracy; the run folder has the files of an in-process ``partialfl train`` run. See
docs/flower.md for the same on separate machines.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--out", default="runs/flower-quickstart")
    ap.add_argument("--data-dir", default="", help="folder of femnist_leaf_subset.npz "
                    "(default: $PARTIALFL_DATA_DIR)")
    ap.add_argument("--quick", action="store_true",
                    help="a try-out: 3 nodes, 5 writers, 2 + 2 rounds of 3 writers")
    ap.add_argument("--secagg", action="store_true", help="aggregate θ with SecAgg+")
    args = ap.parse_args()
    sets = [f"data.path={Path(args.data_dir).resolve()}"] if args.data_dir else []
    if args.quick:
        args.nodes = 3
        sets += ["data.num_clients=5", "data.holdout=1", "pretrain.rounds=2",
                 "personalize.rounds=2", "pretrain.clients_per_round=3",
                 "personalize.clients_per_round=3", "finetune.epochs=1"]

    from partialfl.flower.local import run_local
    from partialfl.pipeline.train import load_run_spec

    spec = load_run_spec(ROOT / "configs" / "train" / "quickstart.toml", sets)
    print(run_local(spec, args.out, args.nodes, secagg=args.secagg), flush=True)


if __name__ == "__main__":
    main()
