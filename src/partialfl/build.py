"""The one builder: run specifications (:mod:`partialfl.spec`) → objects.

:data:`REGISTRY` is the only table mapping names to classes and functions, by kind:
closed-form problems and algorithms, local solvers, model algorithms (and named presets),
splits, models, datasets, data-convert formats, partitioners, backends, server optimizers,
schedules, aggregators (and their aliases), attacks, losses, metrics and reproductions
(``tests/test_registry.py`` scans the package for any other name table). The spec validates
names against it (:func:`names`); :func:`build` turns a spec into what runs it; the
``make_*`` functions build one object by name (``make_model``, ``make_aggregator``,
``make_attack``, ``make_solver``, ``make_optimizer``, ``make_backend``). Modules below this one
keep their classes and never import it. Entries import their modules lazily, so reading a
spec stays cheap.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialfl.config import ConfigError
from partialfl.problems.model import accuracy, cross_entropy


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    """A callable that imports ``module.attr`` on first use."""

    def call(*args, **kw):
        return getattr(importlib.import_module(module), attr)(*args, **kw)

    call.__qualname__ = f"{module}.{attr}"
    return call


# ----------------------------------------------------------------------------- entries
def _least_squares(cfg, progress: bool = False):
    from partialfl.problems import LeastSquaresProblem
    from partialfl.problems.least_squares import LeastSquaresSpec

    spec = LeastSquaresSpec(cfg.num_clients, cfg.n, cfg.d_theta, cfg.d_w, cfg.seed)
    return LeastSquaresProblem(spec, basis=cfg.basis, progress=progress and (
        f"building the problem ({cfg.num_clients} clients × {cfg.n:,} rows)"))


def _glm(cfg, progress: bool = False):
    from partialfl.problems import GeneralizedLinearProblem, GLMSpec

    return GeneralizedLinearProblem(GLMSpec(cfg.num_clients, cfg.n, cfg.d_theta, cfg.d_w,
                                            cfg.psi, cfg.huber_delta, cfg.ridge, seed=cfg.seed))


def _cf_ffgg(a, opt):
    from partialfl.algorithms import FFGG

    return FFGG(make_solver(a.solver, a.tau, a.local_lr, a.init), opt)


def _cf_local_gd(a, opt):
    from partialfl.algorithms import LocalGD

    return LocalGD(a.tau, a.local_lr, server_opt=opt)


def _cf_scaffold(a, opt):
    from partialfl.algorithms import Scaffold

    return Scaffold(a.tau, a.local_lr, server_opt=opt)


def _cf_l2gd(a, opt):
    from partialfl.algorithms import L2GD

    alg = L2GD(a.tau, lam=a.lam, p=a.p)
    if opt is not None:  # the averaging step x̄ ← x̄ + lr·mean Δ (lr 1: L2GD's own)
        alg.server_opt = opt
    return alg


def _solver(cls_name: str, *fields: str):
    """A local solver class of :mod:`partialfl.local.solvers`, given the ``fields`` it takes of
    ``(tau, lr, init)``."""
    def make(tau, lr, init):
        from partialfl.local import solvers

        given = {"tau": tau, "lr": lr, "init": init}
        return getattr(solvers, cls_name)(**{f: given[f] for f in fields})
    return make


def _m_fedavg(method, stage, opt, sgd):
    from partialfl.algorithms.model import FedAvg

    return FedAvg(sgd, server_opt=opt, weighting=method.weighting)


def _m_ffgg(method, stage, opt, sgd):
    from partialfl.algorithms.model import model_ffgg

    return model_ffgg(sgd, init=method.w_init, server_opt=opt, weighting=method.weighting)


def _m_local_ffgg(method, stage, opt, sgd):
    from partialfl.algorithms.model import LocalFFGG

    warm = stage.client.sgd(epochs=1, steps=None)
    local = stage.client.sgd(steps=method.local_steps)
    return LocalFFGG(warm, local, w_init=method.w_init, server_opt=opt,
                     weighting=method.weighting)


def _m_alternating(cls_name):
    def make(method, stage, opt, sgd):
        from partialfl.algorithms import model

        return getattr(model, cls_name)(sgd, w_init=method.w_init, stateless=method.stateless,
                                        server_opt=opt, weighting=method.weighting)
    return make


def _m_ditto(method, stage, opt, sgd):
    from partialfl.algorithms.ditto import Ditto

    return Ditto(sgd, sgd, float(method.lam), server_opt=opt, weighting=method.weighting)


def _m_local(method, stage, opt, sgd):
    from partialfl.algorithms.ditto import local_only

    return local_only(sgd)


def _split(model, kind, options):
    from partialfl.models.transformer import TransformerLM, transformer_split
    from partialfl.split import make_split

    if isinstance(model, TransformerLM):
        return transformer_split(model, kind, dict(options))
    return make_split(model, kind, **dict(options))


def _registry_model(module: str, attr: str):
    """A model class or factory ``module.attr`` (called as ``attr(num_classes=C, **options)``),
    initialised from (seed, model init) by :func:`partialfl.models.seeded`."""
    def make(num_classes, seed, data=None, **options):
        from partialfl.models import seeded

        return seeded(getattr(importlib.import_module(module), attr), num_classes, seed,
                      **options)
    make.__qualname__ = f"{module}.{attr}"
    return make


def _transformer(num_classes, seed, data=None, **options):
    import torch

    from partialfl.models.transformer import TransformerConfig, TransformerLM
    from partialfl.rng import torch_seed

    seq = int(data.train_x[0].shape[1]) if data is not None and data.train_x[0].dim() == 2 \
        else 20
    cfg = TransformerConfig(vocab_size=num_classes, **{"seq_len": seq, **options})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed, "model"))  # as the Shakespeare table seeds it
        return TransformerLM(cfg)


def _optimizer(cls_name: str):
    def make(lr, schedule=None, **kw):
        from partialfl import server

        return getattr(server, cls_name)(lr=lr, schedule=schedule or server.Schedule(), **kw)
    return make


def _flwr_partitioner(cls_name: str, **fixed):
    def make(spec, label_key: str):
        try:
            mod = importlib.import_module("flwr_datasets.partitioner")
        except ModuleNotFoundError:
            raise ConfigError("data.partition needs flwr-datasets: pip install "
                              "'partialfl[partition]'") from None
        kw = {k: getattr(spec, v) if isinstance(v, str) and hasattr(spec, v) else v
              for k, v in fixed.items()}
        if cls_name != "IidPartitioner":
            kw.update(partition_by=label_key, seed=spec.seed)
        return getattr(mod, cls_name)(num_partitions=spec.num_clients, **kw)
    return make


def _schedule(kind: str):
    def make(**kw):
        from partialfl.server import Schedule

        return Schedule(kind, **kw)
    return make


@dataclass(frozen=True)
class _Rule:
    """An aggregation rule: its class in :mod:`partialfl.aggregation.rules` (or ``basic``),
    the keyword options it accepts besides δ and the wrappers', and fixed defaults."""

    module: str
    cls: str
    options: tuple[str, ...] = ()
    defaults: tuple[tuple[str, Any], ...] = ()

    def __call__(self, name: str, **kw):
        from partialfl.aggregation.compose import compose

        cls = getattr(importlib.import_module(self.module), self.cls)
        return compose(name, cls, self.options, dict(self.defaults), **kw)


def _rule(cls: str, *options: str, **defaults) -> _Rule:
    module = "partialfl.aggregation." + ("basic" if cls == "Mean" else "rules")
    return _Rule(module, cls, options, tuple(defaults.items()))


@dataclass(frozen=True)
class _Attack:
    """A Byzantine attack class of :mod:`partialfl.attacks` and the options it accepts."""

    cls: str
    options: tuple[str, ...] = ()

    def __call__(self, name: str, **kw):
        from partialfl import attacks

        bad = sorted(set(kw) - set(self.options))
        if bad:
            raise ValueError(f"attack {name!r} got unknown option(s) {', '.join(bad)}; "
                             f"allowed: {', '.join(self.options) or 'none'}")
        return getattr(attacks, self.cls)(**kw)


@dataclass(frozen=True)
class Reproduction:
    """A reproduction (``partialfl reproduce NAME``): ``module.function`` and a one-line
    description."""

    module: str
    function: str
    description: str

    def load(self) -> Callable:
        """The reproduce function (NotImplementedError when its module does not exist)."""
        try:
            mod = importlib.import_module(self.module)
        except ModuleNotFoundError as e:
            if e.name == self.module:
                raise NotImplementedError(f"reproduction module {self.module} is not "
                                          "implemented yet") from e
            raise
        return getattr(mod, self.function)


def preset_entry(preset) -> Callable:
    """The registry entry of a named preset (an object with ``make_algorithm(local, *,
    w_init, server_opt, weighting, **options)`` and ``make_split(model, example_input,
    **options)``): a model-algorithm factory that also carries the preset, whose split is
    the method's split ``preset:NAME``; ``method.split_options`` are the preset's options."""
    def make(method, stage, opt, sgd):
        return preset.make_algorithm(sgd, w_init=method.w_init, server_opt=opt,
                                     weighting=method.weighting, **dict(method.split_options))
    make.preset = preset  # type: ignore[attr-defined]
    return make


def _presets() -> dict[str, Any]:
    """Named personalization presets (FedPer, FedRep, LG-FedAvg, FedBN, …): registered from
    ``partialfl.algorithms.presets.PRESETS`` when that module exists — the one place they
    enter the registry."""
    try:
        from partialfl.algorithms.presets import PRESETS  # type: ignore[import-not-found]
    except ModuleNotFoundError:
        return {}
    return {name: preset_entry(p) for name, p in PRESETS.items()}


_E = "partialfl.experiments."

#: kind → name → factory: every name a spec, a config, the command line or the API may use,
#: in one table. Lower modules keep their classes; only this table maps names to them.
REGISTRY: dict[str, dict[str, Any]] = {
    "problem": {"least-squares": _least_squares, "glm": _glm},
    "closed-form-algorithm": {"ffgg": _cf_ffgg, "local-gd": _cf_local_gd,
                              "scaffold": _cf_scaffold, "l2gd": _cf_l2gd},
    "solver": {"gd": _solver("GradientDescent", "tau", "lr", "init"),
               "cg": _solver("ConjugateGradient", "tau", "init"),
               "exact": _solver("ExactSolver")},
    "algorithm": {"fedavg": _m_fedavg, "ffgg": _m_ffgg, "local-ffgg": _m_local_ffgg,
                  "fedalt": _m_alternating("FedAlt"), "fedsim": _m_alternating("FedSim"),
                  "ditto": _m_ditto, "local": _m_local},
    "preset": {},  # filled by _presets() on first use
    "split": {k: _split for k in ("none", "input", "output", "adapter", "norm", "pattern")},
    "model": {"emnist_cnn": _registry_model("partialfl.models.cnn", "EmnistCNN"),
              "leaf_cnn": _registry_model("partialfl.models.cnn", "LeafCNN"),
              "har_cnn": _registry_model("partialfl.models.har", "HarCNN"),
              "resnet18_emnist": _registry_model("partialfl.models.resnet", "resnet18_emnist"),
              "resnet18_224": _registry_model("partialfl.models.resnet", "resnet18_224"),
              "transformer": _transformer},
    "dataset": {"femnist": _lazy("partialfl.data.sources", "femnist"),
                "shakespeare": _lazy("partialfl.data.sources", "shakespeare"),
                "folder": _lazy("partialfl.data.sources", "folder"),
                "hf-disk": _lazy("partialfl.data.sources", "hf_disk")},
    # `partialfl data convert FORMAT`: the loaders of partialfl.data.convert
    "data-format": {k: _lazy("partialfl.data.convert", f) for k, f in (
        ("femnist-npz", "from_femnist_npz"), ("leaf-json", "from_leaf_json"),
        ("tff-emnist", "from_tff_emnist"), ("shakespeare", "from_shakespeare"),
        ("stackoverflow", "from_stackoverflow"), ("gldv2", "from_gldv2"))},
    "partitioner": {"iid": _flwr_partitioner("IidPartitioner"),
                    "dirichlet": _flwr_partitioner("DirichletPartitioner", alpha="alpha",
                                                   min_partition_size=0),
                    "pathological": _flwr_partitioner(
                        "PathologicalPartitioner",
                        num_classes_per_partition="classes_per_client"),
                    "shard": _flwr_partitioner("ShardPartitioner",
                                               num_shards_per_partition="shards_per_client")},
    "backend": {"sequential": _lazy("partialfl.runtime.backends", "SequentialBackend"),
                "vmap": _lazy("partialfl.runtime.backends", "BatchedBackend"),
                "batched": _lazy("partialfl.runtime.backends", "BatchedBackend"),
                "processes": _lazy("partialfl.runtime.cohort_pool", "ProcessBackend")},
    "optimizer": {"sgd": _optimizer("SGD"), "adam": _optimizer("Adam")},
    "schedule": {k: _schedule(k) for k in ("constant", "warmup-linear", "exponential")},
    "aggregator": {"mean": _rule("Mean", "weighted"), "cm": _rule("CoordinateMedian"),
                   "tm": _rule("TrimmedMean"),
                   "gm": _rule("GeometricMedian", "nu", "tol", "max_iter", "weighted"),
                   "krum": _rule("Krum", "cap"), "multi-krum": _rule("Krum", "m", "cap", m=None),
                   "cc": _rule("CenteredClipping", "tau", "tau_scale", "iters", "init"),
                   "mda": _rule("MDA", "max_subsets"), "monna": _rule("MoNNA", "index"),
                   "meamed": _rule("Meamed"), "caf": _rule("CAF"),
                   "smea": _rule("SMEA", "max_subsets")},
    # other names of aggregation rules (name → the rule's name above)
    "aggregator-alias": {"median": "cm", "coordinate-median": "cm", "trimmed-mean": "tm",
                         "geometric-median": "gm", "geomed": "gm", "rfa": "gm",
                         "centered-clipping": "cc", "multikrum": "multi-krum",
                         "minimum-diameter": "mda"},
    "attack": {"none": _Attack("NoAttack"), "alie": _Attack("ALIE", ("z", "ddof")),
               "ipm": _Attack("IPM", ("epsilon",)),
               "alie-opt": _Attack("OptimizedALIE", ("aggregator", "evals", "start", "step",
                                                     "ratio", "ddof")),
               "ipm-opt": _Attack("OptimizedIPM", ("aggregator", "evals", "start", "step",
                                                   "ratio")),
               "inf": _Attack("Inf"), "sign-flip": _Attack("SignFlip"),
               "gaussian": _Attack("GaussianNoise", ("sigma", "center")),
               "bit-flip": _Attack("BitFlip", ("bits", "fraction")),
               "mimic": _Attack("Mimic", ("target",))},
    "loss": {"cross-entropy": cross_entropy,
             "token-cross-entropy": _lazy("partialfl.lm", "token_cross_entropy")},
    "metric": {"accuracy": lambda: accuracy,
               "next-word-accuracy": _lazy("partialfl.lm", "NextWordAccuracy")},
    # `partialfl reproduce NAME`
    "reproduction": {
        "ls-tau": Reproduction(_E + "least_squares", "reproduce_tau",
                               "Figure 1(a): FFGG with CG, tau in {1,5,10,20,30,40} on least "
                               "squares"),
        "ls-compare": Reproduction(_E + "least_squares", "reproduce_compare",
                                   "Figure 1(b-d): FFGG (GD) vs Scaffold, Local GD, L2GD, tau "
                                   "in {100,200,500}"),
        "femnist-table": Reproduction(_E + "femnist", "reproduce_table",
                                      "Table 2 (FEMNIST): FedAvg vs FFGG splits, Local FFGG, "
                                      "FedAlt/FedSim"),
        "femnist-kfold": Reproduction(_E + "femnist", "reproduce_kfold",
                                      "FEMNIST new writers by k-fold over writers (--folds K): "
                                      "FedAvg vs FFGG"),
        "shakespeare-table": Reproduction(_E + "shakespeare", "reproduce_table",
                                          "Next-word prediction by role: FedAvg vs FFGG splits "
                                          "(transformer)"),
        "har-table": Reproduction(_E + "har", "reproduce_table",
                                  "Activity recognition by subject (HAPT): local, FedAvg(+FT), "
                                  "FFGG splits, Ditto"),
        "async": Reproduction(_E + "asynchronous", "reproduce_async",
                              "Asynchronous FFGG vs sync FFGG, FedBuff, async SGD on least "
                              "squares"),
        "byzantine": Reproduction(_E + "byzantine", "reproduce_byzantine",
                                  "Byzantine-robust FFGG: attacks x aggregators (+bucketing) "
                                  "on least squares"),
        "faults": Reproduction(_E + "faults", "reproduce_faults",
                               "Fault injection: FFGG with 0-30% of clients raising / NaN / "
                               "dying workers"),
    },
}


_PRESETS_LOADED = False


def names(kind: str) -> tuple[str, ...]:
    """The registered names of ``kind`` (what a spec may say)."""
    global _PRESETS_LOADED
    if kind in ("algorithm", "preset") and not _PRESETS_LOADED:
        _PRESETS_LOADED = True
        REGISTRY["preset"].update(_presets())
    if kind == "algorithm":
        return (*REGISTRY["algorithm"], *REGISTRY["preset"])
    if kind == "split":
        return (*REGISTRY["split"], *(f"preset:{p}" for p in names("preset")))
    return tuple(REGISTRY[kind])


def lookup(kind: str, name: str, key: str | None = None):
    """The registry entry, or a :class:`ConfigError` naming ``key`` and the allowed names."""
    from partialfl.config import check_choice

    check_choice(key or kind, name, names(kind))
    if kind == "algorithm" and name in REGISTRY["preset"]:
        return REGISTRY["preset"][name]
    return REGISTRY[kind][name]


# ----------------------------------------------------------------------------- optimizers
def parse_lr(lr: float | str, L: float | None, key: str = "server.lr") -> float:
    """A stepsize given as a number or as ``"c/L"`` (e.g. ``"1/L"``, ``"0.5/L"``) with ``L``
    the problem's smoothness constant."""
    if isinstance(lr, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*/\s*L\s*", lr)
        if not m:
            raise ConfigError(f"{key}: {lr!r} is neither a number, 'auto' nor of the form 'c/L'")
        if L is None:
            raise ConfigError(f"{key}: {lr!r} needs a problem with a known smoothness constant "
                              "L (least squares, GLM); give a number")
        value = float(m.group(1)) / L
    else:
        value = float(lr)
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{key} must be positive, got {lr!r}")
    return value


def _entry(kind: str, name: str, what: str):
    """``REGISTRY[kind][name]``, or a ValueError ``unknown WHAT 'name'; allowed: …``."""
    if name not in REGISTRY[kind]:
        raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(names(kind))}")
    return REGISTRY[kind][name]


def make_optimizer(name: str, lr: float, schedule=None, **kw):
    """Server optimizer ``name`` (``sgd``: :class:`~partialfl.server.SGD`, ``adam``:
    :class:`~partialfl.server.Adam`) with stepsize ``lr``, a schedule and extra keyword
    options (e.g. ``momentum``)."""
    return _entry("optimizer", name, "server optimizer")(lr, schedule, **kw)


def make_solver(name: str, tau: int = 1, lr: float | None = None, init: str = "zero"):
    """Local solver ``name`` (``gd`` = Algorithm 2, ``cg``, ``exact``;
    :mod:`partialfl.local.solvers`)."""
    return _entry("solver", name, "local solver")(tau, lr, init)


def make_backend(name: str):
    """A cohort backend by name (as :func:`build_backend`, with a ValueError)."""
    return _entry("backend", name, "backend")()


def build_backend(name: str):
    """How a cohort runs: ``sequential`` (one client at a time), ``vmap`` / ``batched`` (the
    whole cohort at once) or ``processes`` (clients over CPU worker processes)."""
    return lookup("backend", name, "backend")()


def make_aggregator(name: str, **kw: Any):
    """An aggregation rule by name, e.g. ``make_aggregator("krum", delta=0.2, bucketing=2)``
    (built with its wrappers by :func:`partialfl.aggregation.compose.compose`).

    Rules: mean, cm, tm, gm, krum, multi-krum, cc, mda, monna, meamed, caf, smea (aliases:
    median, trimmed-mean, geometric-median, centered-clipping, …). Wrappers: ``bucketing=s``
    (s ≥ 2; 1 = none), ``nnm=True`` (nearest-neighbour mixing), ``arc=True`` (adaptive
    robust clipping), ``clip=c`` (static clipping to norm c), ``seed`` (bucketing randomness).
    ``delta``: the fraction of Byzantine clients (default: the rule's own default δ).
    """
    key = REGISTRY["aggregator-alias"].get(name, name)
    if key not in REGISTRY["aggregator"]:
        raise ValueError(f"unknown aggregator {name!r}; allowed: "
                         f"{', '.join(names('aggregator'))}")
    return REGISTRY["aggregator"][key](key, **kw)


def make_attack(name: str, **kw):
    """A Byzantine attack by name (:mod:`partialfl.attacks`): none, alie, ipm, alie-opt,
    ipm-opt, inf, sign-flip, gaussian, bit-flip, mimic."""
    if name == "label-flip":
        raise ValueError("label flipping acts on the data, not on updates: apply "
                         "partialfl.attacks.flip_labels to the Byzantine clients' labels")
    return _entry("attack", name, "attack")(name, **kw)


def make_model(name: str, num_classes: int, *, seed: int | None = None, **kw: Any):
    """Registry model ``name`` with ``num_classes`` outputs; extra keywords go to its
    constructor. Names may use hyphens instead of underscores (``"leaf-cnn"``).

    With ``seed`` the initial weights are drawn from ``partialfl.rng.torch_seed(seed,
    "model_init")`` inside ``torch.random.fork_rng`` (the global torch RNG is left untouched);
    without it they come from the global torch RNG. For ``resnet18_224``, ``pretrained=PATH``
    loads a state_dict file (see :func:`partialfl.models.resnet.load_pretrained`).
    """
    key = name.replace("-", "_")
    allowed = sorted(k for k in REGISTRY["model"] if k != "transformer")
    if key not in allowed:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(allowed)}")
    return REGISTRY["model"][key](num_classes, seed, **kw)


def convert_data(fmt: str, inp, out, **kw) -> Path:
    """``partialfl data convert``: read ``inp`` in format ``fmt`` (kind ``data-format``) and
    write an on-disk client store at ``out`` (:func:`partialfl.data.convert.convert`)."""
    from partialfl.data.convert import convert

    return convert(_entry("data-format", fmt, "data format"), inp, out, fmt=fmt, **kw)


def get_reproduction(name: str) -> Callable:
    """The reproduce function of ``name``; a clear error for unknown or unavailable names."""
    if name not in REGISTRY["reproduction"]:
        raise ValueError(f"unknown reproduction {name!r}; allowed: "
                         f"{', '.join(sorted(REGISTRY['reproduction']))}")
    try:
        return REGISTRY["reproduction"][name].load()
    except NotImplementedError:
        raise NotImplementedError(f"reproduction {name!r} is not implemented yet") from None


def build_server_opt(server, rounds: int, L: float | None = None, auto_lr: float = 1.0):
    """The server optimizer of a :class:`~partialfl.spec.ServerConfig`: schedule over
    ``rounds``, ``lr`` resolved (``"auto"`` → ``auto_lr``; ``"c/L"`` → c/L), clipping."""
    from partialfl.server import Clipped, Schedule

    try:
        sched = Schedule(server.schedule, total=max(rounds, 1), warmup=server.warmup,
                         halve_every=server.halve_every)
    except ValueError as e:
        raise ConfigError(f"server.schedule: {e}") from None
    lr = auto_lr if server.lr == "auto" else parse_lr(server.lr, L)
    kw = {"momentum": server.momentum} if server.optimizer == "sgd" else {}
    opt = make_optimizer(server.optimizer, lr, sched, **kw)
    return Clipped(opt, server.clip_norm) if server.clip_norm else opt


# ----------------------------------------------------------------------------- closed form
_CACHE: dict = {}


def build_problem(cfg, progress: bool = False):
    """The closed-form problem of a :class:`~partialfl.spec.ProblemConfig` (the two most
    recent are cached: building least squares reads n×d data; ``progress`` shows a bar over
    its clients)."""
    if cfg not in _CACHE:
        try:
            problem = lookup("problem", cfg.kind, "problem.kind")(cfg, progress)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"problem: {e}") from e
        while len(_CACHE) >= 2:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[cfg] = problem
    return _CACHE[cfg]


def problem_config_for(cfg):
    """Non-personalized baselines share w across clients, so they need the standard basis."""
    if cfg.algorithm.name != "ffgg" and cfg.problem.basis != "standard":
        return dataclasses.replace(cfg.problem, basis="standard")
    return cfg.problem


def build_closed_form_algorithm(cfg, problem):
    """The algorithm of a :class:`~partialfl.spec.ClosedFormConfig` with its server optimizer
    (``[server]`` applies to every algorithm: ``auto`` lr = 1/L for FFGG, 1 otherwise)."""
    a = cfg.algorithm
    if a.name == "l2gd" and cfg.run.clients_per_round not in (None, problem.num_clients):
        raise ConfigError("run.clients_per_round: l2gd needs full participation")
    auto = 1.0 / problem.L if a.name == "ffgg" else 1.0
    opt = build_server_opt(cfg.server, cfg.run.rounds, getattr(problem, "L", None), auto)
    return lookup("closed-form-algorithm", a.name, "algorithm.name")(a, opt)


# ----------------------------------------------------------------------------- model runs
def build_algorithm(method, stage):
    """The model algorithm of ``method`` (:class:`~partialfl.spec.MethodConfig`) with
    ``stage``'s client SGD and server optimizer."""
    opt = build_server_opt(stage.server, stage.rounds)
    factory = lookup("algorithm", method.algorithm, "method.algorithm")
    return factory(method, stage, opt, stage.client.sgd())


def build_split(model, kind: str, options: Mapping[str, Any] | None = None):
    """Which parameters of ``model`` are personal (:mod:`partialfl.split`; transformers use
    their own builder)."""
    if kind.startswith("preset:"):
        preset = lookup("algorithm", kind[len("preset:"):], "method.split").preset
        return preset.make_split(model, None, **dict(options or {}))
    return lookup("split", kind, "method.split")(model, kind, dict(options or {}))


def import_callable(ref: str, key: str = "model.name") -> Callable:
    """``package.module:attr`` → the object (a clear error if either part is missing)."""
    mod_name, _, attr = ref.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module {mod_name!r} of {ref!r}: {e}") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: {ref!r} is not callable")
    return obj


def build_model(spec, num_classes: int, seed: int, data=None):
    """A fresh model of a :class:`~partialfl.spec.ModelSpec`, seeded from (seed, model init)
    (the global torch RNG is left untouched)."""
    import torch
    from torch import nn

    from partialfl.rng import torch_seed

    opts = dict(spec.options)
    if ":" in spec.name:
        fn = import_callable(spec.name)
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
                raise ConfigError(f"model.options: {spec.name}: {e}") from None
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.name: {spec.name!r} returned {type(model).__name__}, "
                              "not a torch.nn.Module")
        return model
    name = spec.name.replace("_", "-") if spec.name.replace("_", "-") in REGISTRY["model"] \
        else spec.name.replace("-", "_")
    factory = lookup("model", name, "model.name")
    try:
        return factory(num_classes, seed, data, **opts)
    except TypeError as e:
        raise ConfigError(f"model.options: {e}") from None


def build_loss_metric(spec, text: bool):
    """``(loss_fn, metric)`` of a train spec (``auto``: by the data's kind)."""
    loss = spec.loss if spec.loss != "auto" else (
        "token-cross-entropy" if text else "cross-entropy")
    metric = spec.metric if spec.metric != "auto" else (
        "next-word-accuracy" if text else "accuracy")
    m = REGISTRY["metric"][metric]()
    return REGISTRY["loss"][loss], m


def partitioner(spec, label_key: str):
    """The flwr-datasets partitioner of a :class:`~partialfl.spec.PartitionSpec`."""
    return lookup("partitioner", spec.kind, "data.partition.kind")(spec, label_key)


def build_data(spec):
    """The ``(training clients, new clients or None)`` of a :class:`~partialfl.spec.DataSpec`
    (:mod:`partialfl.data.sources`)."""
    from partialfl.data.federated import DataFormatError
    from partialfl.data.paths import DataNotFoundError

    try:
        return lookup("dataset", spec.source, "data.source")(spec, partitioner)
    except DataNotFoundError as e:
        raise ConfigError(f"data.path: {e}") from None
    except DataFormatError as e:
        raise ConfigError(f"data: {e}") from None


@dataclass(frozen=True)
class Task:
    """What the pipeline trains on: injectable model, data, loss, metric and split builder.

    ``model_fn(seed)`` returns a freshly initialised model; ``split_fn(model, kind, options)``
    builds a :class:`~partialfl.split.Split` (default :func:`build_split`).
    """

    data: Any
    model_fn: Callable[[int], Any]
    loss_fn: Callable = cross_entropy
    metric: Callable = accuracy
    split_fn: Callable[[Any, str, Mapping[str, Any]], Any] | None = None
    name: str = "task"

    def make_split(self, model, kind: str, options: Mapping[str, Any]):
        """The split of ``model`` of kind ``kind`` with ``options`` (``split_fn`` or
        :func:`build_split`)."""
        if self.split_fn is not None:
            return self.split_fn(model, kind, dict(options))
        return build_split(model, kind, options)


# ----------------------------------------------------------------------------- build(spec)
@dataclass
class ClosedFormRun:
    """What :func:`build` makes of a closed-form config."""

    problem: Any
    algorithm: Any


@dataclass
class TrainRun:
    """What :func:`build` makes of a :class:`~partialfl.spec.TrainSpec`: the pipeline config,
    the task (model factory, data, loss, metric, split), the held-out new clients (or None)
    and the plan that ``--dry-run`` prints."""

    spec: Any
    pipeline: Any
    task: Any
    new_clients: Any
    plan: dict[str, Any]


def build(spec, progress: bool = False) -> ClosedFormRun | TrainRun:
    """Build a run specification (:mod:`partialfl.spec`) into the objects that run it
    (``progress``: a bar while a large closed-form problem is generated)."""
    if all(hasattr(spec, t) for t in ("problem", "algorithm", "server", "run")):
        # a ClosedFormConfig
        problem = build_problem(problem_config_for(spec), progress)
        if spec.run.clients_per_round is not None and not (
                1 <= spec.run.clients_per_round <= problem.num_clients):
            raise ConfigError(f"run.clients_per_round={spec.run.clients_per_round} but the "
                              f"problem has {problem.num_clients} clients")
        return ClosedFormRun(problem, build_closed_form_algorithm(spec, problem))
    if hasattr(spec, "model") and hasattr(spec, "pipeline_config"):  # a TrainSpec
        return _build_train(spec)
    raise TypeError(f"build() takes a ClosedFormConfig or TrainSpec, got {type(spec).__name__}")


def _task_name(spec) -> str:
    import hashlib
    import json

    key = json.dumps({"model": dataclasses.asdict(spec.model),
                      "data": dataclasses.asdict(spec.data), "loss": spec.loss,
                      "metric": spec.metric}, sort_keys=True, default=str)
    return f"{spec.data.source}-{spec.model.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


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


def _build_train(spec) -> TrainRun:
    from partialfl.devices import check_precision, resolve_device

    try:
        device = resolve_device(spec.device)
        check_precision(spec.precision, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    data, new = build_data(spec.data)
    text = data.train_x[0].dim() == 2 and not data.train_x[0].is_floating_point()
    loss_fn, metric = build_loss_metric(spec, text)
    num_classes = int(data.num_classes)

    def model_fn(seed: int):
        return build_model(spec.model, num_classes, seed, data)

    def split_fn(model, kind, options):
        return build_split(model, kind, options)

    task = Task(data=data, model_fn=model_fn, loss_fn=loss_fn, metric=metric,
                split_fn=split_fn, name=_task_name(spec))
    pipe = spec.pipeline_config()
    model = model_fn(pipe.stage1_seed)
    try:
        split = build_split(model, pipe.method.split, pipe.method.split_options)
    except ValueError as e:
        raise ConfigError(f"method.split: {e}") from None
    build_algorithm(pipe.method, pipe.personalize)  # validates the method's options
    _check_forward(split.model, data, loss_fn)
    counts = split.counts() if hasattr(split, "counts") else {}
    plan = {
        "name": spec.name, "data": data.summary(), "clients": data.num_clients,
        "train_examples": int(data.train_sizes().sum()),
        "test_examples": int(data.test_sizes().sum()),
        "new_clients": 0 if new is None else new.num_clients,
        "model": spec.model.name, "num_classes": num_classes,
        "parameters": int(sum(p.numel() for p in split.model.parameters())),
        "split": pipe.method.split, "split_counts": counts,
        "algorithm": pipe.method.algorithm, "stages": list(spec.stages),
        "rounds": {"pretrain": pipe.pretrain.rounds, "personalize": pipe.personalize.rounds},
        "finetune_epochs": pipe.finetune.epochs,
        "device": spec.device if spec.device == str(device) else f"{spec.device} → {device}",
        "precision": spec.precision, "backend": pipe.backend,
    }
    return TrainRun(spec, pipe, task, new, plan)


def resolve_path(path: str, base: Path | None) -> Path:
    """``path`` relative to ``base`` (the config file's folder) unless absolute."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or base is None else base / p


__all__ = ["REGISTRY", "ClosedFormRun", "Reproduction", "Task", "TrainRun", "build",
           "build_algorithm", "build_backend", "build_closed_form_algorithm", "build_data",
           "build_model", "build_problem", "build_server_opt", "build_split", "convert_data",
           "get_reproduction", "lookup", "make_aggregator", "make_attack", "make_backend",
           "make_model", "make_optimizer", "make_solver", "names", "parse_lr"]
