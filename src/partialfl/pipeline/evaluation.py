"""Evaluation of personalized models on federated data.

For clients m with per-client metric counts (c_m, t_m) — e.g. correct predictions and examples,
or correct and counted tokens for next-word prediction (the metric is pluggable:
``ModelProblem(metric=...)`` returns per-example ``(correct, total)``) —

    accuracy (weighted = pooled)   = Σ_m c_m / Σ_m t_m,
    per-client accuracy            a_m = c_m / t_m   (clients with t_m = 0 are left out),
    distribution                   10th / 50th / 90th percentile and mean of {a_m}.

:func:`evaluate_new_clients` measures what the paper's Theorem 4 motivates: the benefit of a
trained θ for clients never seen in training — each new client fine-tunes its own w on its
training data (θ fixed) and is evaluated on its test data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from partialfl import io as pio
from partialfl.algorithms.base import Algorithm, RoundContext, ServerState
from partialfl.algorithms.ditto import personal_models
from partialfl.local.sgd import SGDConfig, run_sgd
from partialfl.pipeline.files import deployed_split, read_deploy
from partialfl.pipeline.run_files import confined
from partialfl.problems.model import ModelProblem, accuracy, cross_entropy
from partialfl.spec import RunSpec
from partialfl.split import Split, make_split
from partialfl.types import Params


@dataclass(frozen=True)
class Evaluation:
    """Metrics of one split of the data (see the module docstring)."""

    accuracy: float
    per_client: np.ndarray
    p10: float
    p50: float
    p90: float
    mean_client: float
    loss: float
    total: float
    #: per-client metric counts c_m and t_m (correct, total), for paired statistics
    per_client_correct: np.ndarray | None = None
    per_client_total: np.ndarray | None = None

    def as_dict(self, prefix: str) -> dict[str, float]:
        """The scalar metrics as ``{prefix}_acc``, ``{prefix}_acc_p10`` … ``{prefix}_loss``."""
        return {f"{prefix}_acc": self.accuracy, f"{prefix}_acc_p10": self.p10,
                f"{prefix}_acc_p50": self.p50, f"{prefix}_acc_p90": self.p90,
                f"{prefix}_acc_client_mean": self.mean_client, f"{prefix}_loss": self.loss}


def summarize_counts(counts: Mapping[str, np.ndarray]) -> Evaluation:
    """Metrics from per-client ``correct``, ``total``, ``loss_sum``, ``loss_weight``."""
    c, t = np.asarray(counts["correct"], float), np.asarray(counts["total"], float)
    if t.sum() <= 0:
        raise ValueError("no example to evaluate on (every client has total = 0)")
    with np.errstate(invalid="ignore", divide="ignore"):
        per = np.where(t > 0, c / np.where(t > 0, t, 1), np.nan)
    valid = per[~np.isnan(per)]
    p10, p50, p90 = (float(np.percentile(valid, q)) for q in (10, 50, 90))
    lw = float(np.sum(counts["loss_weight"]))
    return Evaluation(
        accuracy=float(c.sum() / t.sum()), per_client=per, p10=p10, p50=p50, p90=p90,
        mean_client=float(valid.mean()), loss=float(np.sum(counts["loss_sum"]) / max(lw, 1e-12)),
        total=float(t.sum()), per_client_correct=c, per_client_total=t,
    )


def evaluate_model(problem: ModelProblem, theta: Params, w: Params, split: str = "test",
                   cohort: np.ndarray | None = None) -> Evaluation:
    """Metrics of the model (θ, w_m) of every client in ``cohort`` (default: all) on
    ``split``. ``theta`` is shared or per client; ``w`` is stacked over the cohort."""
    cohort = np.arange(problem.num_clients) if cohort is None else np.asarray(cohort)
    return summarize_counts(problem.metric_counts(cohort, theta, w, split))


def round_evaluator(splits: Sequence[str] = ("test",), every: int = 1
                    ) -> Callable[[Algorithm, ServerState, Any, Any, RoundContext], dict]:
    """An ``evaluate=`` callback for :func:`partialfl.runtime.run_rounds`: the metrics of the
    model every client would deploy after the round (``algorithm.deployed``: e.g. FFGG
    fine-tunes every client's w from θ; FedAlt uses the stored w_m)."""

    def evaluate(algorithm, state, problem, client_state, ctx) -> dict:
        dep = algorithm.deployed(state, problem, client_state, ctx)
        out: dict[str, float] = {}
        for s in splits:
            out.update(evaluate_model(problem, dep.theta, dep.w, s).as_dict(s))
        return out

    return evaluate


def finetune_personal(problem: ModelProblem, theta: Params, w: Params, cfg: SGDConfig,
                      seed: int, cohort: np.ndarray | None = None, stream: str = "stage3"
                      ) -> Params:
    """Fine-tune every client's w (θ fixed) with ``cfg`` SGD epochs from ``w`` (stacked over
    the cohort, default all clients): the pipeline's stage 3 (rng stream ``stream``, round
    "offline")."""
    cohort = np.arange(problem.num_clients) if cohort is None else np.asarray(cohort)
    if not problem.w_names:
        return w
    return run_sgd(problem, cohort, theta, w, train="w", cfg=cfg, seed=seed, round_=-1,
                   stream=stream).w


def evaluate_new_clients(
    theta: Params,
    model: nn.Module | None,
    split: str | Split,
    data,
    finetune_epochs: int = 5,
    *,
    lr: float,
    batch_size: int = 32,
    clip_norm: float | None = None,
    w_init: str = "pretrained",
    w_pretrained: Params | None = None,
    split_options: Mapping[str, Any] | None = None,
    seed: int = 0,
    loss_fn=cross_entropy,
    metric=accuracy,
    vectorize: bool = True,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    memory_format: str = "contiguous",
) -> dict[str, Any]:
    """Evaluate a trained θ on clients never seen in training, after fine-tuning their w.

    Args:
        theta: the trained global parameters (names of the split's global side).
        model: the architecture (an ``nn.Module``; its parameter values are ignored except
            as the default personal starting point); None if ``split`` is a ready Split.
        split: a split kind for :func:`partialfl.split.make_split` (with ``split_options``)
            or a ready :class:`~partialfl.split.Split` (e.g. with adapters inserted).
        data: a FederatedDataset of the new clients (train = fine-tuning data, test =
            evaluation data).
        finetune_epochs: SGD epochs on w per client (0: evaluate w at its start value).
        lr, batch_size, clip_norm: the fine-tuning SGD (θ fixed).
        w_init: where w starts: ``pretrained`` (``w_pretrained``, default the model's own
            personal values), ``zero`` or ``random``.
        seed: seeds the minibatches (and a random w).
        loss_fn, metric, vectorize, device, precision, memory_format: as in
            :class:`~partialfl.problems.model.ModelProblem`.

    Returns:
        ``{"test": Evaluation, "train": Evaluation (absent when no new client has training
        examples), "before": Evaluation (test, w at its start), "num_clients": M, "split":
        kind}``; ``Evaluation.as_dict`` flattens them.
    """
    if isinstance(split, Split):
        sp = split
    else:
        if model is None:
            raise ValueError("pass the model (nn.Module) when split is a kind name")
        sp = make_split(model, split, **dict(split_options or {}))
    missing = sorted(set(sp.global_names) - set(theta))
    extra = sorted(set(theta) - set(sp.global_names))
    if missing or extra:
        raise KeyError(f"theta does not match the split's global parameters: missing "
                       f"{missing[:5]}, unexpected {extra[:5]}")
    if not isinstance(finetune_epochs, int) or finetune_epochs < 0:
        raise ValueError(f"finetune_epochs must be a non-negative integer, got {finetune_epochs!r}")
    problem = ModelProblem(sp, data, loss_fn=loss_fn, metric=metric, w_pretrained=w_pretrained,
                           vectorize=vectorize, device=device, precision=precision,
                           memory_format=memory_format)
    th = {n: torch.as_tensor(theta[n]).detach().to(problem.device).clone()
          for n in sp.global_names}
    allc = np.arange(problem.num_clients)
    w0 = problem.init_w(allc, w_init, seed, -1)
    before = evaluate_model(problem, th, w0, "test")
    w = w0
    if finetune_epochs > 0:
        cfg = SGDConfig(lr=lr, epochs=finetune_epochs, batch_size=batch_size, clip_norm=clip_norm)
        w = finetune_personal(problem, th, w0, cfg, seed, stream="new-clients")
    return {"test": evaluate_model(problem, th, w, "test"), **_on_train(problem, th, w),
            "before": before, "num_clients": problem.num_clients, "split": sp.kind}


def _on_train(problem: ModelProblem, theta: Params, w: Params) -> dict[str, Evaluation]:
    """``{"train": metrics on the new clients' fine-tuning data}``, or nothing when none of
    them has any (cold-start clients, fine-tuned zero steps, evaluated on their test data)."""
    if problem.num_examples(np.arange(problem.num_clients), "train").sum() == 0:
        return {}
    return {"train": evaluate_model(problem, theta, w, "train")}


# ----------------------------------------------------------------------------- runs
def evaluate_run(run_dir: str | Path, data, *, model_fn: Callable[[int], nn.Module],
                 split_fn=None, finetune_epochs: int | None = None,
                 lr: float | None = None, batch_size: int | None = None, seed: int | None = None,
                 loss_fn=cross_entropy, metric=accuracy, vectorize: bool = False,
                 device: str = "cpu") -> dict[str, Any]:
    """Evaluate a finished run's θ on new clients (``data``, never seen in training): each
    fine-tunes its w from the run's w_pre with the run's stage-3 settings (override with the
    arguments), then :func:`evaluate_new_clients` metrics. The
    architecture comes from ``model_fn`` (and ``split_fn``) of the run's task; its tensors
    from ``deploy.safetensors`` (no code is loaded from the run folder)."""
    run_dir = Path(run_dir)
    if lr is not None and not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    read_deploy(run_dir)  # a clear error first if the run is unfinished or the file unsafe
    # its spec and stage-3 choice are read too: from this run, not through a link out of it
    confined(run_dir, [run_dir / "config.json", run_dir / "metrics.json"])
    cfg = RunSpec.from_dict(
        {k: v for k, v in pio.read_json(run_dir / "config.json").items() if k != "task"})
    split, theta, w_pre = deployed_split(run_dir, cfg, model_fn, split_fn)
    ft = cfg.finetune
    if cfg.method.entry.trait("split") == "full":
        return _evaluate_new_full_personal(cfg, split, theta, data, finetune_epochs, lr,
                                           batch_size, seed, loss_fn, metric, vectorize, device)
    mfile = run_dir / "metrics.json"
    choice = pio.read_json(mfile).get("finetune_choice") if mfile.exists() else None
    if choice:  # stage 3's setting chosen on validation data (values checked by ``ft``)
        if not (isinstance(choice, dict) and {"epochs", "lr"} <= choice.keys()):
            raise pio.FileFormatError(f"{mfile}: finetune_choice must be an object with "
                                      f"epochs and lr, got {repr(choice)[:60]}")
        ft = replace(ft, epochs=choice["epochs"], lr=choice["lr"])
    lr = ft.lr if lr is None else lr
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    res = evaluate_new_clients(
        theta, None, split, data,
        ft.epochs if finetune_epochs is None else finetune_epochs,
        lr=lr, batch_size=batch_size if batch_size is not None else ft.batch_size,
        clip_norm=ft.clip_norm, w_init="pretrained", w_pretrained=w_pre,
        seed=cfg.seed if seed is None else seed, loss_fn=loss_fn, metric=metric,
        vectorize=vectorize, device=device, precision=cfg.precision,
        memory_format=cfg.memory_format)
    return res


def _evaluate_new_full_personal(cfg: RunSpec, split: Split, theta: Params, data, epochs,
                                lr, batch_size, seed, loss_fn, metric, vectorize, device
                                ) -> dict[str, Any]:
    """New clients of Ditto / local-only (see the module docstring): v from the deployed θ."""
    problem = ModelProblem(split, data, loss_fn=loss_fn, metric=metric, vectorize=vectorize,
                           device=device, precision=cfg.precision,
                           memory_format=cfg.memory_format)
    theta = {n: v.to(problem.device) for n, v in theta.items()}
    local = bool(cfg.method.entry.trait("fresh_model"))
    if epochs is None:
        epochs = (cfg.personalize.rounds * cfg.personalize.client.get("epochs", 1) if local
                  else cfg.finetune.epochs)
    if lr is None:
        lr = cfg.personalize.client.get("lr") if local else cfg.finetune.lr
    sgd = SGDConfig(lr=lr, epochs=int(epochs),
                    batch_size=batch_size if batch_size is not None else cfg.finetune.batch_size,
                    clip_norm=cfg.finetune.clip_norm)
    allc = np.arange(problem.num_clients)
    stacked = {n: t.unsqueeze(0).repeat(len(allc), *([1] * t.dim())) for n, t in theta.items()}
    v, _ = personal_models(problem, allc, stacked, theta, sgd,
                           0.0 if local else cfg.method.option("lam", 0.0),
                           cfg.seed if seed is None else seed, -1, stream="new-clients")
    return {"test": evaluate_model(problem, v, {}, "test"), **_on_train(problem, v, {}),
            "before": evaluate_model(problem, theta, {}, "test"),
            "num_clients": problem.num_clients, "split": "none"}
