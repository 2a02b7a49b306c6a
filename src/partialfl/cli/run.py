"""``partialfl run`` / ``partialfl train``: one spec, a closed-form problem or a model, in
process or on Flower."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from partialfl.cli.common import add_common, load_spec, out_dir
from partialfl.config import ConfigError


def _diverged(record: dict) -> list[str]:
    """The metrics of ``record`` that are not finite, but for the privacy bookkeeping
    (``dp_epsilon``, ``dp_clip_norm`` are ∞ without noise or clipping)."""
    return [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)
            and not k.startswith("dp_")]


def _cmd_run(args) -> int:
    """``partialfl run`` / ``partialfl train``: one spec, a closed-form problem or a model."""
    from partialfl.build import allow_code
    from partialfl.devices import use_threads

    spec = load_spec(args)
    use_threads(spec.threads)  # every local run, closed forms too (numpy's BLAS pools)
    if args.engine == "local" and (args.superlink or args.root_certificates):
        raise ConfigError("--superlink / --root-certificates need --engine flower")
    if args.engine == "local" and args.flower:
        raise ConfigError("--flower applies to --engine flower-sim / flower")
    if args.supernodes < 1:
        raise ConfigError(f"--supernodes must be >= 1, got {args.supernodes}")
    study = args.seeds is not None or args.sweep
    if args.jobs is not None and not study:
        raise ConfigError("--jobs applies to a study (--seeds / --sweep)")
    if args.jobs is not None and args.jobs < 1:  # before a dry run says the plan is fine
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    if study and (spec.closed_form or args.engine != "local"):
        raise ConfigError("--seeds / --sweep run a model config in-process (not a closed-form "
                          "problem or --engine flower*)")
    if not args.dry_run:
        _clean_interrupted(out_dir(args.out or Path("runs") / spec.name), spec, study)
    with allow_code(args.allow_code or None):
        if spec.closed_form:
            return _run_closed_form(args, spec)
        if study:
            return _run_study(args, spec)
        return _run_model(args, spec)


def _clean_interrupted(out: Path, spec, study: bool) -> None:
    """Before a run resumes in ``out``, remove the temporary files its killed writes left
    there (a kill -9 during a plot or report write once left them for good; checkpoints
    clean their own) — only in a folder of this kind of run, by its marks: an unfinished
    model run's (its record of the files already there, or its spec), its tree but the
    user's own entries (``preexisting.json``); a closed-form run's log, only the temporary
    files of its own three files (its folder may hold others' writes; one holding another
    command's record is refused later, untouched). A study cleans its folder once it has
    accepted it (:func:`partialfl.pipeline.study.run_study`)."""
    from partialfl import io as pio

    if study or not out.is_dir():
        return
    from partialfl.pipeline.run_files import PREEXISTING, RECORDS, RUN_FILES, user_entries

    def marked(*marks: str) -> bool:  # a mark, or only a killed write of it
        return any((out / f).is_file() or any(out.glob(f".{f}.*.tmp")) for f in marks)

    if spec.closed_form:
        own = (f"{spec.name}.jsonl", f"{spec.name}.png", "summary.md")
        if marked(own[0]) and not any(os.path.lexists(out / r) for r in RECORDS):
            pio.clean_stale_writes(out, recursive=False, targets=own)
    elif marked(PREEXISTING, "spec.json") and not (out / RUN_FILES).exists():
        # (a finished run has nothing to resume: its rerun is refused, or --overwrite
        pio.clean_stale_writes(out, skip=user_entries(out))  # deletes only its files)


def _run_study(args, spec) -> int:
    """``train CONFIG --seeds … --sweep …``: every run in its sub-folder of the study folder."""
    from partialfl.build import build
    from partialfl.pipeline.study import check_study, parse_sweep, run_study
    from partialfl.pipeline.train import format_plan

    out = out_dir(args.out or Path("runs") / spec.name)
    sweep = parse_sweep(args.sweep or [])
    seeds = args.seeds if args.seeds is not None else [spec.seed]
    sets = list(args.set or []) + ([f"threads={args.threads}"] if args.threads else [])
    runs = check_study(args.config, seeds, sweep, sets, device=args.device,
                       allow_code=bool(args.allow_code))
    print(format_plan(build(spec).plan), flush=True)
    print(f"study      {len(runs)} runs (seeds {' '.join(map(str, seeds))}"
          + "".join(f"; {k} = {', '.join(v)}" for k, v in sweep.items())
          + f") into {out}/, {args.jobs or 'one per core'} worker processes", flush=True)
    if args.dry_run:
        print("\n".join(f"  {out / r['folder']}" for r in runs))
        print("dry run: nothing trained, nothing written")
        return 0
    done = run_study(args.config, out, seeds=seeds, sweep=sweep, sets=sets, jobs=args.jobs,
                     overwrite=args.overwrite, device=args.device,
                     allow_code=bool(args.allow_code))
    for d in done:
        new = d["new_clients_test_acc"]
        print(f"{d['folder']}: test accuracy {100 * d['test_acc']:.2f}%"
              + ("" if new is None else f", new clients {100 * new:.2f}%")
              + (" (diverged)" if d["diverged"] else ""))
    print(f"study written to {out}/ (study.json, one folder per run); compare the runs with "
          f"`partialfl compare {out}`")
    bad = [d for d in done if d["diverged"]]
    for d in bad:
        print(f"partialfl: warning: {d['folder']}: {d['diverged']}", file=sys.stderr)
    return 1 if bad else 0


def _flower_options(args) -> dict:
    from partialfl.config import apply_overrides

    flower = apply_overrides({}, list(args.flower or []))
    bad = [k for k, v in flower.items() if isinstance(v, dict)]
    if bad:
        raise ConfigError(f"--flower {bad[0]}: Flower's own keys are not tables (spec keys "
                          "go in --set)")
    ours = [k for k in flower if k.replace("_", "-") in ("spec", "stage", "init-from", "set",
                                                         "out-dir")]
    if ours:  # --flower spec=… was a TypeError traceback; out-dir= was silently replaced
        raise ConfigError(f"--flower {ours[0]}: partialfl sets this key itself from the config, "
                          "its stages and --out (spec keys go in --set)")
    return {"engine": args.engine, "num_supernodes": args.supernodes,
            "superlink": args.superlink, "root_certificates": args.root_certificates,
            "progress": not args.no_progress, "flower": flower}


def _run_closed_form(args, cfg) -> int:
    from partialfl.pipeline.closed_form import run_and_report

    out = out_dir(args.out or Path("runs") / cfg.name)
    if args.dry_run:
        from partialfl.build import build

        run = build(cfg)
        if args.engine != "local":  # what the Flower run would refuse, refused now
            from partialfl.flower.train import check_flower_run

            check_flower_run(run, _flower_options(args)["flower"], args.supernodes)
        print(run.plan)
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
    lost = {k: last[k] for k in ("clients_failed", "updates_nonfinite", "updates_refused",
                                 "worker_deaths") if last.get(k)}
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
    from partialfl.pipeline.study import heartbeat
    from partialfl.pipeline.train import claim_out, format_plan, run_built, run_train

    out = out_dir(args.out or Path("runs") / spec.name)
    if args.engine != "local":
        from partialfl.flower.train import run_flower_train

        res = run_flower_train(spec, out, dry_run=args.dry_run, config=args.config,
                               overwrite=args.overwrite, **_flower_options(args))
        print(res)
        return 0 if args.dry_run else diverged_status(out)
    run, _ = run_train(spec, dry_run=True)  # built: a bad config fails before any write
    print(format_plan(run.plan), flush=True)  # the plan first, then the (long) training
    if args.dry_run:
        print("dry run: nothing trained, nothing written")
        return 0
    claim_out(out, args.overwrite, spec)
    hook = heartbeat(spec.name) if args.no_progress else None
    metrics = run_built(run, out, progress=False if args.no_progress else None, on_round=hook,
                        config=args.config)
    print(f"test accuracy {100 * metrics['test_acc']:.2f}% (per-client p10/p50/p90 "
          f"{100 * metrics['test_acc_p10']:.1f}/{100 * metrics['test_acc_p50']:.1f}/"
          f"{100 * metrics['test_acc_p90']:.1f}%)")
    if "new_clients" in metrics:
        print(f"new clients: test accuracy {100 * metrics['new_clients']['test_acc']:.2f}%")
    print(f"results written to {out}/ (report.md, metrics.json, *.jsonl, *.png)")
    return diverged_status(out, metrics)


def diverged_status(out: Path, metrics: dict | None = None) -> int:
    """A finished model run's exit status: 1 with a warning on stderr when it diverged
    (:func:`~partialfl.pipeline.train_report.divergence_line` of its metrics, read from
    ``out/metrics.json`` if not given), else 0 — whatever engine trained it."""
    from partialfl import io as pio
    from partialfl.pipeline.train_report import divergence_line

    why = divergence_line(pio.read_json(out / "metrics.json") if metrics is None else metrics)
    if why:
        print(f"partialfl: warning: {why}", file=sys.stderr)
        return 1
    return 0


def add_commands(sub) -> None:
    for cmd, text in (("run", "run a TOML run spec: a closed-form problem (writes NAME.jsonl, "
                              "a plot and summary.md) or a model (as train)"),
                      ("train", "train a model (or run a closed-form problem) from a TOML run "
                                "spec (see configs/, configs/train/)")):
        s = sub.add_parser(cmd, help=text)
        _add_run_args(s)
        s.set_defaults(fn=_cmd_run)


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
    s.add_argument("--seeds", type=int, nargs="+", metavar="S",
                   help="a study: one run per seed, each in OUT/seed=S (see --sweep)")
    s.add_argument("--sweep", action="append", metavar="KEY=V1,V2",
                   help="a study: one run per value (repeatable: the grid of all values) "
                        "and seed, each in OUT/KEY=V,seed=S; study.json lists them; compare "
                        "them with `partialfl compare OUT`")
    s.add_argument("--jobs", type=int, metavar="N",
                   help="a study's worker processes (default: one per core, at most one per "
                        "run); a run's results do not depend on it")
    s.add_argument("--overwrite", action="store_true",
                   help="delete a finished run in --out and run it again (default: a "
                        "finished run is refused, an unfinished one resumes)")
    add_common(s)
