"""The one driver of the reproduction tables (FEMNIST, HAR, Shakespeare).

A table is its data, its methods, its sizes and its own summary text: a subclass of
:class:`Table` gives :meth:`Table.load` (the pipeline task, the held-out new clients and what
``data.json`` records), :meth:`Table.stage_configs` (stage 1, stage 2 of a method, stage 3),
``rows`` (label, :class:`~partialfl.spec.MethodConfig`), the sizes ``QUICK`` / ``FULL`` /
``PLATEAU`` (:class:`TableSize` subclasses) and the summary's own paragraphs. Everything else
is here, once: stage 1 shared by every row and seed, the (rows, seed) jobs in worker
processes (:func:`partialfl.pipeline.jobs.run_jobs`), new-client evaluation, ``results.json``,
the plots and the summary's skeleton (table, verdicts, paired sections, budgets, cost).

**Matched baselines** (:mod:`partialfl.reproductions.matched`): every row that trains a
personal part jointly with θ gets "FedAvg + FT (part)", FedAvg followed by fine-tuning of the
same part; the summary compares each row with its matched row (paired over clients × seeds)
and with plain FedAvg.

Rows whose stage 2 is the same computation (:func:`partialfl.pipeline.stages.stage2_identity`:
FedAvg, then fine-tuning of different parts) run as one job and share one stage 2, so adding
a "FedAvg + FT" row costs a stage 3, not another stage 2; the numbers are those of separate
runs (every random draw derives from (seed, purpose, round, client)).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from partialfl import io as pio
from partialfl.build import Task
from partialfl.pipeline.files import check_or_write_json, write_json
from partialfl.pipeline.jobs import run_jobs
from partialfl.pipeline.report import (
    accuracy_cells,
    counts_from_runs,
    jsonable,
    markdown_table,
    matched_section,
    paired_section,
    percent_mean_std,
    pipeline_plots,
    quick_note,
    versus_baselines,
)
from partialfl.pipeline.stopping import budget_plot, plateau_settings, plateau_table
from partialfl.reproductions.matched import matched_label, matched_method, with_matched
from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, StageConfig


@dataclass(frozen=True, kw_only=True)
class TableSize:
    """What every table's size has: stage-1 and stage-2 rounds (caps under the plateau
    rule), stage-2 evaluations (0: first and last round only), stage-3 epochs, seeds, torch
    threads of each run, worker processes; ``plateau``: a
    :func:`~partialfl.pipeline.stopping.plateau_settings` tuple (stage budgets by the plateau
    rule, stage 3 chosen on validation data) or None (fixed budgets); ``methods``: the row
    labels to run (None: all)."""

    pretrain_rounds: int
    rounds: int
    eval_every: int
    finetune_epochs: int
    seeds: tuple[int, ...]
    threads: int
    workers: int
    plateau: tuple | None = None
    methods: tuple[str, ...] | None = None


@dataclass
class Loaded:
    """A table's data: the pipeline ``task`` (training clients), the held-out ``new``
    clients (or None), ``info``, what ``data.json`` records (the clients, statistics), and
    ``pretrain_task``, the task stage 1 trains on (None: ``task``; e.g. public clients)."""

    task: Task
    new: Any
    info: dict[str, Any]
    pretrain_task: Task | None = None


@dataclass
class TableRun:
    """A finished (or resumed) table: what its summary is written from."""

    size: TableSize
    results: dict[str, list[dict]]
    timings: dict[str, float]
    seconds: float
    quick: bool
    info: dict[str, Any]
    stage1_threads: int = 1
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


_LOADED: dict = {}


class Table:
    """One reproduction table (see the module docstring); subclasses set the class
    attributes and the methods marked "a table's own"."""

    #: the reproduction's name (``partialfl reproduce NAME``) and the summary's title
    name = "table"
    title = ""
    #: the table's own (row label, method), in order; :attr:`rows` adds the matched baselines
    own_rows: tuple[tuple[str, MethodConfig], ...] = ()
    #: the paper's claim on the best split's margin over FedAvg (None: no such claim)
    claim_margin: float | None = None
    #: sizes: CI, the full table, the table at convergence (``--plateau``; None: the full
    #: size with the plateau rule added)
    QUICK: TableSize
    FULL: TableSize
    PLATEAU: TableSize | None = None
    #: what a client is and what its test examples are ("writers", "images")
    clients = "clients"
    unit = "examples"
    #: stage 1 with ``threads × workers`` torch threads (it runs alone, before the workers)
    parallel_stage1 = False

    # ------------------------------------------------------------------ a table's own
    def load(self, size: TableSize, data_dir=None, **options: Any) -> Loaded:
        """The table's data at ``size`` (a table's own)."""
        raise NotImplementedError

    def stage_configs(self, size: TableSize) -> tuple[StageConfig, Callable[[MethodConfig],
                                                                              StageConfig],
                                                      FinetuneConfig]:
        """(stage 1, stage 2 of a method, stage 3) at ``size`` (a table's own)."""
        raise NotImplementedError

    def full_sizes(self) -> tuple[TableSize, ...]:
        """The sizes whose summaries give verdicts (any seeds, threads and workers)."""
        return tuple(s for s in (self.FULL, self.PLATEAU) if s is not None)

    def intro(self, run: TableRun) -> list[str]:
        """The summary's first paragraph: clients, data, seeds (a table's own)."""
        return []

    def size_note(self, run: TableRun) -> str:
        """What a reduced size is, for the quick-run note (a table's own)."""
        s = run.size
        return f"{s.pretrain_rounds} + {s.rounds} rounds, {len(s.seeds)} seed(s)"

    def verdicts(self, run: TableRun) -> list[str]:
        """The bullets under the table: point estimates against FedAvg and against each
        row's matched baseline, the paper's claims (:func:`~partialfl.pipeline.report.
        versus_baselines`)."""
        done = [k for k, v in run.results.items() if v]
        counts = {label: counts_from_runs(run.results[label]) for label in done}
        return versus_baselines(run.results, self.matched(done), self.claim_margin,
                                verdict=self.is_full(run.size), counts=counts)

    def stages_text(self, run: TableRun) -> list[str]:
        """The paragraph on the three stages' settings (a table's own)."""
        return []

    def closing(self, run: TableRun) -> list[str]:
        """The last section: deviations from the paper, or the set-up (a table's own)."""
        return []

    def extra_plots(self, out_dir: Path, run: TableRun) -> list[str]:
        """More plots than the learning curves and the per-client CDF; returns their
        descriptions for the summary."""
        return []

    def advise_sizes(self) -> dict[str, TableSize]:
        """``partialfl advise NAME`` → the size whose task the advisor reads (none: {})."""
        return {}

    def advisor_groups(self, size: TableSize) -> tuple[bool, dict[str, list[str]]]:
        """(whether the advisor scores every layer, extra candidate groups by regexes)."""
        return True, {}

    def data_record(self, size: TableSize, loaded: Loaded) -> dict[str, Any]:
        """What ``data.json`` holds (a resumed table must match it)."""
        return loaded.info

    # ------------------------------------------------------------------ shared
    @property
    def rows(self) -> tuple[tuple[str, MethodConfig], ...]:
        """Every row: the table's own and their matched baselines (:func:`with_matched`)."""
        return with_matched(self.own_rows)

    def matched(self, labels) -> dict[str, str]:
        """Row label → the label of its matched baseline, for the rows among ``labels``
        that have one there."""
        rows = dict(self.rows)
        out = {}
        for label in labels:
            m = matched_method(rows[label]) if label in rows else None
            base = matched_label(rows[label]) if m is not None else None
            if base in labels:
                out[label] = base
        return out

    def methods(self, size: TableSize) -> tuple[tuple[str, MethodConfig], ...]:
        """The rows run at ``size`` (``size.methods``: a subset by label)."""
        if size.methods is None:
            return self.rows
        labels = [m for m, _ in self.rows]
        bad = [m for m in size.methods if m not in labels]
        if bad:
            raise ValueError(f"unknown methods {bad}; allowed: {', '.join(labels)}")
        return tuple(m for m in self.rows if m[0] in size.methods)

    def config(self, size: TableSize, method: MethodConfig, seed: int,
               backend: str = "sequential", device: str = "cpu") -> RunSpec:
        """The pipeline spec of one (method, seed) of the table (stage 1 from seed 0), run
        with ``backend`` on ``device``."""
        pre, stage2, ft = self.stage_configs(size)
        val, grid = size.plateau[2:] if size.plateau else (None, None)
        return RunSpec(method=method, pretrain=pre, personalize=stage2(method), finetune=ft,
                       seed=seed, pretrain_seed=0, backend=backend, device=device,
                       validation=val, finetune_grid=grid)

    def stage1_config(self, size: TableSize, backend: str = "sequential",
                      device: str = "cpu") -> RunSpec:
        """The spec stage 1 (shared by every row and seed) runs with: the first row's."""
        return self.config(size, self.rows[0][1], size.seeds[0], backend, device)

    def stage1_dir(self, out_dir: Path) -> Path:
        """The folder of the shared stage 1."""
        return Path(out_dir) / "stage1"

    def is_full(self, size: TableSize) -> bool:
        """Whether ``size`` is one whose summary gives verdicts (:meth:`full_sizes`)."""
        return any(replace(size, seeds=s.seeds, threads=s.threads, workers=s.workers) == s
                   for s in self.full_sizes())

    def size_of(self, quick: bool, plateau: bool, size: TableSize | None,
                seeds: Sequence[int] | None, **options: Any) -> TableSize:
        """The size a ``reproduce`` call runs: ``size``, else QUICK / PLATEAU / FULL; with
        ``plateau`` the rounds become caps of the plateau rule; ``seeds`` replace its
        seeds."""
        if size is None:
            size = (self.QUICK if quick else
                    self.PLATEAU if plateau and self.PLATEAU is not None else self.FULL)
        if plateau and size.plateau is None:
            size = replace(size, plateau=plateau_settings(quick=quick))
        if seeds:
            size = replace(size, seeds=tuple(int(s) for s in seeds))
        return size

    def loaded(self, size: TableSize, data_dir=None, **options: Any) -> Loaded:
        """:meth:`load`, once per process (worker processes load it from their first job)."""
        key = (self.name, replace(size, seeds=(), threads=0, workers=0),
               str(data_dir), tuple(sorted((k, str(v)) for k, v in options.items())))
        if key not in _LOADED:
            _LOADED.clear()
            _LOADED[key] = self.load(size, data_dir, **options)
        return _LOADED[key]

    def groups(self, size: TableSize, backend: str = "sequential") -> list[list[str]]:
        """The row labels of each job: rows whose stage 2 is the same computation (the same
        :func:`~partialfl.pipeline.stages.stage2_identity`) share one, in row order."""
        from partialfl.pipeline.stages import stage2_identity

        out: dict[str, list[str]] = {}
        for label, method in self.methods(size):
            key = json.dumps(stage2_identity(self.config(size, method, 0, backend).identity()),
                             sort_keys=True, default=str)
            out.setdefault(key, []).append(label)
        return list(out.values())

    def stage2_owner(self, size: TableSize, label: str) -> str:
        """The row whose folder holds ``label``'s stage 2 (the first of its group)."""
        return next(g[0] for g in self.groups(size) if label in g)

    def reproduce(self, out_dir: Path, *, quick: bool = False,
                  seeds: Sequence[int] | None = None, data_dir: Path | None = None,
                  progress: bool = True, size: TableSize | None = None, plateau: bool = False,
                  backend: str = "sequential", device: str = "cpu", workers: int | None = None,
                  **options: Any) -> Path:
        """Run (or resume) the table into ``out_dir``; returns ``summary.md``. Also writes
        ``results.json`` (per row, one metrics dict per seed; per-run seconds),
        ``data.json``, ``stage1/``, the run folders ``seed*/METHOD`` and the plots.

        Threads: each run uses ``size.threads`` torch threads and ``size.workers`` runs go in
        parallel processes (on a shared 2-core machine two 1-thread processes beat one
        2-thread process and degrade gracefully). ``backend="processes"``: the runs go one
        after the other and each round's clients are spread over worker processes instead.
        ``device``: every stage trains there (use ``backend="vmap"`` on a GPU, its fast
        mode); ``workers`` replaces the size's parallel runs (processes may share one GPU).
        ``options``: the table's own (e.g. FEMNIST's ``store``)."""
        import torch

        size = self.size_of(quick, plateau, size, seeds, **options)
        if workers is not None:
            if workers < 1:
                raise ValueError(f"workers must be >= 1, got {workers}")
            size = replace(size, workers=workers)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        old_threads = torch.get_num_threads()
        stage1_threads = (min(size.threads * size.workers, old_threads) if self.parallel_stage1
                          else size.threads)
        torch.set_num_threads(stage1_threads)
        t_start = time.perf_counter()
        try:
            loaded = self.loaded(size, data_dir, **options)
            check_or_write_json(out_dir / "data.json", jsonable(self.data_record(size, loaded)),
                                "table run's data selection")
            # stage 1 once, shared by every row and seed
            from partialfl.pipeline.stages import pretrain, validation_tasks

            cfg0 = self.stage1_config(size, backend, device)
            pretrain(cfg0, validation_tasks(cfg0, loaded.pretrain_task or loaded.task)[0],
                     self.stage1_dir(out_dir), progress and "stage 1 (FedAvg)")
            torch.set_num_threads(size.threads)
            workers = 1 if backend == "processes" else size.workers
            jobs = [(self, out_dir, data_dir, size, backend, device, options, seed, tuple(group),
                     bool(progress) and workers <= 1)
                    for seed in size.seeds for group in self.groups(size, backend)]
            done = run_jobs(_run_group, jobs, workers, progress and f"{self.name} runs")
            run = self._collect(done, size, out_dir, t_start, quick, loaded.info,
                                stage1_threads, options)
            plots = self._plots(out_dir, run)
            path = out_dir / "summary.md"
            pio.write_text(path, self.summary(run, plots))
            return path
        finally:
            torch.set_num_threads(old_threads)

    def run_group(self, out_dir: Path, data_dir, size: TableSize, backend: str, device: str,
                  options: dict, seed: int, labels: Sequence[str], progress: bool
                  ) -> list[tuple[str, int, dict, float]]:
        """The rows ``labels`` of one seed (one job): each through the pipeline (stage 2 once,
        in the first row's folder), then its new clients; ``(label, seed, metrics,
        seconds)`` per row."""
        import torch

        from partialfl.pipeline.evaluation import evaluate_run
        from partialfl.pipeline.stages import run_pipeline

        torch.set_num_threads(size.threads)
        loaded = self.loaded(size, data_dir, **options)
        task, new = loaded.task, loaded.new
        rows = dict(self.methods(size))
        out, stage2_dir = [], None
        for label in labels:
            method = rows[label]
            run_dir = out_dir / f"seed{seed}" / method.name
            t0 = time.perf_counter()
            res = run_pipeline(self.config(size, method, seed, backend, device), task, run_dir,
                               stage1_dir=self.stage1_dir(out_dir), stage2_dir=stage2_dir,
                               progress=progress, stage1_task=loaded.pretrain_task)
            m = dict(res.metrics)
            if stage2_dir is not None:
                m["stage2_from"] = labels[0]
            stage2_dir = stage2_dir or run_dir
            if new is not None:
                ev = evaluate_run(run_dir, new, model_fn=task.model_fn, split_fn=task.split_fn)
                t = ev["test"]
                m.update({"new_" + k: v for k, v in t.as_dict("test").items()})
                m.update(new_test_acc_before_ft=ev["before"].accuracy,
                         new_per_client_test_acc=t.per_client.tolist(),
                         new_per_client_test_correct=t.per_client_correct,
                         new_per_client_test_total=t.per_client_total,
                         new_client_ids=list(new.client_ids))
            out.append((label, seed, m, time.perf_counter() - t0))
        return out

    def _collect(self, done, size, out_dir, t_start, quick, info, stage1_threads,
                 options) -> TableRun:
        """The jobs' results by row (seeds in order); writes ``results.json``."""
        results: dict[str, list[dict]] = {label: [] for label, _ in self.methods(size)}
        timings: dict[str, float] = {}
        for label, seed, m, sec in sorted((r for d in done for r in d), key=lambda t: t[1]):
            results[label].append(m)
            timings[f"seed{seed}/{label}"] = sec
        seconds = time.perf_counter() - t_start
        write_json(Path(out_dir) / "results.json", jsonable(
            {"results": results, "timings": timings, "total_seconds": seconds}))
        return TableRun(size, results, timings, seconds, quick, info, stage1_threads,
                        dict(options))

    def _plots(self, out_dir: Path, run: TableRun) -> list[str]:
        """The plots (budget curves under the plateau rule, else learning curves and the
        per-client CDF, plus the table's own); their descriptions for the summary."""
        rows = self.methods(run.size)
        if run.size.plateau:
            # rows reusing another row's stage 2 (FedAvg + FT) have no curve of their own
            budget_plot(out_dir, [r for r in rows
                                  if self.stage2_owner(run.size, r[0]) == r[0]],
                        run.size.seeds)
            plots = ["`budget_curves.png` (validation accuracy over stages 1 and 2, where "
                     "each run stopped; the FedAvg + FT rows reuse FedAvg's stage 2)"]
        else:
            pipeline_plots(out_dir, rows, run.size.seeds, run.results,
                           ylabel=self.ylabel(run.size), clients=self.clients)
            plots = ["`learning_curves.png` (deployed test accuracy during stages 1 and 2, "
                     "mean over seeds; the FedAvg + FT rows reuse FedAvg's stage 2)",
                     "`per_client_accuracy.png` (CDF of the final per-client test accuracy "
                     f"over {self.clients}, all seeds)"]
        return plots + self.extra_plots(out_dir, run)

    def ylabel(self, size: TableSize) -> str:
        """The y label of the learning curves."""
        return "test accuracy (%)"

    def heading(self, run: TableRun) -> str:
        """The summary's title."""
        return f"{self.name}: {self.title}"

    # ------------------------------------------------------------------ the summary
    def main_table(self, run: TableRun) -> str:
        """One line per row: final test accuracy, before stage 3, per-client percentiles,
        train accuracy, new clients (if any), personal parameters."""
        new = run.info.get(self.new_key, [])
        rows = [[label, *accuracy_cells(ms),
                 *([percent_mean_std([m.get("new_test_acc", float("nan")) for m in ms])]
                   if new else []), self.params_cell(ms[0].get("split_counts", {}))]
                for label, ms in run.results.items() if ms]
        header = ["method", "test acc % (final)", "before stage 3",
                  "per-client p10 / p50 / p90", "train acc %",
                  *([f"new {self.clients} ({len(new)})"] if new else []), self.params_header]
        return markdown_table(header, rows)

    #: the ``info`` key listing the held-out new clients
    new_key = "new_clients"
    params_header = "personal params"

    def params_cell(self, counts: dict) -> str:
        return f"{counts.get('personal_params', 0):,}"

    def paired_sections(self, run: TableRun) -> list[str]:
        """Each jointly personalized row against its matched baseline, then every row
        against plain FedAvg; on the training clients and, if any, the held-out new ones."""
        full = self.is_full(run.size)
        new = run.info.get(self.new_key)
        done = [k for k, v in run.results.items() if v]
        matched = self.matched(done)
        lines = []
        for prefix, who, first in (("per_client_test", f"training {self.clients}", True),
                                   ("new_per_client_test", f"the {len(new or [])} held-out "
                                    f"new {self.clients}", False)):
            if not first and not new:
                continue
            counts = {label: counts_from_runs(run.results[label], prefix) for label in done}
            clients = self.clients if first else f"new {self.clients}"
            lines += [f"## Joint training vs fine-tuning the same part: {who}", "",
                      *matched_section(counts, matched, unit=self.unit, clients=clients,
                                       verdict=full, explain=first), "",
                      f"## Paired comparison with FedAvg: {who}", "",
                      *paired_section(counts, "FedAvg", unit=self.unit, clients=clients,
                                      explain=first, verdict=full), ""]
        return lines

    def summary(self, run: TableRun, plots: Sequence[str] = ()) -> str:
        """The table's ``summary.md``: its intro, the main table, verdicts, paired sections,
        the stages, the cost, the plots and its closing section."""
        full = self.is_full(run.size)
        note = [] if full else [quick_note(self.size_note(run)), ""]
        s = run.size
        lines = [f"# {self.heading(run)}{' (quick)' if run.quick else ''}", "",
                 *self.intro(run), "", *note, self.main_table(run), "", *self.verdicts(run),
                 "", *self.paired_sections(run), *self.stages_text(run), "",
                 "Wall-clock of this invocation (a resumed table reloads its finished runs, so "
                 f"this counts only what ran now): {run.seconds / 60:.1f} min: stage 1 with "
                 f"{run.stage1_threads} torch thread(s), then {s.workers} worker process(es) "
                 f"with {s.threads} torch thread(s) each (per-run times in `results.json`).",
                 ""]
        if plots:
            lines += ["Plots: " + "; ".join(plots) + ".", ""]
        if s.plateau:
            lines += [plateau_table(run.results, run.timings), ""]
        return "\n".join(lines + [*self.closing(run), ""])


def _run_group(job: tuple) -> list[tuple[str, int, dict, float]]:
    """One job of :meth:`Table.reproduce` (in a worker process: everything pickles)."""
    table, *rest = job
    return table.run_group(*rest)


def data_record(run_dir: Path, table: str, key: str) -> dict[str, Any]:
    """The ``data.json`` of the ``table`` run ``run_dir`` belongs to (in it or a folder
    above), which must list its held-out clients under ``key``; a named error otherwise."""
    run_dir = Path(run_dir)
    found = next((p / "data.json" for p in (run_dir, *run_dir.parents)
                  if (p / "data.json").exists()), None)
    if found is None:
        raise FileNotFoundError(f"no data.json above {run_dir}: not a {table} run")
    info = pio.read_json(found)
    if key not in info:
        raise ValueError(f"{run_dir} is not a {table} run ({found} lists no held-out "
                         f"clients); `evaluate` needs clients held out of training")
    if not info[key]:
        raise ValueError(f"{run_dir}: this run held out no clients; nothing new to evaluate")
    return info


__all__ = ["Loaded", "Table", "TableRun", "TableSize", "data_record"]
