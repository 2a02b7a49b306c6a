"""A *study*: one train config run for several seeds and a small grid of settings
(``partialfl train CONFIG --seeds 0 1 2 --sweep method.split=output,input``).

The runs are the product of the ``--sweep`` values (each ``key=v1,v2``, repeatable) and the
seeds; each is an ordinary ``partialfl train`` run (:func:`~partialfl.pipeline.train.run_built`)
in its own sub-folder of the *study folder*, named by its settings (``seed=0``,
``method.split=output,seed=0``), and ``study.json`` lists them::

    {"format": "partialfl.study/1", "config": ..., "seeds": [...], "sweep": {key: [...]},
     "runs": [{"folder": "seed=0", "seed": 0, "set": {key: value}}, ...]}

The runs go to worker processes (:func:`~partialfl.pipeline.jobs.run_jobs`, ``jobs`` at a
time); each run sets its own thread count (``threads``, default 1) and derives all its
randomness from its seed, so a run's results are the same whatever ``jobs`` is.
``partialfl compare STUDY`` (:mod:`partialfl.pipeline.compare`) then tables them.

Run again into the same folder, a study whose runs all finished is refused (``overwrite``:
every run is run again); an interrupted study keeps its finished runs and runs (or resumes)
the others.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from partialfl import io as pio
from partialfl.config import ConfigError

#: format tag of ``study.json``
FORMAT = "partialfl.study/1"
INDEX = "study.json"


def _split_values(text: str) -> list[str]:
    """``v1,v2`` split at the commas outside brackets, braces and quotes."""
    out, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    out.append(cur.strip())
    return out


#: the most runs one study may have
MAX_RUNS = 10_000


def parse_sweep(items: Sequence[str]) -> dict[str, list[str]]:
    """``["key=v1,v2", …]`` as ``{key: [v1, v2]}`` (values as ``--set`` reads them)."""
    sweep: dict[str, list[str]] = {}
    for item in items:
        key, eq, values = item.partition("=")
        key = key.strip()
        vals = _split_values(values) if eq else []
        if not key or not eq or not all(vals):
            raise ConfigError(f"--sweep {item!r}: expected KEY=V1,V2 (e.g. "
                              "--sweep personalize.client.lr=0.05,0.1)")
        if key in sweep:
            raise ConfigError(f"--sweep {key} given twice; list all its values once")
        if key == "seed":
            raise ConfigError("--sweep seed: use --seeds 0 1 2")
        sweep[key] = vals
    return sweep


def folder_name(settings: dict[str, str], seed: int) -> str:
    """A run's sub-folder: its settings and seed, characters outside ``[A-Za-z0-9._=+-]``
    replaced by ``_`` (a value never makes a path)."""
    parts = [f"{k}={v}" for k, v in settings.items()] + [f"seed={seed}"]
    return ",".join(re.sub(r"[^A-Za-z0-9._=+\-]", "_", p) for p in parts)


def study_runs(seeds: Sequence[int], sweep: dict[str, list[str]]) -> list[dict[str, Any]]:
    """The runs of a study, sweep values outermost, seeds innermost (at most
    :data:`MAX_RUNS`: a typo'd grid of millions was validated run by run, for hours)."""
    keys = list(sweep)
    n = math.prod(len(v) for v in sweep.values()) * len(seeds)
    if n > MAX_RUNS:
        raise ConfigError(f"--seeds / --sweep make {n} runs; a study has at most {MAX_RUNS} "
                          "(split it into several studies)")
    runs = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        settings = dict(zip(keys, combo))
        for s in seeds:
            runs.append({"folder": folder_name(settings, int(s)), "seed": int(s),
                         "set": settings})
    names = [r["folder"] for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError("--seeds / --sweep give two runs the same folder (a repeated seed "
                          "or value?)")
    return runs


def run_sets(run: dict[str, Any], sets: Sequence[str]) -> list[str]:
    """The ``--set`` overrides of one run: the command line's, then its sweep values and seed."""
    return [*sets, *(f"{k}={v}" for k, v in run["set"].items()), f"seed={run['seed']}"]


def write_index(out: Path, config: str | Path, seeds, sweep, runs) -> None:
    """``study.json`` (see the module docstring); a folder holding another study's index
    (other runs) is refused."""
    index = {"format": FORMAT, "config": str(Path(config).resolve()),
             "seeds": [int(s) for s in seeds], "sweep": sweep, "runs": runs}
    f = out / INDEX
    if f.exists():
        old = pio.read_json(f)
        if old.get("runs") != runs:
            raise FileExistsError(f"{out} holds another study (other seeds or sweep); choose "
                                  "another --out")
    out.mkdir(parents=True, exist_ok=True)
    pio.write_json(f, index, indent=1)


def heartbeat(label: str, every_s: float = 30.0):
    """An ``on_round(stage, round)`` hook that prints one line to stderr at a stage's first
    round, then at most every ``every_s`` seconds (the progress of a run without bars)."""
    state = {"stage": None, "t": 0.0, "t0": time.perf_counter()}

    def hook(stage: str, r: int) -> None:
        now = time.perf_counter()
        if stage != state["stage"] or now - state["t"] >= every_s:
            state.update(stage=stage, t=now)
            print(f"[{label}] {stage}: round {r + 1} done ({now - state['t0']:.0f} s)",
                  file=sys.stderr, flush=True)

    return hook


def _run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One study run, in a worker process: rebuild its spec, run it (the worker's job)."""
    from partialfl.build import allow_code, build
    from partialfl.pipeline.train import claim_out, load_run_spec, run_built
    from partialfl.pipeline.train_report import divergence_line

    with allow_code(job["allow_code"] or None):
        spec = load_run_spec(job["config"], job["sets"], device=job["device"])
        out = Path(job["out"])
        claim_out(out, job["overwrite"])
        run = build(spec)
        print(f"[{job['label']}] started", file=sys.stderr, flush=True)
        m = run_built(run, out, progress=False, on_round=heartbeat(job["label"]),
                      config=job["config"])
    new = m.get("new_clients") or {}
    print(f"[{job['label']}] done: test accuracy {100 * m['test_acc']:.2f}%"
          + (f", new clients {100 * new['test_acc']:.2f}%" if new else ""),
          file=sys.stderr, flush=True)
    return {"folder": job["label"], "test_acc": m["test_acc"],
            "new_clients_test_acc": new.get("test_acc") if new else None,
            "diverged": divergence_line(m)}


def check_study(config: str | Path, seeds: Sequence[int], sweep: dict[str, list[str]],
                sets: Sequence[str] = (), *, device: str | None = None,
                allow_code: bool = False) -> list[dict[str, Any]]:
    """The study's runs, every run's spec validated (a bad key or value fails here, before
    anything is written or run)."""
    from partialfl.build import allow_code as allowing
    from partialfl.build.code import check_code_refs
    from partialfl.pipeline.stages import check_synchronous
    from partialfl.pipeline.train import load_run_spec

    runs = study_runs(seeds or [0], sweep)
    with allowing(allow_code or None):
        for r in runs:
            spec = load_run_spec(config, run_sets(r, sets), device=device)
            check_code_refs(spec)
            check_synchronous(spec)
    return runs


def run_study(config: str | Path, out: str | Path, *, seeds: Sequence[int],
              sweep: dict[str, list[str]], sets: Sequence[str] = (), jobs: int | None = None,
              overwrite: bool = False, device: str | None = None,
              allow_code: bool = False) -> list[dict[str, Any]]:
    """Run every run of the study (see the module docstring) into ``out``; returns one
    summary per run (``folder``, ``test_acc``, ``new_clients_test_acc``, ``diverged``: why,
    or '') in index order.
    Every run's spec is validated before anything is written or started."""
    from partialfl.pipeline.jobs import run_jobs
    from partialfl.pipeline.run_files import refuse_linked_folders
    from partialfl.pipeline.train import finished, removal_cut_short

    out = Path(out)
    runs = check_study(config, seeds, sweep, sets, device=device, allow_code=allow_code)
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    half = [] if overwrite else [r for r in runs if removal_cut_short(out / r["folder"])]
    if half:  # refused before anything trains (its files are gone: it cannot be kept)
        raise FileExistsError(f"{out / half[0]['folder']} holds a run whose removal by "
                              "--overwrite was cut short; pass --overwrite to finish it and "
                              "run it again")
    kept = [] if overwrite else [r for r in runs if finished(out / r["folder"])]
    for r in kept:  # a finished run is kept only if it is this study's run
        _check_kept(out / r["folder"], config, run_sets(r, sets), device)
    if runs and len(kept) == len(runs):
        raise FileExistsError(f"{out} holds this study, finished; pass --overwrite to run it "
                              "again (or choose another --out)")
    if out.exists():  # a run folder (or one below it) that is a link: writes would leave out
        refuse_linked_folders(out)
    write_index(out, config, seeds, sweep, runs)
    pio.clean_stale_writes(out)  # this study's own folder: what its killed writes left
    todo = [{"config": str(config), "sets": run_sets(r, sets), "out": str(out / r["folder"]),
             "label": r["folder"], "device": device, "allow_code": allow_code,
             "overwrite": overwrite} for r in runs if r not in kept]
    if kept:  # an interrupted study: its finished runs stay, the others run or resume
        print(f"{out}: {len(kept)} of {len(runs)} runs finished already; running the "
              f"other {len(todo)}", file=sys.stderr, flush=True)
    workers = min(len(todo), os.cpu_count() or 1) if jobs is None else min(jobs, len(todo))
    done = {d["folder"]: d for d in run_jobs(_run_one, todo, workers)}
    done.update({r["folder"]: _summary(r["folder"], out / r["folder"]) for r in kept})
    return [done[r["folder"]] for r in runs]


def _check_kept(run_dir: Path, config, sets, device) -> None:
    """FileExistsError (one line) when the finished run in ``run_dir`` ran another spec than
    the study's ``config`` with ``sets`` gives it (compared as a resume compares them:
    :meth:`~partialfl.spec.run.RunSpec.identity`): an interrupted study is completed only by
    its own configuration."""
    import json

    from partialfl.pipeline.train import load_run_spec

    def plain(spec) -> dict:  # what a resume compares: not the logging, device or name
        return json.loads(json.dumps(spec.identity()))

    want = plain(load_run_spec(config, sets, device=device))
    try:
        have = plain(load_run_spec(data=pio.read_json(run_dir / "spec.json")))
    except (OSError, ValueError):
        have = None
    if have is not None and have != want:
        raise FileExistsError(f"{run_dir} holds a finished run of another configuration than "
                              f"{config} gives it: this folder holds another study; pass "
                              "--overwrite to run this one there (or choose another --out)")


def _summary(folder: str, run_dir: Path) -> dict[str, Any]:
    """A finished run's summary, read from its files."""
    from partialfl.pipeline.train_report import divergence_line

    m = pio.read_json(run_dir / "metrics.json")
    new = run_dir / "new_clients.json"
    return {"folder": folder, "test_acc": m["test_acc"],
            "new_clients_test_acc": pio.read_json(new)["test_acc"] if new.is_file() else None,
            "diverged": divergence_line(m)}


def read_index(path: str | Path) -> dict[str, Any] | None:
    """A study folder's ``study.json`` (None if ``path`` is not a study folder), checked for
    what its readers take from it: ``runs`` a list of tables each naming its ``folder`` (a
    crafted index crashed ``partialfl compare`` with KeyError / TypeError tracebacks)."""
    f = Path(path) / INDEX
    if not f.is_file():
        return None
    index = pio.read_json(f)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise pio.FileFormatError(f"{f}: not a study index (format {FORMAT!r})")
    runs = index.get("runs")
    if not isinstance(runs, list) or not all(
            isinstance(r, dict) and isinstance(r.get("folder"), str) for r in runs):
        raise pio.FileFormatError(f"{f}: runs is not a list of runs each naming its folder "
                                  "(damaged?)")
    return index


__all__ = ["FORMAT", "check_study", "folder_name", "heartbeat", "parse_sweep", "read_index",
           "run_study", "study_runs"]
