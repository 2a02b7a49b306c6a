"""``partialfl evaluate`` and ``partialfl report``: commands on finished run folders."""

from __future__ import annotations

from pathlib import Path


def _cmd_evaluate(args) -> int:
    from partialfl.pipeline.runs import evaluate_runs, evaluation_table, to_json
    from partialfl.reproductions import new_client_evaluator

    results = evaluate_runs(args.run, new_client_evaluator, args.data_dir,
                            finetune_epochs=args.finetune_epochs,
                            lr=args.lr, progress=not args.no_progress)
    if args.json is None:
        print(evaluation_table(results))
        return 0
    text = to_json(results)
    if args.json == "-":
        print(text)
    else:
        from partialfl import io as pio

        path = Path(args.json)
        pio.write_text(path, text)
        print(evaluation_table(results))
        print(f"metrics written to {path}")
    return 0


def _cmd_report(args) -> int:
    from partialfl.pipeline.train_report import write_report

    run = Path(args.run)
    if not run.is_dir():
        raise FileNotFoundError(f"run folder {run} does not exist")
    path = write_report(run, tensorboard=args.tensorboard)
    print(path.read_text())
    print(f"report and plots written to {run}/")
    return 0



def add_commands(sub) -> None:
    s = sub.add_parser(
        "evaluate",
        help="fine-tune w on new clients (writers held out of a femnist-table run) for a "
             "trained θ and report pooled accuracy and its distribution over clients")
    s.add_argument("run", help="a finished run folder, e.g. runs/femnist-table/seed0/"
                   "ffgg-output (it holds deploy.safetensors and config.json), or a whole table "
                   "folder such as runs/femnist-table: every finished run in it is evaluated")
    s.add_argument("--data-dir", help="folder with femnist_leaf_subset.npz")
    s.add_argument("--finetune-epochs", type=int, help="default: the run's stage-3 epochs")
    s.add_argument("--lr", type=float, help="default: the run's stage-3 learning rate")
    s.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="print the metrics (per-client ones by client id) as JSON instead "
                        "of a table; with FILE, write them there and print the table")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(fn=_cmd_evaluate)

    s = sub.add_parser("report", help="rebuild report.md and the plots of a train run "
                       "from its logs")
    s.add_argument("run", help="a `partialfl train` output folder")
    s.add_argument("--tensorboard", action="store_true",
                   help="also (re)write TensorBoard scalars to RUN/tensorboard")
    s.set_defaults(fn=_cmd_report)
