"""Model problems (FEMNIST) on Flower: the builders and the per-node evaluation.

The run config is mapped onto the three-stage pipeline's own config
(:class:`partialfl.experiments.pipeline.MethodConfig` and ``StageConfig``, validated there) and
the algorithm is built by :func:`partialfl.experiments.pipeline.build_algorithm` — FFGG with
the SGD fine-tuner, Local FFGG (Algorithm 4) or FedAvg, with the server optimizer, schedule
and clipping of ``ServerConfig``. The problem is
:class:`partialfl.problems.model.ModelProblem` over
:func:`partialfl.data.femnist.load_femnist_npz`, :func:`partialfl.build.build_model` (seeded
with the run seed, optionally loaded from ``init-from`` = stage 1) and
:func:`partialfl.split.make_split` (seeded like the pipeline's stage 2).

Every SuperNode builds the same problem from the same file and serves only the writers of its
partition (client ids are positions in the file's ``writers`` array, so seeds match the
in-process simulator); on a real deployment each machine's file may hold only its own
writers' rows as long as the ``writers`` array is the shared list.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from partialfl.algorithms.base import RoundContext, ServerState
from partialfl.flower.config import ConfigError, FlowerConfig, w_init


def _core(fn, *args, **kw):
    from partialfl.config import ConfigError as CoreConfigError

    try:
        return fn(*args, **kw)
    except (CoreConfigError, ValueError) as e:
        raise ConfigError(f"run config: {e}") from None


def pipeline_configs(cfg: FlowerConfig):
    """``(MethodConfig, StageConfig)`` of the pipeline for this run (stage 2 for FFGG /
    Local FFGG, stage 1 for FedAvg, which trains every parameter)."""
    from partialfl.experiments.pipeline import (
        ClientConfig,
        MethodConfig,
        ServerConfig,
        StageConfig,
    )

    algo = "ffgg" if cfg.algorithm == "br-ffgg" else cfg.algorithm
    method = _core(MethodConfig, algorithm=algo,
                   split="none" if algo == "fedavg" else cfg.split, w_init=w_init(cfg),
                   local_steps=cfg.local_steps if algo == "local-ffgg" else None,
                   weighting=cfg.weighting)
    lr = 1.0 if cfg.server_lr == "auto" else cfg.server_lr
    if isinstance(lr, str):
        raise ConfigError(f"run-config key 'server-lr': {lr!r} needs a problem with a known "
                          "constant L (least squares); give a number")
    server = _core(ServerConfig, optimizer=cfg.server_opt, lr=float(lr),
                   momentum=cfg.server_momentum, schedule=cfg.schedule,
                   warmup=cfg.warmup_rounds, halve_every=cfg.halve_every,
                   clip_norm=cfg.server_clip or None)
    client = _core(ClientConfig, lr=cfg.local_lr, epochs=cfg.local_epochs,
                   batch_size=cfg.batch_size)
    stage = _core(StageConfig, rounds=cfg.num_rounds,
                  clients_per_round=cfg.clients_per_round or None, client=client,
                  server=server)
    return method, stage


def train_spec(cfg: FlowerConfig):
    """The :class:`partialfl.spec.TrainSpec` of a ``problem = 'train'`` run."""
    import base64
    import binascii
    import json

    from partialfl.config import from_dict
    from partialfl.spec import TrainSpec

    text = cfg.train_spec
    try:
        if text.startswith("b64:"):
            text = base64.urlsafe_b64decode(text[4:].encode()).decode()
        data = json.loads(text)
    except (json.JSONDecodeError, binascii.Error, UnicodeDecodeError) as e:
        raise ConfigError(f"run-config key 'train-spec': neither JSON nor b64:JSON: {e}"
                          ) from None
    return _core(from_dict, TrainSpec, data)


_SPEC_CACHE: dict = {}


def _spec_stage(cfg: FlowerConfig):
    """``(problem, algorithm)`` of the spec's stage, built exactly as the in-process pipeline
    builds it (:func:`partialfl.experiments.pipeline.stage1_setup` / ``stage2_setup``; the
    data, model and split from :func:`partialfl.build.build`)."""
    key = (cfg.train_spec, cfg.train_stage, cfg.init_from)
    if key not in _SPEC_CACHE:
        import torch

        from partialfl.build import build
        from partialfl.experiments.pipeline import stage1_setup, stage2_setup

        run = _core(build, train_spec(cfg))
        if cfg.train_stage == "pretrain":
            problem, algorithm = stage1_setup(run.pipeline, run.task)
        else:
            if not cfg.init_from:
                raise ConfigError("run-config key 'init-from': stage 'personalize' needs the "
                                  "stage-1 parameters (.npz)")
            with np.load(cfg.init_from) as z:
                theta1 = {n: torch.from_numpy(z[n]) for n in z.files}
            _, problem, algorithm, _ = stage2_setup(run.pipeline, run.task, theta1)
        _SPEC_CACHE.clear()
        _SPEC_CACHE[key] = (problem, algorithm)
    return _SPEC_CACHE[key]


def build_model_problem(cfg: FlowerConfig):
    """The :class:`~partialfl.problems.model.ModelProblem` of the run (FEMNIST, or any
    ``partialfl train`` spec)."""
    if cfg.problem == "train":
        return _spec_stage(cfg)[0]
    if cfg.problem != "femnist":
        raise ConfigError(f"run-config key 'problem': unknown model problem {cfg.problem!r}; "
                          "allowed: femnist")
    import torch

    from partialfl.build import build_model, build_split
    from partialfl.data.femnist import load_femnist_npz
    from partialfl.experiments.pipeline import load_params
    from partialfl.problems.model import ModelProblem
    from partialfl.rng import torch_seed
    from partialfl.spec import ModelSpec

    method, _ = pipeline_configs(cfg)
    data = load_femnist_npz(cfg.data_dir or None, file_name=cfg.data_file)
    try:
        model = build_model(ModelSpec(name=cfg.model), data.num_classes, cfg.seed)
    except ValueError as e:
        raise ConfigError(f"run-config key 'model': {e}") from None
    if cfg.init_from:
        with np.load(cfg.init_from) as z:
            params = {n: torch.from_numpy(z[n]) for n in z.files}
        missing = sorted(set(dict(model.named_parameters())) - set(params))
        if missing:
            raise ConfigError(
                f"run-config key 'init-from': {cfg.init_from} lacks parameters {missing[:5]} of "
                f"model {cfg.model!r}; it must hold every parameter (e.g. theta.npz of a "
                "FedAvg run)")
        try:
            load_params(model, params)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"run-config key 'init-from': {e}") from None
    # seeded as the pipeline's stage 2 does (adapter initialisation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(cfg.seed, "split"))
        try:
            split = build_split(model, method.split)
        except ValueError as e:
            raise ConfigError(f"run-config key 'split': {e}") from None
    return ModelProblem(split, data)


def build_model_algorithm(cfg: FlowerConfig, aggregator=None):
    """The pipeline's algorithm for this run; ``aggregator`` replaces its mean."""
    from partialfl.experiments.pipeline import MethodConfig, build_algorithm

    if cfg.problem == "train":  # no data needed: the server builds only the algorithm
        pipe = train_spec(cfg).pipeline_config()
        if cfg.train_stage == "pretrain":
            algorithm = build_algorithm(MethodConfig(algorithm="fedavg", split="none"),
                                        pipe.pretrain)
        else:
            algorithm = build_algorithm(pipe.method, pipe.personalize)
    else:
        method, stage = pipeline_configs(cfg)
        algorithm = build_algorithm(method, stage)
    if aggregator is not None:
        algorithm.aggregator = aggregator
    return algorithm


def evaluate_model_clients(rt, theta, round_: int) -> dict[str, Any]:
    """Sums over this node's clients of the test counts of
    :meth:`~partialfl.problems.model.ModelProblem.metric_counts` (:func:`count_sums`), or
    ``{}`` when fewer than ``rt.eval_min_clients`` of them have test data. No per-client value
    is sent."""
    own = rt.clients
    dep = rt.algorithm.deploy(ServerState(theta=theta, round=round_), rt.problem, own, None,
                              RoundContext(rt.cfg.seed, -1))
    return count_sums(rt.problem.metric_counts(own, dep.theta, dep.w, "test"),
                      getattr(rt, "eval_min_clients", 1))


def count_sums(per_client: dict[str, Any], min_clients: int = 1) -> dict[str, Any]:
    """The node's evaluation reply from its per-client counts (which stay on the node):
    ``clients``, ``correct.sum``, ``total.sum``, ``loss_sum.sum``, ``loss_weight.sum`` and
    ``acc.sum`` / ``acc.count`` (Σ and number of per-client accuracies over the clients with
    test data) — or ``{}`` (withheld) when fewer than ``min_clients`` clients have test data,
    so no reply is about fewer clients than that."""
    counts = {k: np.asarray(v, dtype=np.float64) for k, v in per_client.items()}
    t = counts["total"]
    acc = counts["correct"][t > 0] / t[t > 0]
    if acc.size < min_clients:
        return {}
    out: dict[str, Any] = {"clients": float(len(t))}
    out.update({f"{k}.sum": float(v.sum()) for k, v in counts.items()})
    out["acc.sum"], out["acc.count"] = float(acc.sum()), float(acc.size)
    return out


def summarize_sums(sums: dict[str, Any]) -> dict[str, float]:
    """The server's evaluation metrics from the nodes' summed counts: pooled accuracy, loss
    and the mean per-client accuracy (exact). No percentiles over clients: they would need
    per-client values at the server, which the SuperNodes do not send."""
    return {"eval_acc": sums["correct.sum"] / max(sums["total.sum"], 1e-12),
            "eval_acc_client_mean": sums["acc.sum"] / max(sums["acc.count"], 1.0),
            "eval_loss": sums["loss_sum.sum"] / max(sums["loss_weight.sum"], 1e-12)}
