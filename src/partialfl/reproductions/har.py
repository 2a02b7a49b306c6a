"""Human activity recognition by subject (UCI HAPT): where partial personalization pays off.

Clients are subjects (:func:`partialfl.data.har.load_hapt`: 6 basic activities, windows of
128 samples with 50% overlap, train = first session(s), test = last session), channels
standardised with the training subjects' statistics; the model is the 1-D CNN
:class:`partialfl.models.HarCNN` (with GroupNorm, so that a ``norm`` split exists).

Rows, all through the three-stage pipeline (:mod:`partialfl.pipeline`) after one
shared FedAvg pre-training: local training only (a fresh model per subject, nothing shared),
FedAvg, FedAvg + fine-tuning of the output layer, FFGG with the input / output / adapter /
norm split, Local FFGG (adapter), FedAlt and FedSim (output), Ditto (λ = 0.1); seeds 0, 1, 2
(stages 2–3); 5 of the 26 subjects are held out of training and
evaluated as new clients (each fine-tunes its personal part on its first session(s) from the
trained θ, then is tested on its last session).

Set-up, and why (also written into the summary):

* Stage 1: FedAvg on every parameter, 10 subjects per round, 1 local epoch, batch 32, client
  lr 0.05, server SGD lr 1 (plain averaging).
* Stage 2: the method, 10 subjects per round, 1 local epoch, client lr 0.02; FFGG's server
  SGD lr 0.1 ≈ client lr × minibatches per epoch (~6), so a
  round moves θ about as far as a FedAvg round (as in the FEMNIST table); the others use the
  FedAvg server (lr 1 on the mean change).
* Stage 3: 5 epochs of w fine-tuning per subject (lr 0.02); FedAvg's row is
  evaluated as is, "FedAvg + FT" fine-tunes its output layer.
* Local training only: every subject trains a fresh model alone, all subjects every round,
  for the same number of stage-2 rounds (one epoch each), i.e. as many local epochs as rounds,
  at the pre-training client lr (a fresh model needs it). Its held-out subjects do the same.
* Ditto: the global model by FedAvg (stage-2 settings), each sampled subject then runs one
  epoch of proximal SGD on its personal model (starting from the global model when it first
  joins); a held-out subject trains its v from θ for the stage-3 epochs. No stage 3.
* The CNN has a GroupNorm (4 groups) after each convolution (the data README's calibration
  network has none), so that the norm split exists; personal adapters are zero-initialised
  1×1 convolutions after each convolution and a low-rank residual on the logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from partialfl import io as pio
from partialfl.build import Task, make_model
from partialfl.data.har import channel_mean_std, load_hapt, standardize
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.evaluation import evaluate_run
from partialfl.pipeline.files import check_or_write_json
from partialfl.pipeline.jobs import run_table
from partialfl.pipeline.report import (
    counts_from_runs,
    docstring_bullets,
    jsonable,
    markdown_table,
    paired_section,
    percent_mean_std,
    pipeline_plots,
    versus_fedavg,
)
from partialfl.pipeline.stages import pretrain, run_pipeline
from partialfl.registry import register
from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, ServerConfig, StageConfig

MODEL = "har_cnn"
PRETRAIN_LR = 0.05
PERSONAL_LR = 0.02
FFGG_SERVER_LR = 0.1
DITTO_LAMBDA = 0.1
HOLDOUT_SUBJECTS = 5
DEFAULT_SEEDS = (0, 1, 2)
BATCH = 32


@dataclass(frozen=True)
class Size:
    """Round counts and data size of one table run."""

    pretrain_rounds: int
    rounds: int
    eval_every: int
    finetune_epochs: int
    num_subjects: int | None  # None: every subject in the data
    holdout: int
    seeds: tuple[int, ...]
    threads: int
    workers: int
    clients_per_round: int = 10


#: the table, sized for the 2-core machine shared with other work: 25 stage-2 rounds, i.e. each
#: subject takes part in ~12 (measured: stage 1 256 s + 53.1 min for the runs under load
#: average 12-17, see docs/results.md)
FULL = Size(pretrain_rounds=100, rounds=25, eval_every=0, finetune_epochs=5, num_subjects=None,
            holdout=HOLDOUT_SUBJECTS, seeds=DEFAULT_SEEDS, threads=1, workers=2)
#: CI size: a few subjects and rounds, one seed (well under a minute)
QUICK = Size(pretrain_rounds=4, rounds=2, eval_every=0, finetune_epochs=1, num_subjects=8,
             holdout=2, seeds=(0,), threads=1, workers=1, clients_per_round=3)

#: (row label, method) of the table, in order
METHODS: tuple[tuple[str, MethodConfig], ...] = (
    ("Local only", MethodConfig(algorithm="local", split="none")),
    ("FedAvg", MethodConfig(algorithm="fedavg", split="none")),
    ("FedAvg + FT (output)", MethodConfig(algorithm="fedavg", split="none",
                                          finetune_split="output", label="fedavg-ft-output")),
    ("FFGG (input)", MethodConfig(algorithm="ffgg", split="input")),
    ("FFGG (output)", MethodConfig(algorithm="ffgg", split="output")),
    ("FFGG (adapter)", MethodConfig(algorithm="ffgg", split="adapter")),
    ("FFGG (norm)", MethodConfig(algorithm="ffgg", split="norm")),
    ("Local FFGG (adapter)", MethodConfig(algorithm="local-ffgg", split="adapter")),
    ("FedAlt (output)", MethodConfig(algorithm="fedalt", split="output")),
    ("FedSim (output)", MethodConfig(algorithm="fedsim", split="output")),
    ("Ditto", MethodConfig(algorithm="ditto", split="none", options={"lam": DITTO_LAMBDA})),
)


def stage_configs(size: Size) -> tuple[StageConfig, Callable[[MethodConfig], StageConfig],
                                       FinetuneConfig]:
    """(stage 1, stage 2 of a method, stage-3 client config) of the table: methods that send
    θ-gradients (FFGG) take their own server stepsize; local-only training (a fresh model)
    trains every client every round at the pre-training stepsize."""
    k = size.clients_per_round
    pre = StageConfig(rounds=size.pretrain_rounds, clients_per_round=k,
                      client=SGDConfig(lr=PRETRAIN_LR, epochs=1, batch_size=BATCH),
                      server=ServerConfig("sgd", 1.0),
                      eval_every=max(1, size.pretrain_rounds // 6))
    client = SGDConfig(lr=PERSONAL_LR, epochs=1, batch_size=BATCH)
    delta = StageConfig(rounds=size.rounds, clients_per_round=k, client=client,
                        server=ServerConfig("sgd", 1.0), eval_every=size.eval_every)
    gradient = replace(delta, server=ServerConfig("sgd", FFGG_SERVER_LR))
    local = replace(delta, clients_per_round=None,
                    client=SGDConfig(lr=PRETRAIN_LR, epochs=1, batch_size=BATCH))

    def stage2(method: MethodConfig) -> StageConfig:
        e = method.entry
        return local if e.trait("fresh_model") else (
            gradient if e.trait("sends") == "gradient" else delta)

    return pre, stage2, FinetuneConfig(lr=PERSONAL_LR, epochs=size.finetune_epochs,
                                     batch_size=BATCH)


def load_data(data_dir=None, num_subjects: int | None = None, holdout: int = HOLDOUT_SUBJECTS,
              seed: int = 0):
    """``(train_clients, new_clients, info)``: HAPT windows standardised with the channel
    statistics of the training subjects only; ``holdout`` subjects (rng seed ``seed``) are
    new clients; ``num_subjects`` keeps a random subset first (quick runs)."""
    raw = load_hapt(data_dir)
    if num_subjects is not None and num_subjects < raw.num_clients:
        pos = np.sort(np.random.default_rng(seed).permutation(raw.num_clients)[:num_subjects])
        raw = raw.subset(pos)
    seen, new = raw.split_clients(num_new=holdout, seed=seed) if holdout else (raw, None)
    mean, std = channel_mean_std(seen)
    seen = standardize(seen, mean, std)
    new = standardize(new, mean, std) if new is not None else None
    info = {"train_subjects": list(seen.client_ids),
            "new_subjects": list(new.client_ids) if new else [],
            "channel_mean": mean.tolist(), "channel_std": std.tolist(),
            "skipped": raw.meta.get("skipped", {}), "summary": seen.summary()}
    return seen, new, info


def har_task(data) -> Task:
    return Task(data=data, model_fn=lambda seed: make_model(MODEL, data.num_classes, seed=seed),
                name=f"har-{MODEL}")


def _pipeline_config(size: Size, method: MethodConfig, seed: int) -> RunSpec:
    pre, stage2, ft = stage_configs(size)
    return RunSpec(method=method, pretrain=pre, personalize=stage2(method),
                          finetune=ft, seed=seed, pretrain_seed=0, backend="sequential")


_DATA: dict = {}


def _data(data_dir, size: Size):
    key = (str(data_dir), size.num_subjects, size.holdout)
    if key not in _DATA:
        _DATA.clear()
        _DATA[key] = load_data(data_dir, size.num_subjects, size.holdout)
    return _DATA[key]


def _run_one(job: tuple) -> tuple[str, int, dict, float]:
    """One (method, seed) pipeline run (stages 2-3 + new subjects); runs in a worker."""
    out_dir, data_dir, size, seed, idx, progress = job
    torch.set_num_threads(size.threads)
    train, new, _ = _data(data_dir, size)
    label, method = METHODS[idx]
    run_dir = out_dir / f"seed{seed}" / method.name
    t0 = time.perf_counter()
    task = har_task(train)
    res = run_pipeline(_pipeline_config(size, method, seed), task, run_dir,
                       stage1_dir=out_dir / "stage1", progress=progress)
    m = dict(res.metrics)
    if new is not None:
        ev = evaluate_run(run_dir, new, model_fn=task.model_fn, split_fn=task.split_fn)
        m.update({"new_" + k: v for k, v in ev["test"].as_dict("test").items()})
        m["new_per_client_test_acc"] = ev["test"].per_client.tolist()
    return label, seed, m, time.perf_counter() - t0


def evaluate_new_subjects(run_dir: str | Path, data_dir=None, *,
                          finetune_epochs: int | None = None, lr: float | None = None) -> dict:
    """The ``evaluate`` command for a har-table run: the subjects held out of its training
    (rebuilt from the table's ``data.json``: the same subjects and the training subjects'
    channel statistics) fine-tune their personal part and are evaluated; the dict of
    :func:`partialfl.pipeline.evaluate_run` plus ``client_ids``."""
    run_dir = Path(run_dir)
    info_file = next((p / "data.json" for p in (run_dir, *run_dir.parents)
                      if (p / "data.json").exists()), None)
    if info_file is None:
        raise FileNotFoundError(f"no data.json above {run_dir}: not a har-table run")
    info = pio.read_json(info_file)
    if not info.get("new_subjects"):
        raise ValueError(f"{run_dir}: the table held out no subjects; nothing new to evaluate")
    size = info["size"]
    _, new, again = load_data(data_dir, size["num_subjects"], size["holdout"])
    if list(new.client_ids) != list(info["new_subjects"]):
        raise ValueError(f"the data under {data_dir or 'the default data folder'} does not give "
                         f"the run's held-out subjects {info['new_subjects']}")
    res = evaluate_run(run_dir, new, model_fn=har_task(new).model_fn,
                       finetune_epochs=finetune_epochs, lr=lr)
    return {**res, "client_ids": [str(c) for c in new.client_ids]}


@register("reproduction", "har-table",
          doc="Activity recognition by subject (HAPT): local, FedAvg(+FT), FFGG splits, Ditto")
def reproduce_table(out_dir: Path, *, quick: bool = False, seeds: list[int] | None = None,
                    data_dir: Path | None = None, progress: bool = True,
                    size: Size | None = None) -> Path:
    """Run (or resume) the table; writes ``summary.md`` (returned), ``results.json``,
    ``data.json``, per-run folders ``seed*/METHOD``, ``stage1/``, ``learning_curves.png``,
    ``per_client_accuracy.png`` and ``per_subject_accuracy.png``. Runs go in ``size.workers``
    one-thread processes (:func:`partialfl.pipeline.run_table`)."""
    size = size or (QUICK if quick else FULL)
    if seeds:
        size = replace(size, seeds=tuple(int(s) for s in seeds))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(size.threads)
    t_start = time.perf_counter()
    try:
        train, _, info = _data(data_dir, size)
        check_or_write_json(out_dir / "data.json",
                            jsonable({**info, "size": asdict(replace(size, seeds=()))}),
                            "table run's data selection")
        pretrain(_pipeline_config(size, METHODS[1][1], size.seeds[0]), har_task(train),
                 out_dir / "stage1", progress and "stage 1 (FedAvg)")
        runs = run_table(_run_one, METHODS, size.seeds, (out_dir, data_dir, size), size.workers,
                         out_dir, t_start, progress and "har-table runs")
        pipeline_plots(out_dir, METHODS, size.seeds, runs.results, ylabel="test accuracy (%)",
                       clients="subjects")
        per_subject_plot(out_dir / "per_subject_accuracy.png", runs.results)
        path = out_dir / "summary.md"
        pio.write_text(path, _summary(runs.results, size, info, runs.seconds, quick))
        return path
    finally:
        torch.set_num_threads(old_threads)


#: rows drawn in the per-subject plot (when present)
PLOT_ROWS = ("Local only", "FedAvg", "FedAvg + FT (output)", "Ditto")


def per_subject_plot(path: Path, results: dict[str, list[dict]]) -> Path:
    """Test accuracy of every training subject (mean over seeds) for the baselines and the
    best FFGG row, subjects sorted by the FedAvg accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def per(label):
        return np.nanmean([np.asarray(m["per_client_test_acc"], float)
                           for m in results[label]], axis=0)

    ffgg = [lab for lab in results if lab.startswith("FFGG") and results[lab]]
    best = max(ffgg, key=lambda lab: np.mean([m["test_acc"] for m in results[lab]]))
    rows = [r for r in PLOT_ROWS if results.get(r)] + [best]
    ids = results[rows[0]][0]["client_ids"]
    order = np.argsort(per("FedAvg")) if results.get("FedAvg") else np.arange(len(ids))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, r in enumerate(rows):
        ax.plot(np.arange(len(ids)), 100 * per(r)[order], marker="os^vD"[i % 5], lw=1,
                label=r)
    ax.set_xticks(np.arange(len(ids)), [ids[j] for j in order], fontsize=7)
    ax.set_xlabel("subject (sorted by FedAvg accuracy)")
    ax.set_ylabel("test accuracy, last session (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _summary(results, size: Size, info, seconds: float, quick: bool) -> str:
    rows = []
    for label, ms in results.items():
        if not ms:
            continue
        def col(key, ms=ms):
            return percent_mean_std([m.get(key, float("nan")) for m in ms])
        sc = ms[0].get("split_counts", {})
        rows.append([label, col("test_acc"), col("test_acc_before_ft"),
                     " / ".join(col(f"test_acc_p{q}").split(" ±")[0] for q in (10, 50, 90)),
                     col("new_test_acc"), f"{sc.get('personal_params', 0):,}"])
    n_new = len(info["new_subjects"])
    header = ["method", "test acc % (final)", "before stage 3", "per-subject p10 / p50 / p90",
              f"new subjects ({n_new})", "personal params"]
    verdict = versus_fedavg({("FedAvg" if k == "FedAvg + FT (output)" else k): v
                             for k, v in results.items() if k != "FedAvg"},
                            "output layer", claim_margin=0.03)
    local = float(np.mean([m["test_acc"] for m in results["Local only"]]))
    ffgg = {k: float(np.mean([m["test_acc"] for m in v])) for k, v in results.items()
            if k.startswith("FFGG")}
    best = max(ffgg, key=ffgg.get)
    lines = [
        f"# har-table: partial personalization on UCI HAPT by subject{' (quick)' if quick else ''}",
        "",
        f"{len(info['train_subjects'])} training subjects, {n_new} held-out new subjects; "
        f"{info['summary']}. Seeds {list(size.seeds)}: mean ± std over seeds of the pooled "
        "test accuracy (last session); percentiles over subjects (means over seeds).",
        "",
        markdown_table(header, rows),
        "",
        *verdict,
        f"- Best FFGG split vs local training only: {best} {100 * ffgg[best]:.2f}% vs "
        f"{100 * local:.2f}% ({100 * (ffgg[best] - local):+.2f} points).",
        "",
        "## Paired comparison with FedAvg: training subjects",
        "",
        *paired_section({label: counts_from_runs(ms) for label, ms in results.items() if ms},
                        unit="windows", clients="subjects", verdict=not quick),
        "",
        f"Stages: 1) FedAvg pre-training {size.pretrain_rounds} rounds (client lr "
        f"{PRETRAIN_LR}); 2) {size.rounds} rounds of the method ({size.clients_per_round} "
        f"subjects per round, client lr {PERSONAL_LR}; FFGG server lr {FFGG_SERVER_LR}); 3) "
        f"{size.finetune_epochs} epochs of w fine-tuning per subject. 'before stage 3' = the "
        "deployed model before fine-tuning (FedAvg + FT: the global model). 'new subjects': "
        "pooled test accuracy of the held-out subjects after fine-tuning their personal part "
        "on their first session(s) (local only: a fresh model trained alone).",
        "",
        "Wall-clock of this invocation (a resumed table reloads its finished runs, so this "
        f"counts only what ran now): {seconds / 60:.1f} min, {size.workers} worker "
        f"process(es) with "
        f"{size.threads} torch thread(s) each (per-run times in `results.json`).",
        "",
        "Plots: `learning_curves.png`, `per_client_accuracy.png` (CDF over subjects), "
        "`per_subject_accuracy.png` (each training subject, mean over seeds).",
        "",
        "## Set-up",
        "",
        *docstring_bullets(__doc__, "Set-up, and why (also written into the summary):"),
        "",
    ]
    return "\n".join(lines)
