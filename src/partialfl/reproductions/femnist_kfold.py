"""New-client evaluation of the FEMNIST table by k-fold over writers (``partialfl reproduce
femnist-kfold``, ``femnist-table --folds K``): the writers are split into K groups; for each,
stage 1 and every method's stages 2-3 train on the other writers and the group's writers are
evaluated as new clients, so every writer is a new client exactly once. The table's methods,
stage settings and task come from the table object (:data:`partialfl.reproductions.femnist.
FEMNIST`), passed in."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from partialfl import io as pio
from partialfl.data.femnist import normalised_split, raw_writers
from partialfl.pipeline.jobs import run_jobs
from partialfl.pipeline.report import (
    jsonable,
    markdown_table,
    matched_section,
    paired_section,
    quick_note,
)


def writer_folds(data_dir=None, folds: int = 5, num_writers: int | None = None,
                 seed: int = 0) -> list[list[str]]:
    """The writer ids of each of ``folds`` groups (``FederatedDataset.client_folds``) of the
    file's writers (or of the ``num_writers`` subset that the table would keep)."""
    raw = raw_writers(data_dir, num_writers, seed)
    return [[raw.client_ids[i] for i in part] for part in raw.client_folds(folds, seed)]


def load_fold(data_dir, new_ids, num_writers: int | None = None, seed: int = 0):
    """``(train_clients, new_clients, info)`` with exactly the writers ``new_ids`` held out
    (one fold of :func:`writer_folds`), normalised with the other writers' pixel stats."""
    return normalised_split(data_dir, raw_writers(data_dir, num_writers, seed), new_ids)


#: default number of folds of the k-fold new-writer evaluation (every writer is new once)
DEFAULT_FOLDS = 5
#: the rows the k-fold evaluation compares by default: the new-writer claim of the table
KFOLD_METHODS = ("FedAvg", "FedAvg + FT (adapter)", "FFGG (adapter)")

_FOLD_DATA: dict = {}


def _fold_data(data_dir, size, new_ids: tuple[str, ...]):
    key = (str(data_dir), size.num_writers, new_ids)
    if key not in _FOLD_DATA:
        _FOLD_DATA.clear()
        _FOLD_DATA[key] = load_fold(data_dir, new_ids, size.num_writers)
    return _FOLD_DATA[key]


def _kfold_size(size):
    """The table's size with stage-2 evaluations only at the start and end (the learning
    curves are not needed; training is unchanged) and no extra held-out group."""
    return replace(size, eval_every=0, holdout=0)


def _kfold_fold(job: tuple) -> dict:
    """One fold, in one worker: stage 1 on the other folds' writers, then every (method,
    seed) run of the fold (:func:`_kfold_run`); so folds finish one by one and a cut-short
    evaluation still leaves whole folds."""
    import torch

    from partialfl.pipeline.stages import pretrain

    table, out_dir, data_dir, size, fold, new_ids, methods, progress = job
    torch.set_num_threads(size.threads)
    train, _, _ = _fold_data(data_dir, size, new_ids)
    t0 = time.perf_counter()
    pretrain(table.config(size, table.rows[0][1], size.seeds[0]), table.task_of(train),
             out_dir / f"fold{fold}" / "stage1", progress and f"fold {fold} stage 1")
    stage1 = time.perf_counter() - t0
    runs = [_kfold_run((table, out_dir, data_dir, size, fold, new_ids, seed, label, progress))
            for label in methods for seed in size.seeds]
    return {"fold": fold, "stage1_seconds": stage1, "runs": runs,
            "seconds": time.perf_counter() - t0}


def _kfold_run(job: tuple) -> dict:
    """Stages 2-3 of one (fold, method, seed) and the fold's writers evaluated as new clients
    (fine-tuning w on the trained θ); cached in the run folder's ``new_clients.json``."""
    import torch

    from partialfl.pipeline.evaluation import evaluate_run
    from partialfl.pipeline.stages import run_pipeline

    table, out_dir, data_dir, size, fold, new_ids, seed, label, progress = job
    torch.set_num_threads(size.threads)
    method = dict(table.rows)[label]
    run_dir = out_dir / f"fold{fold}" / f"seed{seed}" / method.name
    cache = run_dir / "new_clients.json"
    if cache.exists():
        return json.loads(cache.read_text())
    train, new, _ = _fold_data(data_dir, size, new_ids)
    t0 = time.perf_counter()
    task = table.task_of(train)
    owner = table.stage2_owner(size, label)  # FedAvg + FT: FedAvg's stage 2
    res = run_pipeline(table.config(size, method, seed), task, run_dir,
                       stage1_dir=out_dir / f"fold{fold}" / "stage1",
                       stage2_dir=None if owner == label else
                       out_dir / f"fold{fold}" / f"seed{seed}" / dict(table.rows)[owner].name,
                       progress=progress and f"fold {fold} {label} seed {seed}")
    ev = evaluate_run(run_dir, new, model_fn=task.model_fn)["test"]
    m = res.metrics
    out = {"fold": fold, "seed": seed, "label": label,
           "new": {"client_ids": list(new.client_ids),
                   "correct": ev.per_client_correct, "total": ev.per_client_total},
           "seen": {"client_ids": m["client_ids"], "correct": m["per_client_test_correct"],
                    "total": m["per_client_test_total"]},
           "seconds": time.perf_counter() - t0}
    out = jsonable(out)
    pio.write_json(cache, out)
    return out


def kfold_new_writers(table, out_dir: Path, *, folds: int = DEFAULT_FOLDS,
                      methods: tuple[str, ...] = KFOLD_METHODS, quick: bool = False,
                      seeds: list[int] | None = None, data_dir: Path | None = None,
                      progress: bool = True, size=None) -> Path:
    """New-writer evaluation by k-fold over writers: the writers are split into ``folds``
    groups (:func:`writer_folds`); for each fold, stage 1 (shared by the fold's methods and
    seeds only) and stages 2-3 of every method in ``methods`` (row labels of ``table``)
    train on the other writers, and the fold's writers are evaluated as new clients
    (fine-tuning their w for the stage-3 epochs on the trained θ). Every writer is a new
    client exactly once. Writes ``kfold.json`` (per-writer correct / total of every method,
    seed and fold; fold assignment; measured times) and ``summary.md`` (pooled new-writer
    accuracy with its bootstrap interval, paired differences vs FedAvg, verdicts, power).
    Resumable: every stage and every new-writer evaluation is cached."""
    import torch

    size = _kfold_size(size or (table.QUICK if quick else table.FULL))
    if seeds:
        size = replace(size, seeds=tuple(int(s) for s in seeds))
    unknown = [m for m in methods if m not in dict(table.rows)]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; allowed: {', '.join(dict(table.rows))}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = writer_folds(data_dir, folds, size.num_writers)
    _claim_folds(out_dir, groups)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(size.threads)
    t_start = time.perf_counter()
    try:
        verbose = progress  # per-run bars (interleaved when workers > 1; fine in a log)
        done = run_jobs(_kfold_fold, [(table, out_dir, data_dir, size, k, tuple(g),
                                       tuple(methods),
                                       verbose) for k, g in enumerate(groups)],
                        size.workers, progress and "k-fold folds")
        runs = [r for d in done for r in d["runs"]]
        s1 = {d["fold"]: d["stage1_seconds"] for d in done}
        fold_seconds = {d["fold"]: d["seconds"] for d in done}
        seconds = time.perf_counter() - t_start
        record = {"folds": groups, "methods": list(methods), "seeds": list(size.seeds),
                  "matched": table.matched(methods),
                  "runs": sorted(runs, key=lambda r: (r["fold"], r["label"], r["seed"])),
                  "stage1_seconds": s1, "fold_seconds": fold_seconds,
                  "total_seconds": seconds,
                  "workers": size.workers, "threads": size.threads,
                  "size": {"pretrain_rounds": size.pretrain_rounds, "rounds": size.rounds,
                           "finetune_epochs": size.finetune_epochs,
                           "num_writers": size.num_writers}}
        pio.write_json(out_dir / "kfold.json", jsonable(record))
        path = out_dir / "summary.md"
        pio.write_text(path, kfold_summary(record, quick=quick))
        return path
    finally:
        torch.set_num_threads(old_threads)


def _claim_folds(out_dir: Path, groups) -> None:
    """Record the folds' writers in ``out_dir/folds.json``, or refuse (ConfigError) a folder
    whose cached stages and evaluations were made for other folds (a rerun with another
    ``--folds`` or data returned them as this one's)."""
    from partialfl.config import ConfigError

    path, want = out_dir / "folds.json", [[str(w) for w in g] for g in groups]
    if path.exists():
        if pio.read_json(path).get("folds") != want:
            raise ConfigError(f"{out_dir} holds a k-fold evaluation of other folds (its "
                              "folds.json); give another --out, or delete that folder")
    elif any(out_dir.glob("fold*")):  # made before folds.json was kept: fold layout unknown
        raise ConfigError(f"{out_dir} holds fold folders without folds.json (of an older "
                          "run); give another --out, or delete that folder")
    else:
        pio.write_json(path, {"folds": want})


def collect_kfold(table, out_dir: Path, *, folds: int = DEFAULT_FOLDS,
                  methods: tuple[str, ...] = KFOLD_METHODS, seeds: tuple[int, ...] = (0,),
                  data_dir: Path | None = None, num_writers: int | None = None) -> dict:
    """The record :func:`kfold_new_writers` writes, rebuilt from the cached per-run
    ``new_clients.json`` files of ``out_dir`` (also while the evaluation is still running or
    after it was cut short: :func:`kfold_summary` then uses the folds whose runs all exist)."""
    out_dir = Path(out_dir)
    groups = writer_folds(data_dir, folds, num_writers)
    runs, s1 = [], {}
    for k in range(folds):
        t = out_dir / f"fold{k}" / "stage1" / "timing.json"
        if t.exists():
            s1[k] = json.loads(t.read_text())["seconds"]
        for label in methods:
            for seed in seeds:
                f = (out_dir / f"fold{k}" / f"seed{seed}" / dict(table.rows)[label].name
                     / "new_clients.json")
                if f.exists():
                    runs.append(json.loads(f.read_text()))
    return {"folds": groups, "methods": list(methods), "seeds": list(seeds), "runs": runs,
            "matched": table.matched(methods),
            "stage1_seconds": s1, "total_seconds": None}


def kfold_summary(record: dict, *, quick: bool = False) -> str:
    """Markdown summary of a k-fold new-writer evaluation record (see
    :func:`kfold_new_writers`): pooled new-writer accuracy of every method over all writers
    of the complete folds, paired intervals and verdicts vs FedAvg, per-fold numbers, cost."""
    groups, methods, seeds = record["folds"], record["methods"], record["seeds"]
    by = {(r["fold"], r["label"], r["seed"]): r for r in record["runs"]}
    complete = [k for k in range(len(groups))
                if all((k, m, s) in by for m in methods for s in seeds)]
    k_all = len(groups)
    lines = [f"# femnist k-fold new-writer evaluation{' (quick)' if quick else ''}", ""]
    if quick:
        lines += [quick_note(f"{len(groups)} folds of {sum(map(len, groups))} writers, "
                             f"{len(seeds)} seed(s)"), ""]
    if not complete:
        return "\n".join(lines + ["No fold has finished yet.", ""])
    counts = {}
    for label in methods:
        c = [[v for k in complete for v in by[(k, label, s)]["new"]["correct"]] for s in seeds]
        t = [[v for k in complete for v in by[(k, label, s)]["new"]["total"]] for s in seeds]
        ids = [w for k in complete for w in by[(k, label, seeds[0])]["new"]["client_ids"]]
        counts[label] = (np.asarray(c, float), np.asarray(t, float), ids)
    n_writers = sum(len(groups[k]) for k in complete)
    n_all = sum(len(g) for g in groups)
    done = "all folds" if len(complete) == k_all else f"folds {complete} of {k_all} finished"
    lines += [
        f"{k_all} folds over {n_all} writers (every writer is a new client in exactly one "
        f"fold); {done}: {n_writers} writers evaluated as new clients; seeds {list(seeds)}. "
        "In each fold, "
        "FedAvg pre-training (stage 1, shared by the fold's methods only) and each method's "
        "stages 2-3 train on the other folds' writers; then the fold's writers fine-tune "
        "their personal parameters on the trained θ (FedAvg + FT: the part it fine-tunes) "
        "for the stage-3 epochs and are tested.",
        "",
        *(matched_section(counts, record["matched"], unit="images", clients="new writers",
                          verdict=not quick) + [""] if record.get("matched") else []),
        *paired_section(counts, "FedAvg" if "FedAvg" in counts else methods[0],
                        unit="images", clients="new writers", verdict=not quick),
        "",
        "Per fold (new-writer pooled accuracy %, seed mean):",
        "",
    ]
    rows = []
    for k in complete:
        cells = []
        for label in methods:
            rs = [by[(k, label, s)]["new"] for s in seeds]
            cells.append(f"{100 * np.mean([sum(r['correct']) / sum(r['total']) for r in rs]):.2f}")
        rows.append([k, len(groups[k]), int(sum(by[(k, methods[0], seeds[0])]["new"]["total"])),
                     *cells])
    lines += [markdown_table(["fold", "new writers", "test images", *methods], rows), ""]
    base = "FedAvg" if "FedAvg" in methods else methods[0]
    for k in complete:
        seen = {}
        for label in methods:
            rs = [by[(k, label, s)]["seen"] for s in seeds]
            seen[label] = (np.asarray([r["correct"] for r in rs], float),
                           np.asarray([r["total"] for r in rs], float), rs[0]["client_ids"])
        lines += [f"Fold {k}, its {len(seen[base][2])} training writers (their own test "
                  "images, after stage 3):", "",
                  *paired_section(seen, base, unit="images", clients="training writers",
                                 explain=False, verdict=not quick), ""]
    s1 = record.get("stage1_seconds", {})
    s1 = {int(k): v for k, v in s1.items()}
    run_s = [r["seconds"] for r in record["runs"] if r["fold"] in complete]
    cost = [f"Cost (measured): stage 1 {sum(s1.get(k, 0) for k in complete) / 60:.1f} min "
            f"for {len(complete)} fold(s), stages 2-3 + new-writer evaluation "
            f"{sum(run_s) / 60:.1f} min for {len(run_s)} runs (wall-clock "
            "time of each job, 1 torch thread)"]
    if record.get("total_seconds"):
        cost.append(f"; wall-clock {record['total_seconds'] / 60:.1f} min with "
                    f"{record.get('workers', 1)} worker process(es)")
    lines += ["".join(cost) + ". A single held-out group needs one stage 1 per table; "
              f"k-fold needs one per fold ({k_all}×) and every method's stage 2 per fold.", ""]
    return "\n".join(lines)
