"""``partialfl advise TASK``: the split advisor (:mod:`partialfl.advisor`) on a table's task
(``har``, ``femnist``, ``shakespeare``, ``shakespeare-complete``: the complete works'
next-character table), with the table's model, data and stage-3 fine-tuning
settings, and its comparison with a measured table — or on a user's own train config
(``partialfl advise my_study.toml [--allow-code]``: its model, training clients, stage-1 and
stage-3 settings).

θ is a stage-1 checkpoint (``--theta runs/har-table/stage1/theta.safetensors``) or, without one, a
FedAvg pre-training of ``--pretrain-rounds`` rounds (a config: default its own
``pretrain.rounds``) with the task's stage-1 settings (written to ``OUT/stage1``). The advice
gives each top group as the split line of a train config's ``[method]`` table.

``--table`` names what was measured: a table's ``results.json`` (the FFGG rows' accuracies,
their gains over their matched baselines FedAvg + FT (same part) and over FedAvg, per seed)
or a markdown file (``docs/results.md``, accuracies) whose section heading contains
``--section``. The FFGG rows (``FFGG (input…)``, …) are matched to the advisor's groups by
split kind; for each measured quantity the Spearman correlation
(:func:`partialfl.advisor.spearman`) with the advisor's drops is reported, with whether its
top pick is within the seed spread of the best split. The table is read (a regular file, its
structure and accuracies checked: one line otherwise) before the advisor runs.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import io as pio
from partialfl.build import Task


@dataclass
class AdvisorTask:
    """What the advisor needs from a table: the pipeline task, the stage-1 config (for a
    pre-training), the stage-3 SGD settings and extra candidate groups."""

    task: Task
    stage1: Any
    lr: float
    epochs: int
    batch_size: int
    clip_norm: float | None = None
    layers: bool = True
    groups: dict[str, list[str]] = field(default_factory=dict)


def advised_tables() -> dict[str, tuple[Any, Any]]:
    """``partialfl advise`` task name → (table, its size): each table's own names
    (``Table.advise_sizes``)."""
    from partialfl.reproductions.femnist import FEMNIST
    from partialfl.reproductions.har import HAR
    from partialfl.reproductions.shakespeare import SHAKESPEARE

    return {name: (t, size) for t in (HAR, FEMNIST, SHAKESPEARE)
            for name, size in t.advise_sizes().items()}


def config_task(path: str | Path, pretrain_rounds: int | None = None) -> AdvisorTask:
    """A train config's task (:func:`partialfl.build.build`: its model, training clients,
    loss and metric), its stage 1 (``pretrain_rounds`` replacing its rounds) and stage-3
    settings. Code the config names is imported only where allowed (``--allow-code``)."""
    from partialfl.build import build
    from partialfl.pipeline.train import load_run_spec

    spec = load_run_spec(path, [] if pretrain_rounds is None else
                         [f"pretrain.rounds={pretrain_rounds}"])
    if spec.closed_form:
        raise ValueError(f"{path}: a closed-form problem has no layers to advise on; give a "
                         "model run's config")
    run = build(spec)
    ft = spec.effective().finetune
    return AdvisorTask(run.task, spec.effective(), ft.lr, ft.epochs, ft.batch_size,
                       ft.clip_norm)


def build_task(name: str, data_dir=None, pretrain_rounds: int | None = None) -> AdvisorTask:
    """The table ``name``'s task at its full size (stage 1 shortened to ``pretrain_rounds``),
    with the table's stage-3 settings and its own candidate groups; ``name`` a ``.toml``
    file: that train config's task (:func:`config_task`)."""
    if str(name).endswith(".toml"):
        return config_task(name, pretrain_rounds)
    tables = advised_tables()
    if name not in tables:
        raise ValueError(f"unknown task {name!r}; allowed: {', '.join(tables)} or a train "
                         "config (.toml)")
    table, size = tables[name]
    if pretrain_rounds is not None:
        size = replace(size, pretrain_rounds=pretrain_rounds)
    task = table.load(size, data_dir).task
    ft = table.stage_configs(size)[2]
    return AdvisorTask(task, table.config(size, table.rows[0][1], 0), ft.lr, ft.epochs,
                       ft.batch_size, ft.clip_norm, *table.advisor_groups(size))


# ----------------------------------------------------------------------------- measured tables
def measured_accuracies(path: str | Path, section: str | None = None
                        ) -> dict[str, tuple[float, float]]:
    """split kind → (mean, std) test accuracy in % of the FFGG rows of a measured table:
    a ``results.json`` of a table run, or the first markdown table after the heading
    containing ``section`` in a markdown file."""
    path = Path(path)
    out: dict[str, tuple[float, float]] = {}
    if path.suffix == ".json":
        res = _table_results(path)
        for label in res:
            m = re.match(r"FFGG \((\w+)", label)
            a = _accuracies(path, res, label)
            if m and a.size:
                out[m.group(1)] = (float(a.mean()), float(a.std()))
        return out
    try:
        text = pio.read_regular(path).decode("utf-8")
    except UnicodeDecodeError:
        raise pio.FileFormatError(f"{path} is not a text (markdown) file") from None
    if section is not None:
        idx = next((i for i, ln in enumerate(text.splitlines())
                    if ln.startswith("#") and section in ln), None)
        if idx is None:
            raise ValueError(f"{path} has no heading containing {section!r}")
        text = "\n".join(text.splitlines()[idx:])
    for ln in text.splitlines():
        m = re.match(r"\|\s*FFGG \((\w+)[^|]*\|\s*([\d.]+)(?:\s*±\s*([\d.]+))?", ln)
        if m and m.group(1) not in out:
            out[m.group(1)] = (float(m.group(2)), float(m.group(3) or 0.0))
        elif out and not ln.startswith("|"):
            break
    if not out:
        raise ValueError(f"no 'FFGG (...)' row found in {path}"
                         + (f" after {section!r}" if section else ""))
    return out


def _table_results(path: Path) -> dict[str, list]:
    """The ``results`` table (row label → list of runs) of a table's ``results.json``, read
    as a received file: a FIFO, a damaged file or another structure is a
    :class:`~partialfl.io.FileFormatError` (one line), not a hang or a traceback."""
    res = pio.read_json(path).get("results")
    if not isinstance(res, dict) or not all(isinstance(v, list) for v in res.values()):
        raise pio.FileFormatError(f"{path} has no 'results' table of row → runs: not a "
                                  "table's results.json")
    return res


def _accuracies(path: Path, res: dict[str, list], label: str) -> np.ndarray:
    """Row ``label``'s test accuracies in %, ordered by seed (none: empty); every run must be
    a table with a finite ``test_acc`` in [0, 1] and an integer ``seed`` if it has one."""
    runs = res.get(label) or []
    for r in runs:
        acc = r.get("test_acc") if isinstance(r, dict) else None
        seed = r.get("seed", 0) if isinstance(r, dict) else None
        if (isinstance(acc, bool) or not isinstance(acc, int | float)
                or not 0 <= acc <= 1 or isinstance(seed, bool) or not isinstance(seed, int)):
            raise pio.FileFormatError(
                f"{path}: a run of row {label[:60]!r} has no test_acc in [0, 1] with an "
                f"integer seed (got {str(r)[:80]}): not a table's results.json")
    runs = sorted(runs, key=lambda r: r.get("seed", 0))
    return 100 * np.asarray([r["test_acc"] for r in runs], float)


#: what the advisor's drops are compared with: the FFGG rows' accuracy, their gain over their
#: matched baseline (FedAvg + FT of the same part: does joint training add anything?) and
#: over plain FedAvg (does personalizing that part pay?)
TARGETS = {"accuracy": "test accuracy %", "matched": "FFGG − FedAvg + FT (same part), points",
           "plain": "FFGG − FedAvg, points"}


def measured_gains(path: str | Path) -> dict[str, dict[str, tuple[float, float]]]:
    """target (:data:`TARGETS`) → split kind → (mean, std over seeds) in points, from a
    table's ``results.json``: FFGG (kind)'s accuracy, its per-seed gain over FedAvg + FT
    (kind) and over FedAvg (paired by seed). A table without the matched rows gives the
    accuracy only."""
    res = _table_results(Path(path))
    out: dict[str, dict[str, tuple[float, float]]] = {t: {} for t in TARGETS}

    def acc(label):
        return _accuracies(Path(path), res, label)

    for label in res:
        m = re.fullmatch(r"FFGG \((\w+)\)", label)
        a = acc(label)
        if not m or not a.size:
            continue
        kind = m.group(1)
        out["accuracy"][kind] = (float(a.mean()), float(a.std()))
        for target, base in (("matched", f"FedAvg + FT ({kind})"), ("plain", "FedAvg")):
            b = acc(base)
            if b.size == a.size:
                d = a - b
                out[target][kind] = (float(d.mean()), float(d.std()))
    return {t: v for t, v in out.items() if v}


def compare(advice, measured: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Spearman correlation (``scipy.stats.spearmanr``) of the advisor's drops with measured
    values per split kind (accuracies or gains, ``kind -> (mean, std)``) over the kinds both
    have, and whether its top pick (among those kinds) is within the seed spread (std of the
    best kind plus that of the pick) of the best kind."""
    drops = {s.name: s.drop for s in advice.scores}
    kinds = [k for k in measured if k in drops]
    if len(kinds) < 2:
        return {"kinds": kinds, "spearman": float("nan"), "note": "fewer than 2 shared kinds"}
    from partialfl.advisor import spearman

    rho = spearman([drops[k] for k in kinds], [measured[k][0] for k in kinds])
    pick = max(kinds, key=lambda k: drops[k])
    best = max(kinds, key=lambda k: measured[k][0])
    gap = measured[best][0] - measured[pick][0]
    spread = measured[best][1] + measured[pick][1]
    return {"kinds": kinds, "spearman": rho, "advisor_pick": pick, "measured_best": best,
            "gap_points": gap, "spread_points": spread, "pick_within_spread": gap <= spread,
            "measured": {k: measured[k] for k in kinds}, "drops": {k: drops[k] for k in kinds}}


# ----------------------------------------------------------------------------- the command
def run_advisor(name: str, out_dir: str | Path, *, theta: str | Path | None = None,
                pretrain_rounds: int | None = None, clients: int = 10, data_dir=None,
                table: str | Path | None = None, section: str | None = None,
                progress: bool = True, seed: int = 0, threads: int = 1) -> Path:
    """Run the advisor on table ``name`` with ``threads`` torch/BLAS threads; writes
    ``advice.md`` (returned) and ``advice.json`` in ``out_dir``."""
    from partialfl.devices import use_threads
    from partialfl.pipeline.run_files import claim_folder

    out_dir = Path(out_dir)
    targets = None
    if table is not None:  # read (and checked) before the advisor's hour of work
        targets = (measured_gains(table) if Path(table).suffix == ".json"
                   else {"accuracy": measured_accuracies(table, section)})
    if not isinstance(clients, int) or clients < 2:  # (advise's own check, after stage 1)
        raise ValueError(f"--clients must be an integer >= 2 (the spread needs two), got "
                         f"{clients!r}")
    if theta is None and pretrain_rounds is None and not str(name).endswith(".toml"):
        raise ValueError("give --theta (a stage-1 theta.safetensors) or --pretrain-rounds N")
    use_threads(threads)  # checked here, before anything is read or written
    t0 = time.perf_counter()
    at = build_task(name, data_dir, pretrain_rounds)
    th = pio.load_tensors(theta, "θ file")[0] if theta is not None else None  # never a pickle
    if th is not None:  # the model's names and shapes, finite: checked before the claim
        from partialfl.advisor import fit_theta

        try:
            fit_theta(at.task.model_fn(0), th)
        except ValueError as e:
            raise ValueError(f"--theta {theta}: {e}") from None
    # checked, before anything is written: a new or empty folder, or the advisor's own
    claim_folder(out_dir, "advisor.json", f"advise {name}")
    pre_seconds = 0.0
    if th is None:
        tp = time.perf_counter()
        from partialfl.pipeline.stages import pretrain

        th = pretrain(at.stage1, at.task, out_dir / "stage1", progress and "stage 1 (FedAvg)")
        pre_seconds = time.perf_counter() - tp
    from partialfl.advisor import advise

    adv = advise(at.task.model_fn(0), at.task.data, th, clients=clients, epochs=at.epochs,
                 lr=at.lr, batch_size=at.batch_size, clip_norm=at.clip_norm, seed=seed,
                 loss_fn=at.task.loss_fn, metric=at.task.metric, split_fn=at.task.split_fn,
                 layers=at.layers, groups=at.groups)
    cmp = None
    if targets is not None:
        cmp = {t: compare(adv, m) for t, m in targets.items()}
    total = time.perf_counter() - t0
    lines = [f"# Split advisor on {name}", "",
             f"{len(adv.settings['clients'])} sampled clients, {at.epochs} fine-tuning epochs at "
             f"lr {at.lr} (stage 3's settings), {int(100 * adv.settings['holdout'])}% of each "
             "client's training data held out for the validation loss.", "",
             adv.table(), "", f"**Recommendation:** {adv.recommendation}.", "",
             "The top groups as the split of a train config (a line of its `[method]` "
             "table; `finetune_split` takes the same value after FedAvg):", "", "```toml",
             adv.splits(), "```", "",
             f"Cost: advisor {adv.seconds:.1f} s; pre-training {pre_seconds:.1f} s; total "
             f"{total:.1f} s ({threads} torch thread{'s' * (threads != 1)})."]
    for target, c in (cmp or {}).items():
        lines += ["", f"## Against the measured table: {TARGETS[target]}", ""]
        if "advisor_pick" not in c:
            lines.append(c["note"])
            continue
        sign = "" if target == "accuracy" else "+"
        lines += [
            f"| split | measured: {TARGETS[target]} | advisor drop |", "| --- | ---: | ---: |",
            *(f"| {k} | {c['measured'][k][0]:{sign}.2f} ± {c['measured'][k][1]:.2f} | "
              f"{c['drops'][k]:+.4f} |" for k in c["kinds"]), "",
            f"Spearman ρ = {c['spearman']:.2f} over {len(c['kinds'])} splits; advisor's pick "
            f"{c['advisor_pick']}, measured best {c['measured_best']} ({c['gap_points']:.2f} "
            f"points apart, seed spread {c['spread_points']:.2f}: "
            f"{'within' if c['pick_within_spread'] else 'NOT within'})."]
    text = "\n".join(lines) + "\n"
    path = out_dir / "advice.md"
    for p, body in ((path, text), (out_dir / "advice.json", json.dumps(
            {**adv.as_dict(), "pretrain_seconds": pre_seconds, "total_seconds": total,
             "comparison": cmp}, indent=1, default=float))):
        pio.write_text(p, body)
    return path


def add_parser(sub) -> None:
    """The ``advise`` subcommand (registered by :mod:`partialfl.cli`)."""
    s = sub.add_parser("advise", help="rank which parameters to personalize for a table's "
                       "task (split advisor)")
    s.add_argument("task", help="the table whose task to advise on (har, femnist, shakespeare, "
                   "shakespeare-complete) or a train config (.toml)")
    s.add_argument("--allow-code", action="store_true",
                   help="a config's model may be code ('module:callable'; modules beside the "
                        "config are found)")
    s.add_argument("--theta", help="a stage-1 theta.safetensors (pre-trained parameters)")
    s.add_argument("--pretrain-rounds", type=int, help="without --theta: FedAvg rounds")
    s.add_argument("--clients", type=int, default=10, help="clients sampled (default 10)")
    s.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch/BLAS threads (default 1, a run spec's default; on an idle "
                        "machine more can be faster: HAR, 10 clients, 2 cores: 6.9 s on 1, "
                        "4.7-6.4 s on 2)")
    s.add_argument("--table", help="measured table: a table's results.json (accuracies and "
                   "the gains over the matched baseline and over FedAvg) or a markdown file "
                   "(accuracies)")
    s.add_argument("--section", help="heading text of the table's section in --table")
    s.add_argument("--out", help="output folder (default runs/advise-TASK)")
    s.add_argument("--data-dir", type=Path)
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=_cmd)


def _cmd(args) -> int:
    from partialfl.build import allow_code, config_folder_on_path

    out = Path(args.out or Path("runs") / f"advise-{Path(args.task).stem}")
    if args.allow_code and args.task.endswith(".toml"):
        config_folder_on_path(Path(args.task).parent)
    with allow_code(args.allow_code or None):
        path = run_advisor(args.task, out, theta=args.theta,
                           pretrain_rounds=args.pretrain_rounds, clients=args.clients,
                           data_dir=args.data_dir, table=args.table, section=args.section,
                           progress=not args.no_progress, threads=args.threads)
    print(path.read_text())
    return 0
