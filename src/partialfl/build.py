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
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialfl.config import ConfigError
from partialfl.registry import Component, component, entry, load_plugins
from partialfl.spec import RunSpec, ServerConfig, StageConfig, parse_lr

ALLOW_CODE_ENV = "PARTIALFL_ALLOW_CODE"
_ALLOW_CODE: list[bool] = []


@contextmanager
def allow_code(allowed: bool | None = True) -> Iterator[None]:
    """Within this block, configs may name code to import (``module:callable`` models,
    ``plugins``) if ``allowed`` (None: as outside the block). The CLI's ``--allow-code``
    sets it; so does ``PARTIALFL_ALLOW_CODE=1``."""
    if allowed is None:
        yield
        return
    _ALLOW_CODE.append(bool(allowed))
    try:
        yield
    finally:
        _ALLOW_CODE.pop()


def code_allowed() -> bool:
    """Whether a config may name code to import now (see :func:`allow_code`)."""
    if _ALLOW_CODE:
        return _ALLOW_CODE[-1]
    return os.environ.get(ALLOW_CODE_ENV, "") == "1"


def _check_code(what: str, ref: str) -> None:
    if not code_allowed():
        raise ConfigError(f"{what}: {ref!r} names code to import and run; components are "
                          f"chosen by registered name unless you allow code from configs on "
                          f"your own machine: partialfl … --allow-code (or "
                          f"{ALLOW_CODE_ENV}=1)")


def load_spec_plugins(plugins) -> None:
    """Import a spec's ``plugins`` (user modules that register components), if allowed; a
    spec's loader calls this before validating the rest, which may name their components."""
    if isinstance(plugins, RunSpec):
        plugins = plugins.plugins
    if not isinstance(plugins, list | tuple) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"plugins: expected a list of module names, got {plugins!r}")
    for mod in plugins:
        _check_code("plugins", mod)
    load_plugins(plugins)


# ----------------------------------------------------------------------------- optimizers
def build_server_opt(server: ServerConfig, rounds: int, L: float | None = None,
                     auto_lr: float = 1.0):
    """The server optimizer of ``server`` over ``rounds`` rounds: the schedule, ``lr``
    resolved (``"auto"`` → ``auto_lr``; ``"c/L"`` → c/L), optional clipping."""
    from partialfl.server import Clipped, OptimizerContext, ScheduleContext

    try:
        sched = server.schedule.build(ScheduleContext(total=max(rounds, 1)))
    except ValueError as e:
        raise ConfigError(f"server.schedule: {e}") from None
    lr = auto_lr if server.lr == "auto" else parse_lr(server.lr, L)
    opt = server.optimizer.build(OptimizerContext(lr, sched))
    return Clipped(opt, server.clip_norm) if server.clip_norm else opt


def build_aggregator(spec: RunSpec, seed: int | None = None):
    """The server's aggregation rule (None: the algorithm's default, the mean)."""
    if spec.aggregation is None:
        return None
    from partialfl.aggregation.compose import AggregatorContext

    try:
        return spec.aggregation.build(AggregatorContext(seed=spec.seed if seed is None
                                                        else seed))
    except ValueError as e:
        raise ConfigError(f"aggregation: {e}") from None


# ----------------------------------------------------------------------------- algorithms
def build_algorithm(spec: RunSpec, stage: StageConfig, *, method=None, problem=None,
                    num_clients: int | None = None, wrap: bool = True):
    """The algorithm of ``method`` (default ``spec.method``) for one stage: its entry built
    with the stage's client optimizer and server optimizer, the run's aggregation rule,
    weighting and w initialisation; then (``wrap``) the run's wrappers, innermost first:
    fault injection, Byzantine clients (with the robust aggregation rule), differential
    privacy. ``problem`` (closed forms) resolves ``lr = "auto"`` / ``"c/L"`` against its
    smoothness constant L."""
    from partialfl.algorithms.context import AlgorithmContext

    method = method or spec.method
    e = method.entry
    L = getattr(problem, "L", None)
    auto = 1.0 / L if (L is not None and e.trait("sends") == "gradient") else 1.0
    opt = build_server_opt(stage.server, stage.rounds, L, auto)
    agg = build_aggregator(spec)
    ctx = AlgorithmContext(stage.client.build(), opt, agg, method.weighting, method.w_init,
                           e.name)
    try:
        alg = e.create(method.options, ctx)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"method: {err}") from None
    if wrap:
        n = num_clients if num_clients is not None else getattr(problem, "num_clients", None)
        alg = wrap_algorithm(spec, alg, n, stage.clients_per_round, agg, stage.rounds)
    return alg


def stage_algorithm(spec: RunSpec, stage: str, *, problem=None, num_clients: int | None = None):
    """The algorithm of one federated stage of a model run, with its wrappers: ``pretrain``
    is FedAvg on every parameter with ``[pretrain]``'s optimizers, ``personalize`` the
    spec's method with ``[personalize]``'s (what the pipeline's stages build; a Flower
    ServerApp, which holds no data, builds it from this and the number of clients)."""
    from partialfl.spec import MethodConfig

    if stage == "pretrain":
        return build_algorithm(spec, spec.pretrain, method=MethodConfig(algorithm="fedavg"),
                               problem=problem, num_clients=num_clients)
    return build_algorithm(spec, spec.personalize, problem=problem, num_clients=num_clients)


def wrap_algorithm(spec: RunSpec, alg, num_clients: int | None,
                   clients_per_round: int | None, aggregator=None, rounds: int | None = None):
    """``alg`` inside the run's wrappers (faults, attack, privacy), innermost first."""
    from partialfl.algorithms.context import WrapperContext

    for block in (spec.faults, spec.attack, spec.privacy):
        if block is None:
            continue
        ctx = WrapperContext(alg, spec.seed, num_clients, clients_per_round, aggregator, rounds)
        try:
            alg = block.build(ctx)
        except ValueError as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"{block.entry.trait('block')}: {err}") from None
    return alg


def async_rule(spec: RunSpec, alg):
    """``alg`` inside the asynchronous rule of ``spec.asynchronous`` (FedAsync, FedBuff)."""
    from partialfl.algorithms.context import WrapperContext

    return spec.asynchronous.rule.build(WrapperContext(alg, spec.seed))


# ----------------------------------------------------------------------------- closed form
_CACHE: dict = {}


def build_problem(problem: Component, shared_w: bool = False, progress: bool = False):
    """The closed-form problem of a ``[problem]`` component (the two most recent are cached:
    building least squares reads n×d data; ``progress`` shows a bar over its clients);
    ``shared_w``: the algorithm shares w, so least squares uses its standard basis."""
    from partialfl.problems.base import ProblemContext

    key = (problem, bool(shared_w))
    if key not in _CACHE:
        try:
            built = problem.build(ProblemContext(progress, shared_w))
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"problem: {e}") from e
        while len(_CACHE) >= 2:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = built
    return _CACHE[key]


def problem_of(spec: RunSpec, progress: bool = False):
    """The closed-form problem of ``spec`` as its algorithm needs it."""
    return build_problem(spec.problem, bool(spec.method.entry.trait("shared_w")), progress)


# ----------------------------------------------------------------------------- models
def import_callable(ref: str, key: str = "model.name") -> Callable:
    """``package.module:attr`` → the object (a clear error if either part is missing), only
    where code from configs is allowed (:func:`allow_code`)."""
    _check_code(key, ref)
    mod_name, _, attr = ref.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module {mod_name!r} of {ref!r}: {e} (the "
                          f"config's folder and the working folder are searched)") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: {ref!r} is not callable")
    return obj


def build_model(model_spec, num_classes: int, seed: int, data=None):
    """A fresh model of a :class:`~partialfl.spec.ModelSpec`, seeded from (seed, model init)
    (the global torch RNG is left untouched)."""
    import torch
    from torch import nn

    from partialfl.models.base import ModelContext
    from partialfl.rng import torch_seed

    opts = dict(model_spec.options)
    if ":" in model_spec.name:
        fn = import_callable(model_spec.name)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        if "num_classes" in params and "num_classes" not in opts:
            opts["num_classes"] = num_classes
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch_seed(seed, "model_init"))
            try:
                model = fn(**opts)
            except TypeError as e:
                raise ConfigError(f"model.options: {model_spec.name}: {e}") from None
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.name: {model_spec.name!r} returned "
                              f"{type(model).__name__}, not a torch.nn.Module")
        return model
    c = component("model", {"name": model_spec.name.replace("-", "_"), **opts}, "model")
    try:
        return c.build(ModelContext(int(num_classes), seed, data))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.options: {e}") from None


def make_model(name: str, num_classes: int, *, seed: int | None = None, **options: Any):
    """Registered model ``name`` with ``num_classes`` outputs and its ``options`` (names may
    use hyphens for underscores). With ``seed`` the initial weights come from
    ``torch_seed(seed, "model_init")`` (the global torch RNG untouched)."""
    from partialfl.models.base import ModelContext

    c = component("model", {"name": name.replace("-", "_"), **options}, "model")
    return c.build(ModelContext(int(num_classes), seed))


def build_split(model, kind: str, options: Mapping[str, Any] | None = None, *,
                example_input=None):
    """Which parameters of ``model`` are personal: a registered split, or ``preset:NAME`` (a
    preset algorithm's own split with the preset's options)."""
    if kind.startswith("preset:"):
        from partialfl.algorithms.presets import preset_split

        return preset_split(kind[len("preset:"):], model, dict(options or {}), example_input)
    from partialfl.split import build_split as split_of

    return split_of(model, kind, options, example_input=example_input)


def split_of(method, finetune: bool = False) -> tuple[str, dict[str, Any]]:
    """``(kind, options)`` of a method's split for :func:`build_split` (``finetune``: its
    ``finetune_split``, stage 3 after a shared-model algorithm; a preset: ``preset:NAME``
    with the preset's options)."""
    if finetune:
        return method.finetune_split.name, _options(method.finetune_split)
    if method.entry.trait("split") == "preset":
        o = method.options
        return (f"preset:{method.algorithm}",
                {} if o is None else {f.name: getattr(o, f.name) for f in dataclasses.fields(o)})
    return method.split_kind, _options(method.split)


def _options(c: Component | None) -> dict[str, Any]:
    return {} if c is None else {k: v for k, v in c.to_dict().items() if k != "name"}


def build_loss_metric(spec: RunSpec, text: bool):
    """``(loss_fn, metric)`` of a model run (``auto``: by the data's kind)."""
    loss = spec.loss if spec.loss != "auto" else (
        "token-cross-entropy" if text else "cross-entropy")
    metric = spec.metric if spec.metric != "auto" else (
        "next-word-accuracy" if text else "accuracy")
    return entry("loss", loss).create(), entry("metric", metric).create()


def build_data(spec: RunSpec, base: Path | None = None):
    """The ``(training clients, new clients or None)`` of ``spec.data``."""
    from partialfl.data.federated import DataFormatError
    from partialfl.data.partition import PartitionContext
    from partialfl.data.paths import DataNotFoundError
    from partialfl.data.sources import DataContext

    d = spec.data

    def partitioner(label_key: str):
        return d.partition.build(PartitionContext(label_key))

    try:
        return component("dataset", {"name": d.source, **d.options}, "data").build(
            DataContext(d, partitioner))
    except DataNotFoundError as e:
        raise ConfigError(f"data.path: {e}") from None
    except DataFormatError as e:
        raise ConfigError(f"data: {e}") from None


@dataclass(frozen=True)
class Task:
    """What the pipeline trains on: model factory, data, loss, metric and split builder.

    ``model_fn(seed)`` returns a freshly initialised model; ``split_fn(model, kind,
    options)`` builds a :class:`~partialfl.split.Split` (default :func:`build_split`).
    """

    data: Any
    model_fn: Callable[[int], Any]
    loss_fn: Callable | None = None
    metric: Callable | None = None
    split_fn: Callable[[Any, str, Mapping[str, Any]], Any] | None = None
    name: str = "task"

    def __post_init__(self) -> None:
        if self.loss_fn is None or self.metric is None:
            from partialfl.problems.model import accuracy, cross_entropy

            if self.loss_fn is None:
                object.__setattr__(self, "loss_fn", cross_entropy)
            if self.metric is None:
                object.__setattr__(self, "metric", accuracy)

    def make_split(self, model, kind: str, options: Mapping[str, Any] | None = None):
        """The split of ``model`` of kind ``kind`` with ``options`` (``split_fn`` or
        :func:`build_split`)."""
        if self.split_fn is not None:
            return self.split_fn(model, kind, dict(options or {}))
        return build_split(model, kind, options)


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


def _check_forward(model, data, loss_fn) -> None:
    """One example through the model and the loss, so a model that does not fit the data
    fails in ``--dry-run`` with a clear message rather than in round 1."""
    import torch

    m = next(i for i in range(data.num_clients) if len(data.train_y[i]))
    x, y = data.train_x[m][:1], data.train_y[m][:1]
    try:
        with torch.no_grad():
            loss_fn(model(x), y)
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"model: does not fit the data (inputs {tuple(x.shape[1:])} "
                          f"{x.dtype}, {data.num_classes} classes): {msg}") from None


def model_task(spec: RunSpec, data) -> Task:
    """The :class:`Task` of a model run on ``data``."""
    text = data.train_x[0].dim() == 2 and not data.train_x[0].is_floating_point()
    loss_fn, metric = build_loss_metric(spec, text)
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
    _check_forward(split.model, data, task.loss_fn)
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
        "device": spec.device if spec.device == str(device) else f"{spec.device} → {device}",
        "precision": spec.precision, "backend": spec.backend.name, "threads": spec.threads,
    }
    return Run(spec, task=task, new_clients=new, plan=plan)


# ----------------------------------------------------------------------------- by name
def make_aggregator(name: str, **options: Any):
    """An aggregation rule by name with its options, e.g. ``make_aggregator("krum",
    delta=0.2, bucketing=2)``."""
    from partialfl.aggregation.compose import AggregatorContext

    seed = options.pop("seed", 0)
    return _by_name("aggregator", name, options).build(AggregatorContext(seed=seed))


def make_attack(name: str, **options: Any):
    """A Byzantine attack by name with its options (:mod:`partialfl.attacks`)."""
    return _by_name("attack", name, options).build()


def make_solver(name: str, tau: int = 1, lr: float | None = None, init: str = "zero"):
    """FFGG's fine-tuning solver by name (``gd`` = Algorithm 2, ``cg``, ``exact``)."""
    fields = {f.name for f in dataclasses.fields(entry("local", name).options or _NoOptions)}
    opts = {k: v for k, v in (("tau", tau), ("lr", lr)) if k in fields}
    return _by_name("local", name, opts).build().finetuner(init)


@dataclass(frozen=True)
class _NoOptions:
    pass


def make_optimizer(name: str, lr: float, schedule=None, **options: Any):
    """A server optimizer by name (``sgd``, ``adam``) with stepsize ``lr``."""
    from partialfl.server import Constant, OptimizerContext

    return _by_name("optimizer", name, options).build(
        OptimizerContext(lr, schedule or Constant()))


def make_backend(name: str, **options: Any):
    """How a cohort's clients run, by name (``sequential``, ``vmap``, ``processes``)."""
    return _by_name("executor", name, options).build()


def _by_name(kind: str, name: str, options: Mapping[str, Any]) -> Component:
    try:
        return component(kind, {"name": name, **options}, kind)
    except ConfigError as e:
        raise ValueError(str(e)) from None


def convert_data(fmt: str, inp, out, **kw) -> Path:
    """``partialfl data convert``: read ``inp`` in format ``fmt`` and write an on-disk client
    store at ``out`` (:func:`partialfl.data.convert.convert`)."""
    from partialfl.data.convert import convert

    return convert(fmt, inp, out, **kw)


def config_folder_on_path(folder: Path | None) -> None:
    """Let ``module:callable`` references in a config find modules beside the config file."""
    if folder is not None:
        f = str(Path(folder).resolve())
        if f not in sys.path:
            sys.path.insert(0, f)


__all__ = ["ALLOW_CODE_ENV", "Run", "Task", "allow_code", "async_rule", "build",
           "build_aggregator", "build_algorithm", "build_data", "build_loss_metric",
           "build_model", "build_problem", "build_server_opt", "build_split", "code_allowed",
           "convert_data", "import_callable", "make_aggregator", "make_attack",
           "make_backend", "make_model", "make_optimizer", "make_solver", "split_of",
           "model_task", "problem_of", "stage_algorithm", "wrap_algorithm"]
