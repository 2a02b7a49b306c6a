"""The one builder: a run specification (:class:`partialfl.spec.RunSpec`) → the objects that
run it, for ``partialfl run`` / ``train``, the pipeline, the reproductions and the Flower app.

Every name is resolved by the registry (:mod:`partialfl.registry`); what differs per component
is a field or a trait of its entry, never a name check here. :func:`build` makes a
:class:`Run`: a closed-form run's problem and algorithm, or a model run's task (model factory,
data, loss, metric, split builder), its new clients and the plan ``--dry-run`` prints. The
pieces (:func:`build_algorithm`, :func:`build_server_opt`, :func:`build_model`,
:func:`build_split`, …) are what the pipeline and Flower call for one stage.

Code named by a config (``model.name = "package.module:callable"``, ``plugins``) is imported
only when the user allowed it on their own machine (:func:`allow_code`, ``--allow-code``, or
``PARTIALFL_ALLOW_CODE=1``); a Flower node never imports code named by a message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from partialfl.build.algorithm import async_rule, build_algorithm
from partialfl.build.code import _check_code, load_spec_plugins
from partialfl.build.problem import problem_of
from partialfl.build.task import (
    Task,
    build_data,
    build_loss_metric,
    build_model,
    build_split,
    split_of,
)
from partialfl.config import ConfigError
from partialfl.spec import RunSpec


# ----------------------------------------------------------------------------- build(spec)
@dataclass
class Run:
    """What :func:`build` makes of a spec: a closed-form run's ``problem`` and ``algorithm``,
    or a model run's ``task`` and held-out ``new_clients``; the ``plan`` that ``--dry-run``
    prints."""

    spec: RunSpec
    problem: Any = None
    algorithm: Any = None
    task: Any = None
    new_clients: Any = None
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)


def build(spec: RunSpec, progress: bool = False) -> Run:
    """Build a run specification into the objects that run it (``progress``: a bar while a
    large closed-form problem is generated)."""
    if not isinstance(spec, RunSpec):
        raise TypeError(f"build() takes a RunSpec, got {type(spec).__name__}")
    load_spec_plugins(spec)
    if spec.model is not None and ":" in spec.model.name:  # refused before any data is read
        _check_code("model.name", spec.model.name)
    if spec.closed_form:
        return _build_closed_form(spec, progress)
    return _build_model_run(spec)


def _check_problem_kind(e, kind: str) -> None:
    allowed = e.trait("problems", ("closed-form", "model"))
    if kind not in allowed:
        raise ConfigError(f"method.algorithm: {e.name} runs on {' and '.join(allowed)} "
                          f"problems, not on a {kind} problem")


def _build_closed_form(spec: RunSpec, progress: bool) -> Run:
    e = spec.method.entry
    _check_problem_kind(e, "closed-form")
    problem = problem_of(spec, progress)
    stage = spec.personalize
    k = stage.clients_per_round
    if k is not None and not 1 <= k <= problem.num_clients:
        raise ConfigError(f"personalize.clients_per_round={k} but the problem has "
                          f"{problem.num_clients} clients")
    if e.trait("full_participation") and k not in (None, problem.num_clients):
        raise ConfigError(f"personalize.clients_per_round: {e.name} needs full participation "
                          "(0 = all clients)")
    if e.trait("full_participation") and spec.asynchronous is not None:
        raise ConfigError(f"asynchronous: {e.name} needs every client in every round; an "
                          "asynchronous step takes the updates that arrived (remove "
                          "[asynchronous])")
    alg = build_algorithm(spec, stage, problem=problem)
    if spec.asynchronous is not None:
        alg = async_rule(spec, alg)
    plan = {"name": spec.name, "problem": spec.problem.to_dict(), "algorithm": e.name,
            "rounds": stage.rounds, "clients_per_round": k or problem.num_clients,
            "backend": spec.backend.name}
    return Run(spec, problem=problem, algorithm=alg, plan=plan)


def task_name(spec: RunSpec) -> str:
    """A short identity of a model run's task (model, data, loss, metric)."""
    key = json.dumps({"model": dataclasses.asdict(spec.model),
                      "data": spec.data and _plain(spec.data), "loss": spec.loss,
                      "metric": spec.metric}, sort_keys=True, default=str)
    return f"{spec.data.source}-{spec.model.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _plain(obj) -> Any:
    from partialfl.config import to_dict

    return to_dict(obj)


def _check_forward(model, data, loss_fn, vmap: bool = False) -> None:
    """One example through the model and the loss, so a model that does not fit the data
    fails in ``--dry-run`` with a clear message rather than in round 1; with ``vmap`` (the
    ``vmap`` backend) also through ``torch.func.vmap``, which some layers (GRU, LSTM) cannot
    run."""
    import torch

    odd = sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32", "torch.float64"})
    if odd:  # (θ and w travel and are saved as numpy arrays, which hold no bfloat16)
        raise ConfigError(f"model: parameters of dtype {', '.join(odd)}; keep them float32 "
                          "(precision = 'bf16' or 'fp16' runs the passes in half precision)")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:  # every parameter is θ or w and trained: a frozen one would move silently
        raise ConfigError(f"model: parameters {frozen[:4]} have requires_grad=False, but "
                          "partialfl trains every parameter (in θ or w); keep fixed tensors "
                          "as buffers (module.register_buffer) or leave them trainable")
    m = next(i for i in range(data.num_clients) if len(data.train_y[i]))
    x, y = data.train_x[m][:1], data.train_y[m][:1]
    was = model.training
    try:  # in evaluation mode: one example fits a BatchNorm, whose statistics stay put
        with torch.no_grad():
            loss_fn(model.eval()(x), y)
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"model: does not fit the data (inputs {tuple(x.shape[1:])} "
                          f"{x.dtype}, {data.num_classes} classes): {msg}") from None
    finally:
        model.train(was)
    if vmap:
        from torch.func import functional_call
        from torch.func import vmap as tvmap

        params = {n: p.detach().unsqueeze(0) for n, p in model.named_parameters()}
        try:
            with torch.no_grad():
                tvmap(lambda p, xx: functional_call(model.eval(), p, (xx,)))(params, x[None])
        except (RuntimeError, NotImplementedError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"backend vmap: the model cannot run under torch.func.vmap "
                              f"({msg}); use backend 'sequential' or 'processes'") from None
        finally:
            model.train(was)


def is_text(data) -> bool:
    """Whether ``data`` is a text task: integer token sequences ``[n, seq_len]``."""
    return data.train_x[0].dim() == 2 and not data.train_x[0].is_floating_point()


def check_tokens(data, ref, what: str) -> None:
    """Integer (token) inputs of ``data`` within the vocabulary of ``ref``'s labels (a text
    task's inputs and next-token labels share one vocabulary, which sizes the model's
    embedding): a ConfigError naming the token otherwise."""
    if not is_text(data):
        return
    xs = [x for x in (*data.train_x, *data.test_x) if x.numel()]
    if not xs:
        return
    lo, hi = min(int(x.min()) for x in xs), max(int(x.max()) for x in xs)
    if lo < 0 or hi >= int(ref.num_classes):
        raise ConfigError(f"{what}: token id {hi if hi >= int(ref.num_classes) else lo} in the "
                          f"inputs, outside the vocabulary 0..{int(ref.num_classes) - 1} of the "
                          "labels (inputs and next-token labels share one vocabulary)")


def model_task(spec: RunSpec, data) -> Task:
    """The :class:`Task` of a model run on ``data``."""
    loss_fn, metric = build_loss_metric(spec, is_text(data))
    num_classes = int(data.num_classes)

    def model_fn(seed: int):
        return build_model(spec.model, num_classes, seed, data)

    return Task(data=data, model_fn=model_fn, loss_fn=loss_fn, metric=metric,
                split_fn=build_split, name=task_name(spec))


def _build_model_run(spec: RunSpec) -> Run:
    from partialfl.devices import check_precision, resolve_device

    e = spec.method.entry
    _check_problem_kind(e, "model")
    try:
        device = resolve_device(spec.device)
        check_precision(spec.precision, device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    data, new = build_data(spec)
    if new is not None and int(new.test_sizes().sum()) == 0:  # (else refused after training)
        raise ConfigError(f"data.holdout: the held-out clients {list(new.client_ids)[:5]} have "
                          "no test example to evaluate on; drop their empty files or choose "
                          "another data.seed")
    if int(data.train_sizes().sum()) == 0:  # (else a StopIteration, or stages of no steps)
        raise ConfigError(f"data: none of the {data.num_clients} clients holds a training "
                          "example (test examples only): nothing to train; cold-start "
                          "clients are evaluated with `partialfl evaluate RUN --data PATH`")
    check_tokens(data, data, "data")
    task = model_task(spec, data)
    run = spec.effective()
    model = task.model_fn(run.stage1_seed)
    try:
        split = build_split(model, *split_of(run.method))
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"method.split: {err}") from None
    build_algorithm(run, run.personalize, num_clients=data.num_clients)  # validates
    if run.pretrain.rounds > 0:  # stage 1's FedAvg, under the same aggregation and attack
        from partialfl.spec import MethodConfig

        build_algorithm(run, run.pretrain, method=MethodConfig(algorithm="fedavg"),
                        num_clients=data.num_clients)
    _check_forward(split.model, data, task.loss_fn, vmap=spec.backend.name == "vmap")
    counts = split.counts() if hasattr(split, "counts") else {}
    plan = {
        "name": spec.name, "data": data.summary(), "clients": data.num_clients,
        "train_examples": int(data.train_sizes().sum()),
        "test_examples": int(data.test_sizes().sum()),
        "new_clients": 0 if new is None else new.num_clients,
        "model": spec.model.name, "num_classes": int(data.num_classes),
        "parameters": int(sum(p.numel() for p in split.model.parameters())),
        "split": run.method.split_kind, "split_counts": counts,
        "algorithm": e.name, "stages": list(spec.stages),
        "rounds": {"pretrain": run.pretrain.rounds, "personalize": run.personalize.rounds},
        "finetune_epochs": run.finetune.epochs,
        "full_personal": e.trait("split") == "full", "fresh_model": bool(e.trait("fresh_model")),
        "device": spec.device if spec.device == str(device) else f"{spec.device} → {device}",
        "precision": spec.precision, "memory_format": spec.memory_format,
        "backend": spec.backend.name, "threads": spec.threads,
    }
    return Run(spec, task=task, new_clients=new, plan=plan)
