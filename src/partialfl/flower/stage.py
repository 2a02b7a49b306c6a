"""What the ServerApp and the ClientApps build from the run's spec: the same objects as the
in-process run, through :mod:`partialfl.build` (no name is looked at here).

* A closed-form spec: :func:`partialfl.build.build` — the problem (the synthetic generator
  and its seed are public, so the server rebuilds it for ``lr = "auto"`` and the reference
  metrics ‖θ − θ*‖², ‖F(θ)‖²) and the algorithm with its wrappers and asynchronous rule.
* A model spec, on the server (no data): :func:`partialfl.build.stage_algorithm` of the stage
  for the number of clients the SuperNodes declared; on a SuperNode: the data (the spec's
  ``[data]``, or the node's own client store), the task, and the stage's problem and
  algorithm exactly as the pipeline builds them
  (:func:`~partialfl.pipeline.stages.stage1_setup` /
  :func:`~partialfl.pipeline.stages.stage2_setup`, θ⁰ included).
"""

from __future__ import annotations

from typing import Any

from partialfl.flower.config import ConfigError, FlowerConfig


def _core(fn, *args, **kw):
    from partialfl.config import ConfigError as CoreConfigError

    try:
        return fn(*args, **kw)
    except CoreConfigError as e:
        raise ConfigError(f"spec: {e}") from None


def expected_federation(cfg: FlowerConfig) -> tuple[int | None, int]:
    """``(number of clients, torch)`` the server's spec fixes for the SuperNodes'
    descriptions (:func:`partialfl.flower.federation.describe`): a closed-form spec's
    problem size (built as :func:`server_parts` builds it) and kind; a model spec fixes the
    kind only (its clients are the data's, which the server does not hold)."""
    from partialfl.build import build

    if cfg.run.closed_form:
        return _core(build, cfg.run).problem.num_clients, 0
    return None, 1


def server_parts(cfg: FlowerConfig, num_clients: int) -> tuple[Any, Any]:
    """``(reference problem or None, algorithm)`` of the ServerApp: a closed-form spec's
    problem and algorithm (:func:`partialfl.build.build`), or a model stage's algorithm
    built for ``num_clients`` clients (the server holds no data)."""
    from partialfl.build import async_rule, build, stage_algorithm

    run = cfg.run
    if run.closed_form:
        built = _core(build, run)
        if built.problem.num_clients != num_clients:
            raise ConfigError(f"the SuperNodes hold {num_clients} clients, the spec's problem "
                              f"has {built.problem.num_clients}")
        return built.problem, built.algorithm
    alg = _core(stage_algorithm, run, cfg.stage, num_clients=num_clients)
    if run.asynchronous is not None:
        alg = _core(async_rule, run, alg)
    return None, alg


def node_parts(cfg: FlowerConfig, data=None) -> tuple[Any, Any, Any]:
    """``(problem, algorithm, θ⁰)`` of a SuperNode for the run's stage. ``data``: the node's
    own :class:`~partialfl.data.federated.FederatedDataset` (every training client in the
    run's order, the others' empty; written by ``partialfl flower local``), else the spec's
    ``[data]`` (every client, served by index)."""
    from partialfl import rng as prng
    from partialfl.build import build

    run = cfg.run
    if run.closed_form:
        built = _core(build, run)
        problem = built.problem
        return problem, built.algorithm, problem.init_theta(prng.generator(cfg.seed, "init"))
    from partialfl.build import build_data, model_task
    from partialfl.pipeline.stages import stage1_setup, stage2_setup, validation_tasks

    if data is None:
        data, _ = _core(build_data, run)
        task, _ = validation_tasks(run, _core(model_task, run, data))
    else:  # a node store holds the training view already (validation carved out)
        task = _core(model_task, run, data)
    if cfg.stage == "pretrain":
        problem, alg = _core(stage1_setup, run, task)
        return problem, alg, problem.init_theta(prng.generator(cfg.seed, "init"))
    theta1 = _stage1_params(cfg, task)
    _, problem, alg, theta0 = _core(stage2_setup, run, task, theta1)
    return problem, alg, {n: v.to(problem.device) for n, v in theta0.items()}


def _stage1_params(cfg: FlowerConfig, task) -> dict[str, Any]:
    """Stage 1's parameters: ``init-from`` (every parameter of the model), or the seeded
    initialisation (a run without pre-training, or a method whose trait ``fresh_model``
    starts every seed from a fresh model, as the pipeline does)."""
    import torch

    from partialfl.io import read_npz

    run = cfg.run
    if run.method.entry.trait("fresh_model"):
        return {n: p.detach().clone() for n, p in task.model_fn(run.seed).named_parameters()}
    if not cfg.init_from:
        return {n: p.detach().clone() for n, p in
                task.model_fn(run.stage1_seed).named_parameters()}
    try:
        params = {n: torch.from_numpy(a) for n, a in read_npz(cfg.init_from).items()}
    except (OSError, ValueError) as e:
        raise ConfigError(f"run-config key 'init-from': cannot read {cfg.init_from}: {e}"
                          ) from None
    model = dict(task.model_fn(run.stage1_seed).named_parameters())
    missing = sorted(set(model) - set(params))
    if missing:
        raise ConfigError(f"run-config key 'init-from': {cfg.init_from} lacks parameters "
                          f"{missing[:5]} of the model; it must hold every parameter (stage "
                          "1's theta.npz)")
    bad = [n for n in model if tuple(params[n].shape) != tuple(model[n].shape)]
    if bad:
        raise ConfigError(f"run-config key 'init-from': parameter {bad[0]!r} has shape "
                          f"{tuple(params[bad[0]].shape)}, the model's is "
                          f"{tuple(model[bad[0]].shape)}")
    return {n: params[n] for n in model}
