"""The paper's three-stage pipeline for partially personalized models (after Pillutla et al.
2022), for any task: a model factory, a FederatedDataset, a loss and a metric (:class:`Task`).

1. **Pre-training**: non-personalized FedAvg on every parameter (split ``none``).
2. **Personalization**: the method (FedAvg, FFGG, Local FFGG, FedAlt, FedSim) with its split,
   initialised from stage 1: θ⁰ = the stage-1 values of the global parameters and the personal
   starting point w_pre = the stage-1 values of the personal ones (new adapters: their
   zero-output initialisation).
3. **Fine-tuning**: every client fine-tunes its w for ``finetune.epochs`` SGD epochs with θ
   fixed, from the method's deployed start (FFGG / Local FFGG / stateless: the round start
   w_pre; FedAlt / FedSim: the w_m kept on the client); then test and train metrics.

Fully personal models (:mod:`partialfl.algorithms.ditto`): ``ditto`` (split ``none``, strength
``lam``) trains θ by FedAvg and each client's v_m; ``local`` is local training only — every
client trains its own copy of a *fresh* model (``model_fn(seed)``, not the stage-1 values) and
nothing is shared. Both deploy v_m and skip stage 3; on new clients
(:func:`~partialfl.pipeline.evaluation.evaluate_run`) a Ditto client trains v from θ for
``finetune.epochs`` epochs, a local-only client trains its fresh copy for
``personalize.rounds × client.epochs`` epochs (the budget of a training client under full
participation).

Files in ``run_dir`` (:mod:`partialfl.pipeline.files`): ``config.json``; ``stage2.jsonl``
(per-evaluation metrics: learning curves), ``stage2_train.jsonl`` (per round: the cohort's
mean training loss and throughput, :func:`partialfl.runtime.logging.train_record`),
``stage2.ckpt`` (the resumable checkpoint's pointer,
:mod:`partialfl.runtime.checkpoint`), ``stage2.g<N>.server.ckpt`` and
``stage2.g<N>.client-side.ckpt`` (the clients' state, e.g. FedAlt's w_m: never in a server file),
``theta_stage2.safetensors`` (θ after stage 2), ``client_state_stage2.client-side.safetensors``
(FedAlt/FedSim personal parameters), ``deploy.safetensors`` (the split model's tensors with θ
and w_pre, for :func:`~partialfl.pipeline.evaluation.evaluate_run` on new clients),
``metrics.json`` (stage 3). Stage 1 lives in ``stage1_dir`` (default ``run_dir/stage1``; share
it between methods and seeds with the same pre-training): ``stage1.jsonl``,
``stage1_train.jsonl``, ``stage1.ckpt``,
``theta.safetensors``; with ``save_personalized``, ``personalized/`` (every client's deployed
model, :mod:`partialfl.pipeline.deploy`). A stage whose final file exists is skipped (the
file must carry the stamp of this configuration's stage, :func:`~partialfl.pipeline.files.stamp`,
and hold this run's names, shapes and dtypes, finite); an
interrupted stage resumes from its last checkpoint (``checkpoint_every`` rounds) with
bit-identical results, because all randomness derives from (seed, round, client). Every file is
written atomically and holds tensors (safetensors) or plain JSON, never a pickle
(:mod:`partialfl.io`); a pickle-based file of an older version (``*.pt``) is refused with a
message naming it, never loaded.

Stage budgets: ``stage1/timing.json`` and ``stage2_timing.json`` record the rounds run, the
cap and whether the plateau rule (``StageConfig.stop``, :mod:`partialfl.pipeline.stopping`)
stopped the stage; with ``RunSpec.validation`` every choice reads a validation split
carved from the training data and the test split is read once, at the end.

A text task reuses this unchanged: give a different ``Task`` (model factory, data, a token
loss such as :func:`partialfl.lm.token_cross_entropy`, a masked metric and, if needed, a
``split_fn`` that builds its splits).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialfl import io as pio
from partialfl.algorithms.base import Algorithm, RoundContext, ServerState
from partialfl.build import Task, build_algorithm, split_of
from partialfl.config import ConfigError
from partialfl.data.federated import FederatedDataset
from partialfl.data.validation import carve_validation
from partialfl.pipeline.evaluation import evaluate_model, finetune_personal, round_evaluator
from partialfl.pipeline.files import (
    CLIENT_STATE,
    DEPLOY,
    THETA1,
    THETA2,
    check_or_write_json,
    json_default,
    load_params,
    read_params,
    save_deploy,
    save_stage,
    seeded_split,
    stage1_identity,
    stage2_identity,
    tensor_file,
    write_json,
)
from partialfl.pipeline.stopping import choose_finetune, plateaued
from partialfl.problems.model import ModelProblem
from partialfl.registry import Component
from partialfl.runtime import JsonlLogger, run_rounds
from partialfl.runtime.resume_check import check_clients
from partialfl.spec import MethodConfig, RunSpec, StageConfig
from partialfl.split import Split
from partialfl.types import Params


# ----------------------------------------------------------------------------- the task
@dataclass
class PipelineResult:
    """A finished run: its metrics, folder, trained θ and split."""

    metrics: dict[str, Any]
    run_dir: Path
    theta: Params
    split: Split


# ----------------------------------------------------------------------------- building blocks
def _problem(task: Task, split: Split, cfg: RunSpec, w_pretrained=None) -> ModelProblem:
    return ModelProblem(split, task.data, loss_fn=task.loss_fn, metric=task.metric,
                        w_pretrained=w_pretrained, batching=cfg.backend.build(),
                        device=cfg.device, precision=cfg.precision,
                        memory_format=cfg.memory_format)


def _host(params: Params) -> Params:
    """Detached CPU copies (what is written to disk)."""
    return {n: v.detach().cpu().clone() for n, v in params.items()}


def _on(params: Params, problem: ModelProblem) -> Params:
    """``params`` on the problem's device."""
    return {n: v.to(problem.device) for n, v in params.items()}


def _val_evaluator():
    """The round evaluator on a validation view (its "test" split), logged as ``val_*``."""
    ev = round_evaluator(("test",))

    def evaluate(*args) -> dict:
        return {"val_" + k[len("test_"):]: v for k, v in ev(*args).items()}

    return evaluate


def _run_stage(problem, algorithm, stage: StageConfig, seed: int, out: Path, tag: str,
               checkpoint_every: int, backend: Component, progress, theta0=None,
               on_round=None, validation: bool = False, max_failure_fraction: float = 0.5):
    logger = JsonlLogger(out / f"{tag}.jsonl", stage=tag)
    # one record per round, appended (a resumed stage logs its rounds after the checkpoint
    # again: readers keep the last record of a round, train_report.train_histories)
    train_logger = JsonlLogger(out / f"{tag}_train.jsonl", append=True, stage=tag)
    runner = backend.build()
    stop = stage.stop
    t0 = time.perf_counter()
    try:
        res = run_rounds(
            problem, algorithm, stage.rounds,
            clients_per_round=min(stage.clients_per_round or problem.num_clients,
                                  problem.num_clients),
            seed=seed, theta0=theta0, backend=runner,
            evaluate=_val_evaluator() if validation else round_evaluator(("test",)),
            eval_every=stage.eval_every or max(1, stage.rounds),
            logger=logger, train_logger=train_logger,
            progress=(f"{tag}" if progress is True else progress),
            checkpoint=out / f"{tag}.ckpt", checkpoint_every=checkpoint_every, resume=True,
            on_round=on_round, stop=(lambda h: plateaued(h, stop)) if stop else None,
            max_failure_fraction=max_failure_fraction,
        )
    finally:
        logger.close()
        train_logger.close()
        getattr(runner, "close", lambda: None)()
    # the stage's budget: rounds run (≤ the cap), whether the plateau rule stopped it, time
    write_json(out / f"{tag}_timing.json",
                {"seconds": time.perf_counter() - t0, "rounds": int(res.state.round),
                 "cap": stage.rounds, "stopped": res.stopped})
    return res


def check_synchronous(cfg: RunSpec) -> None:
    """ConfigError if ``cfg`` has an ``[asynchronous]`` block (once ignored silently): the
    in-process model pipeline is synchronous; asynchronous model runs are Flower's jobs."""
    if cfg.asynchronous is not None:
        raise ConfigError("[asynchronous] on a model problem runs on Flower (--engine "
                          "flower-sim or flower); the in-process pipeline trains in "
                          "synchronous rounds: remove the block or choose a Flower engine")


# ----------------------------------------------------------------------------- stages
def stage1_setup(cfg: RunSpec, task: Task) -> tuple[ModelProblem, Algorithm]:
    """Stage 1's problem (every parameter global, the model seeded with ``stage1_seed``) and
    FedAvg with the pre-training optimizers (also what a Flower node builds for it)."""
    split = task.make_split(task.model_fn(cfg.stage1_seed), "none", {})
    problem = _problem(task, split, cfg)
    return problem, build_algorithm(cfg, cfg.pretrain, method=MethodConfig(algorithm="fedavg"),
                                    num_clients=problem.num_clients)


def stage2_setup(cfg: RunSpec, task: Task, theta1: Params
                 ) -> tuple[Split, ModelProblem, Algorithm, Params]:
    """Stage 2's split (of the model with the stage-1 parameters ``theta1``), problem (w_pre
    = the stage-1 personal values), algorithm and θ⁰ (also what a Flower node builds)."""
    model = load_params(task.model_fn(cfg.stage1_seed), theta1)
    split = seeded_split(task, model, *split_of(cfg.method), cfg.seed)
    theta_start, w_pre = split.params()
    problem = _problem(task, split, cfg, w_pre)
    return split, problem, build_algorithm(cfg, cfg.personalize,
                                           num_clients=problem.num_clients), theta_start


def pretrain(cfg: RunSpec, task: Task, stage1_dir: Path, progress: bool | str = False,
             on_round=None) -> Params:
    """Stage 1 (FedAvg on every parameter); returns all parameters. Cached in
    ``stage1_dir/theta.safetensors``; resumable."""
    stage1_dir = Path(stage1_dir)
    stage1_dir.mkdir(parents=True, exist_ok=True)
    ident = stage1_identity(cfg, task.name)
    check_or_write_json(stage1_dir / "config.json", ident, "stage-1 pre-training")
    done = read_params(stage1_dir, THETA1, like=dict(task.model_fn(cfg.stage1_seed)
                                                     .named_parameters()), identity=ident)
    if done is not None:
        return done
    problem, alg = stage1_setup(cfg, task)
    t0 = time.perf_counter()
    check_synchronous(cfg)
    res = _run_stage(problem, alg, cfg.pretrain, cfg.stage1_seed, stage1_dir, "stage1",
                     cfg.checkpoint_every, cfg.backend, progress, on_round=on_round,
                     validation=cfg.validation is not None,
                     max_failure_fraction=cfg.max_failure_fraction)
    theta = _host(res.state.theta)
    warn_diverged(theta, "stage 1", res.history)
    # the budget first, θ last: θ marks the stage done, so a kill between the two files
    # reruns the stage (resumed from its checkpoint) and writes both again (as in stage 2)
    write_json(stage1_dir / "timing.json", {"seconds": time.perf_counter() - t0,
                                             "rounds": int(res.state.round),
                                             "cap": cfg.pretrain.rounds,
                                             "stopped": res.stopped})
    save_stage(stage1_dir / THETA1, theta, ident)
    return theta


@dataclass
class Stage2:
    """A finished stage 2: its split, problem, algorithm, θ, the clients' state (FedAlt /
    FedSim's w_m, BatchNorm statistics; None if stateless) and its seconds (NaN: reloaded)."""

    split: Split
    problem: ModelProblem
    algorithm: Algorithm
    theta: Params
    client_state: Params | None
    seconds: float
    #: the folder holding stage 2's files (None: the run's folder)
    folder: Path | None = None


def personalize(cfg: RunSpec, task: Task, theta1: Params, run_dir: Path,
                progress: bool | str = False, on_round=None) -> Stage2:
    """Stage 2: the method from the stage-1 parameters ``theta1``; resumable."""
    run_dir = Path(run_dir)
    if cfg.method.entry.trait("fresh_model"):  # nothing shared: a fresh model per seed
        theta1 = {n: p.detach().clone() for n, p in task.model_fn(cfg.seed).named_parameters()}
    split, problem, alg, theta_start = stage2_setup(cfg, task, theta1)
    ident = stage2_identity({**cfg.identity(), "task": task.name})
    theta = read_params(run_dir, THETA2, like=theta_start, identity=ident)
    if theta is not None:
        theta = _on(theta, problem)
        cs = read_params(run_dir, CLIENT_STATE, identity=ident)
        like = alg.init_client_state(problem) if cs is not None else None
        if like is not None:  # names, shapes, dtypes of this run's, finite (as a checkpoint)
            check_clients(cs, like, run_dir / CLIENT_STATE, pio.FileFormatError)
        cs = None if cs is None else _on(cs, problem)
        return Stage2(split, problem, alg, theta, cs, float("nan"), run_dir)
    t0 = time.perf_counter()
    check_synchronous(cfg)
    res = _run_stage(problem, alg, cfg.personalize, cfg.seed, run_dir, "stage2",
                     cfg.checkpoint_every, cfg.backend, progress,
                     theta0=_on(theta_start, problem), on_round=on_round,
                     validation=cfg.validation is not None,
                     max_failure_fraction=cfg.max_failure_fraction)
    theta = {n: v.detach().clone() for n, v in res.state.theta.items()}
    warn_diverged(theta, "stage 2", res.history)
    if res.client_state is not None:
        save_stage(run_dir / CLIENT_STATE, _host(res.client_state), ident,
                   {"side": "client", "note": "client-side state: stays on the clients"})
    save_stage(run_dir / THETA2, _host(theta), ident)
    return Stage2(split, problem, alg, theta, res.client_state, time.perf_counter() - t0,
                  run_dir)


def _deploy_start(cfg: RunSpec, s2: Stage2) -> Params:
    """w_m at the start of stage 3 (see the module docstring): the personal leaves the run
    kept per client (FedAlt/FedSim's w_m; FedAvg's BatchNorm statistics), the others from
    ``method.w_init``. Client state that is not personal parameters (Scaffold's control
    variates c_m) is not a model's leaf and stays out."""
    allc = np.arange(s2.problem.num_clients)
    cs = s2.client_state or {}
    personal = (*s2.problem.w_names, *s2.problem.state_names)
    kept = {n: v.clone() for n, v in cs.items() if n in personal}
    if cs and len(kept) == len(cs):
        return kept
    return {**s2.problem.init_w(allc, cfg.method.w_init, cfg.seed, -1), **kept}


def finetune_and_evaluate(cfg: RunSpec, task: Task, s2: Stage2, run_dir: Path,
                          test_task: Task | None = None, save_personalized: bool = False
                          ) -> tuple[dict[str, Any], Split, Params]:
    """Stage 3: fine-tune every client's w, evaluate; returns (metrics, split, θ).

    With ``cfg.validation``, ``task``'s data is the validation view (its test split = the
    validation data): ``cfg.finetune_grid`` (if set) picks the fine-tuning setting there, and
    the final model is evaluated once on ``test_task``'s data (the real test split). With
    ``save_personalized`` every client's deployed model (θ, fine-tuned w_m) is saved in
    ``run_dir/personalized`` (:mod:`partialfl.pipeline.deploy`)."""
    split, problem, theta = s2.split, s2.problem, s2.theta
    full = cfg.method.entry.trait("split") == "full"
    w0 = {} if full else _deploy_start(cfg, s2)
    built = split_of(cfg.method)
    if cfg.method.finetune_split is not None:
        # FedAvg + fine-tuning: a split of the trained shared model, w_pre = trained layers
        # (an adapter split inserts zero-initialised adapters)
        model = load_params(task.model_fn(cfg.stage1_seed), theta)
        built = split_of(cfg.method, finetune=True)
        split = seeded_split(task, model, *built, cfg.seed)
        theta, w_pre = split.params()
        problem = _problem(task, split, cfg, w_pre)
        theta = _on(theta, problem)
        w0 = {**problem.init_w(np.arange(problem.num_clients), "pretrained", cfg.seed, -1),
              **(w0 if problem.state_names else {})}  # keep each client's BatchNorm stats
    # Ditto / local-only deploy each client's v_m (no w, so stage 3 changes nothing)
    deployed = (s2.algorithm.deployed(ServerState(theta), problem, s2.client_state,
                                      RoundContext(cfg.seed, -1)).theta if full else theta)
    counts = split.counts()
    if full:  # v_m: a personal copy of every parameter
        counts["personal_params"] = counts["global_params"]
        if cfg.method.entry.trait("fresh_model"):
            counts["global_params"] = 0
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if test_task is not None:  # choices on the validation view, the test once at the end
        if cfg.finetune_grid is not None and problem.w_names:
            choice, w = choose_finetune(problem, theta, w0, cfg.finetune_grid, cfg.finetune,
                                        cfg.seed)
            extra["finetune_choice"] = choice
        else:
            w = finetune_personal(problem, theta, w0, cfg.finetune.sgd(), cfg.seed)
        extra["val_acc"] = evaluate_model(problem, deployed, w, "test").accuracy
        problem = _problem(test_task, split, cfg, problem.w_pretrained)
        before = evaluate_model(problem, deployed, w0, "test")
    else:
        before = evaluate_model(problem, deployed, w0, "test")
        w = finetune_personal(problem, theta, w0, cfg.finetune.sgd(), cfg.seed)
    test = evaluate_model(problem, deployed, w, "test")
    train = evaluate_model(problem, deployed, w, "train")
    metrics = {
        "method": cfg.method.name, "seed": cfg.seed, **test.as_dict("test"),
        **train.as_dict("train"), "test_acc_before_ft": before.accuracy,
        "per_client_test_acc": test.per_client, "client_ids": list(task.data.client_ids),
        "per_client_test_correct": test.per_client_correct,
        "per_client_test_total": test.per_client_total,
        "test_sizes": problem.num_examples(np.arange(problem.num_clients), "test"),
        "split_counts": counts, "stage2_seconds": s2.seconds,
        "stage3_seconds": time.perf_counter() - t0, **extra, **_budgets(s2.folder or run_dir),
    }
    if save_personalized:
        _save_personalized(cfg, task, split, problem, deployed if full else theta, w, run_dir)
    save_deploy(run_dir, split, _host(theta), _host(problem.w_pretrained), *built)
    return metrics, split, theta


def _save_personalized(cfg: RunSpec, task: Task, split: Split, problem, theta: Params,
                       w: Params, run_dir: Path) -> None:
    """Every client's deployed model in ``run_dir/personalized``
    (:class:`~partialfl.pipeline.deploy.PersonalizedModels`). Ditto / local-only deploy a
    personal copy of every parameter (``theta`` stacked over the clients): saved as a split
    with every parameter personal."""
    from partialfl.pipeline.deploy import PersonalizedModels

    meta = {"method": cfg.method.name, "seed": cfg.seed, "task": task.name}
    if cfg.method.entry.trait("split") == "full":
        names = tuple(n for n, _ in split.model.named_parameters())
        split, w, theta = Split(split.model, "full", (), names), {**w, **theta}, {}
    PersonalizedModels(split, theta, w, task.data.client_ids, problem, meta
                       ).save(run_dir / "personalized")


def _budgets(run_dir: Path) -> dict[str, Any]:
    """Rounds run, cap, plateau stop and seconds of stage 2 (``stage2_timing.json``)."""
    f = run_dir / "stage2_timing.json"
    if not f.exists():
        return {}
    t = pio.read_json(f)
    return {"stage2_rounds": t["rounds"], "stage2_cap": t["cap"],
            "stage2_stopped": t["stopped"]}


def validation_tasks(cfg: RunSpec, task: Task) -> tuple[Task, Task | None]:
    """(the task the stages train and choose on, the task of the final test or None):
    with ``cfg.validation`` the validation view and the fit view of
    :func:`partialfl.data.validation.carve_validation`, else ``(task, None)``."""
    if cfg.validation is None:
        return task, None
    if not isinstance(task.data, FederatedDataset):
        raise ConfigError(f"validation needs the data in memory as a FederatedDataset, got "
                          f"{type(task.data).__name__} (e.g. an on-disk store: load it first)")
    v = carve_validation(task.data, cfg.validation.fraction, cfg.validation.min_examples,
                         cfg.stage1_seed)
    return replace(task, data=v.val), replace(task, data=v.fit)


def run_pipeline(cfg: RunSpec, task: Task, run_dir: str | Path, *,
                 stage1_dir: str | Path | None = None, stage2_dir: str | Path | None = None,
                 progress: bool = True, on_round: Callable[[str, int], None] | None = None,
                 save_personalized: bool = False, stage1_task: Task | None = None
                 ) -> PipelineResult:
    """Run (or resume) the three stages; returns stage 3's metrics (also in metrics.json).
    ``stage1_task``: the task stage 1 pre-trains on (default ``task``; e.g. public clients).

    ``stage2_dir``: where stage 2's files live (default ``run_dir``). Runs whose stage 2 is
    the same computation (:func:`stage2_identity`: e.g. FedAvg followed by fine-tuning of
    different parts — stage 2 trains the whole shared model whatever stage 3 fine-tunes)
    may share one; a folder holding another stage 2 is refused. ``on_round(stage, round)``
    is called after every round of stages 1 and 2 (for progress reporting, or to simulate an
    interruption in tests). ``save_personalized``: also write every client's deployed model
    to ``run_dir/personalized`` (safetensors, load with
    :func:`partialfl.pipeline.deploy.load_personalized`)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    check_or_write_json(run_dir / "config.json", {**cfg.identity(), "task": task.name},
                        "pipeline run")
    s1 = Path(stage1_dir) if stage1_dir is not None else run_dir / "stage1"
    s2dir = Path(stage2_dir) if stage2_dir is not None else run_dir
    _check_stage2_folder(cfg, task, run_dir, s2dir)
    hook1 = hook2 = None
    if on_round is not None:
        def hook1(r, _s):
            on_round("stage1", r)

        def hook2(r, _s):
            on_round("stage2", r)
    pre_task = validation_tasks(cfg, stage1_task)[0] if stage1_task is not None else None
    task, test_task = validation_tasks(cfg, task)
    theta1 = pretrain(cfg, pre_task or task, s1, progress and "stage 1 (FedAvg)",
                      on_round=hook1)
    s2 = personalize(cfg, task, theta1, s2dir,
                     progress and f"stage 2 ({cfg.method.name})", on_round=hook2)
    mfile = run_dir / "metrics.json"
    if mfile.exists() and tensor_file(run_dir, DEPLOY) is not None and (
            not save_personalized or (run_dir / "personalized" / "index.json").exists()):
        metrics = pio.read_json(mfile)
        return PipelineResult(metrics, run_dir, s2.theta, s2.split)
    metrics, split, theta = finetune_and_evaluate(cfg, task, s2, run_dir, test_task,
                                                  save_personalized)
    t1 = s1 / "timing.json"
    if cfg.pretrain.stop is not None and t1.exists():
        t = pio.read_json(t1)
        metrics.update(stage1_rounds=t["rounds"], stage1_stopped=t.get("stopped", False))
    write_json(mfile, metrics)
    # the same plain-JSON values whether computed now or read back from a finished run
    metrics = json.loads(json.dumps(metrics, default=json_default))
    return PipelineResult(metrics, run_dir, theta, split)


def _check_stage2_folder(cfg: RunSpec, task: Task, run_dir: Path, s2dir: Path) -> None:
    """A shared stage-2 folder (``s2dir`` ≠ ``run_dir``) must hold this run's stage 2: its
    own run's ``config.json`` and its ``stage2.json`` (written by the first run sharing it)
    must have this run's :func:`stage2_identity`."""
    mine = stage2_identity({**cfg.identity(), "task": task.name})
    record = s2dir / "stage2.json"
    if s2dir == run_dir and not record.exists():
        return
    s2dir.mkdir(parents=True, exist_ok=True)
    owner = s2dir / "config.json"
    if s2dir != run_dir and owner.exists() and stage2_identity(pio.read_json(owner)) != \
            json.loads(json.dumps(mine, default=json_default)):
        raise ConfigError(f"{s2dir} holds the stage 2 of another configuration; a run shares "
                          "a stage 2 only with runs whose stage 2 is the same")
    check_or_write_json(record, mine, "stage 2")


def warn_diverged(theta: Params, stage: str, history: list[dict] | None = None) -> str:
    """A diverged stage is not hidden: warn when θ is not finite, or when the stage's last
    evaluation has a loss that is not finite (θ finite but blown up); a run whose final
    losses are not finite then says so and exits non-zero (``train_report.divergence_line``).
    Returns the warning about a θ that is not finite ('' if θ is finite)."""
    bad = [n for n, v in theta.items() if not torch.isfinite(v).all()]
    if bad:
        why = (f"{stage} diverged: θ has non-finite values in {bad[:4]}; lower the "
               "learning rates")
        warnings.warn(why, RuntimeWarning, stacklevel=3)
        return why
    last = next((r for r in reversed(history or []) if "test_loss" in r or "eval_loss" in r),
                {})
    losses = [k for k in ("test_loss", "eval_loss") if isinstance(last.get(k), int | float)
              and not math.isfinite(last[k])]
    if losses:
        warnings.warn(f"{stage} diverged: its last {', '.join(losses)} is not finite (θ blew "
                      "up); lower the learning rates", RuntimeWarning, stacklevel=3)
    return ""


__all__ = ["PipelineResult", "Stage2", "finetune_and_evaluate", "personalize", "pretrain",
           "run_pipeline", "stage1_setup", "stage2_identity", "stage2_setup",
           "validation_tasks", "warn_diverged"]
