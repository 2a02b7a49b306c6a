"""``partialfl run`` / ``partialfl train``: one spec, a closed-form problem or a model, in
process or on Flower."""

from __future__ import annotations

import math
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

    spec = load_spec(args)
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

    out = out_dir(args.out or Path("runs") / spec.name)
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
    add_common(s)
