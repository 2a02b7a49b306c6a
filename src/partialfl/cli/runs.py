"""``partialfl evaluate``, ``partialfl compare`` and ``partialfl report``: commands on finished
run folders."""

from __future__ import annotations

import sys
from pathlib import Path


def _evaluator(data):
    """The new-client evaluation of a run: a train run's (``spec.json``: its held-out clients
    or those of ``--data``), else that of the table it belongs to."""
    from partialfl.pipeline.train import evaluate_train_run
    from partialfl.reproductions import new_client_evaluator

    def train_run(run, _data_dir, **kw):
        from partialfl import io as pio
        from partialfl.build import code_allowed, config_folder_on_path

        src = run / "source.json"
        if code_allowed() and src.is_file():  # the model module beside the run's config
            config = pio.read_json(src).get("config")
            if not isinstance(config, str):
                raise pio.FileFormatError(f"{src} names no config file (damaged?)")
            config_folder_on_path(Path(config).parent)
        return evaluate_train_run(run, data, **kw)

    def pick(run: Path):
        if (run / "spec.json").is_file():
            return train_run
        if data is not None:
            raise ValueError(f"--data applies to `partialfl train` runs; {run} is a table run "
                             "(use --data-dir)")
        return new_client_evaluator(run)

    return pick


def _cmd_evaluate(args) -> int:
    from partialfl.build import allow_code
    from partialfl.pipeline.run_files import refuse_foreign, refuse_run_file
    from partialfl.pipeline.runs import (
        evaluate_runs,
        evaluation_table,
        is_evaluation_json,
        to_json,
    )

    if args.json not in (None, "-"):  # before the evaluation's work
        refuse_run_file(Path(args.json), "--json")
        refuse_foreign(Path(args.json), "--json", is_evaluation_json)
    with allow_code(args.allow_code or None):
        results = evaluate_runs(args.run, _evaluator(args.data), args.data_dir,
                                finetune_epochs=args.finetune_epochs,
                                lr=args.lr, progress=not args.no_progress)
    if args.json is None:
        print(evaluation_table(results))
    elif args.json == "-":
        print(to_json(results))
    else:
        from partialfl import io as pio

        path = Path(args.json)
        if path.parent.is_dir():  # the temporary file of a killed write of this output
            pio.clean_stale_writes(path.parent, recursive=False, targets=(path.name,))
        pio.write_text(path, to_json(results))
        print(evaluation_table(results))
        print(f"metrics written to {path}")
    bad = {lab: r["diverged"] for lab, r in results.items() if r.get("diverged")}
    for lab, why in bad.items():  # as `partialfl train` says it: stderr, exit 1
        print(f"warning: {lab}: {why}", file=sys.stderr)
    return 1 if bad else 0


def _cmd_report(args) -> int:
    from partialfl.pipeline.train_report import write_report

    run = Path(args.run)
    if not run.is_dir():
        if run.exists():
            raise NotADirectoryError(f"{run} is not a folder: pass a run folder (the --out of "
                                     "partialfl train/run)")
        raise FileNotFoundError(f"run folder {run} does not exist")
    path = write_report(run, tensorboard=args.tensorboard, rebuild=True)
    print(path.read_text())
    print(f"report and plots written to {run}/")
    return 0



def _cmd_compare(args) -> int:
    from partialfl.pipeline.compare import compare

    if args.out is None and len(args.runs) != 1:
        raise ValueError("--out is needed to compare runs of several folders (with one "
                         "folder, compare.md is written into it)")
    out = Path(args.out or args.runs[0])
    path = compare(args.runs, out, baseline=args.baseline)
    print(path.read_text())
    print(f"comparison written to {out}/ (compare.md, compare.png)")
    return 0


def add_commands(sub) -> None:
    s = sub.add_parser(
        "evaluate",
        help="personalize a trained run on new clients (held out of training, or --data) and "
             "report pooled accuracy and its distribution over clients")
    s.add_argument("run", help="a finished run folder (a `partialfl train` run, or a table's "
                   "such as runs/femnist-table/seed0/ffgg-output: it holds deploy.safetensors "
                   "and config.json), or a folder of runs (a study folder, a table folder such "
                   "as runs/femnist-table): every finished run in it is evaluated")
    s.add_argument("--data-dir", help="table runs: folder with femnist_leaf_subset.npz")
    s.add_argument("--data", metavar="PATH",
                   help="train runs: the new clients' data, read as the run's data table "
                        "reads its own (same source and options; default: the clients the "
                        "run held out, data.holdout)")
    s.add_argument("--allow-code", action="store_true",
                   help="allow the run's spec to import code (its model.name = "
                        "'module:callable')")
    s.add_argument("--finetune-epochs", type=int, help="default: the run's stage-3 epochs")
    s.add_argument("--lr", type=float, help="default: the run's stage-3 learning rate")
    s.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="print the metrics (per-client ones by client id) as JSON instead "
                        "of a table; with FILE, write them there and print the table")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(fn=_cmd_evaluate)

    s = sub.add_parser(
        "compare", help="compare finished runs (grouped by their configuration minus the "
        "seed) in a paired table with 95%% intervals and verdicts; writes compare.md and "
        "compare.png")
    s.add_argument("runs", nargs="+", metavar="RUN",
                   help="run folders, study folders (`partialfl train --seeds/--sweep`) or "
                        "table folders")
    s.add_argument("--out", help="where to write compare.md and compare.png (default: the "
                   "one folder given)")
    s.add_argument("--baseline", metavar="GROUP",
                   help="the group the others are compared with (default: the first)")
    s.set_defaults(fn=_cmd_compare)

    s = sub.add_parser("report", help="rebuild report.md and the plots of a train run "
                       "from its logs")
    s.add_argument("run", help="a `partialfl train` output folder")
    s.add_argument("--tensorboard", action="store_true",
                   help="also (re)write TensorBoard scalars to RUN/tensorboard")
    s.set_defaults(fn=_cmd_report)
