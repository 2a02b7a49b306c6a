"""Command line: ``partialfl reproduce NAME``, ``partialfl run CONFIG``, ``partialfl list``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from partialfl.config import ConfigError, apply_overrides, load_toml


def _cmd_list(args) -> int:
    from partialfl.experiments import REPRODUCTIONS

    width = max(map(len, REPRODUCTIONS))
    for name, (_, _, desc) in REPRODUCTIONS.items():
        print(f"{name:<{width}}  {desc}")
    return 0


def _cmd_reproduce(args) -> int:
    from partialfl.experiments import get_reproduction

    fn = get_reproduction(args.name)
    out = Path(args.out or Path("runs") / (args.name + ("-quick" if args.quick else "")))
    summary = fn(out, quick=args.quick, seeds=args.seeds, data_dir=args.data_dir,
                 progress=not args.no_progress)
    print(Path(summary).read_text())
    print(f"results written to {out}/")
    return 0


def _cmd_run(args) -> int:
    from partialfl.experiments.closed_form import load_closed_form, run_closed_form

    data = apply_overrides(load_toml(args.config), args.set or [])
    data.setdefault("name", Path(args.config).stem)
    cfg = load_closed_form(data)
    out = Path(args.out or Path("runs") / cfg.name)
    res = run_closed_form(cfg, out, progress=not args.no_progress)
    last = res.history[-1]
    print(" ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in last.items()))
    print(f"metrics written to {out / (cfg.name + '.jsonl')}")
    return 0


def _jsonable(o):
    import dataclasses

    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def _cmd_evaluate(args) -> int:
    import json

    from partialfl.experiments.femnist import evaluate_new_writers

    res = evaluate_new_writers(args.run, args.data_dir, finetune_epochs=args.finetune_epochs,
                               lr=args.lr)
    text = json.dumps(res, indent=2, default=_jsonable)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="partialfl",
        description="Partially personalized federated learning (FFGG and baselines).",
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("list", help="list the reproductions")
    s.set_defaults(fn=_cmd_list)

    s = sub.add_parser("reproduce", help="run a paper reproduction (see `partialfl list`)")
    s.add_argument("name")
    s.add_argument("--quick", action="store_true", help="reduced size (what CI runs)")
    s.add_argument("--out", help="output folder (default runs/NAME)")
    s.add_argument("--data-dir", help="folder with the real data (default: $PARTIALFL_DATA_DIR "
                   "or ../shared/data)")
    s.add_argument("--seeds", type=int, nargs="+", help="seeds (default: the reproduction's)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.set_defaults(fn=_cmd_reproduce)

    s = sub.add_parser(
        "evaluate",
        help="fine-tune w on new clients (writers held out of a femnist-table run) for a "
             "trained θ and report pooled accuracy and its distribution over clients")
    s.add_argument("run", help="a finished run folder, e.g. runs/femnist-table/ffgg-output/"
                   "seed0 (it holds deploy.pt and config.json)")
    s.add_argument("--data-dir", help="folder with femnist_leaf_subset.npz")
    s.add_argument("--finetune-epochs", type=int, help="default: the run's stage-3 epochs")
    s.add_argument("--lr", type=float, help="default: the run's stage-3 learning rate")
    s.add_argument("--json", help="also write the metrics to this file")
    s.set_defaults(fn=_cmd_evaluate)

    s = sub.add_parser("run", help="run one closed-form experiment from a TOML config")
    s.add_argument("config")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set algorithm.tau=10 (repeatable)")
    s.add_argument("--out", help="output folder (default runs/NAME)")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=_cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"partialfl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("partialfl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
