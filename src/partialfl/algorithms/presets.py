"""Personalization baselines by their published names, as FedSim / FedAlt with a split.

Each preset is exactly one algorithm of :mod:`partialfl.algorithms.model` (client m keeps its
personal parameters w_m across rounds, runtime-held client state, never sent; the server
averages Δθ) and one split of the model's parameters into global θ and personal w:

* ``fedper`` — personal: the head, the last ``layers`` layer(s) (split ``output``);
  schedule: FedSim, E epochs on (θ, w_m) jointly.
* ``fedrep`` — personal: the head, the last ``layers`` layer(s) (split ``output``);
  schedule: FedAlt, ``head_epochs`` epochs on w_m (θ fixed), then ``body_epochs`` epochs on θ
  (w_m fixed).
* ``lg-fedavg`` — personal: every layer but the last ``global_layers`` (the input side;
  the head is global); schedule: FedSim, E epochs jointly.
* ``fedbn`` — personal: every BatchNorm layer, its affine parameters (split ``norm``) and its
  running statistics; schedule: FedSim, E epochs jointly.

E = ``local.epochs`` (or ``local.steps``) of the given client :class:`SGDConfig`.

* **FedPer** — M. G. Arivazhagan, V. Aggarwal, A. K. Singh, S. Choudhary, "Federated Learning
  with Personalization Layers", arXiv:1912.00818 (2019). Base layers are federated with
  FedAvg, the personalization (top) layers stay on the client; both are trained together by
  local SGD.
* **FedRep** — L. Collins, H. Hassani, A. Mokhtari, S. Shakkottai, "Exploiting Shared
  Representations for Personalized Federated Learning", ICML 2021. Each round a client first
  trains its head with the representation fixed, then the representation with the new head
  fixed; only the representation is averaged. Defaults: 10 head epochs, 1 body epoch (the
  schedule of the paper's experiments).
* **LG-FedAvg** — P. P. Liang, T. Liu, L. Ziyin, N. B. Allen, R. P. Auerbach, D. Brent,
  R. Salakhutdinov, L.-P. Morency, "Think Locally, Act Globally: Federated Learning with Local
  and Global Representations", arXiv:2001.01523 (2020). The mirror image of FedPer: local
  representation layers, a global head averaged by the server.
* **FedBN** — X. Li, M. Jiang, X. Zhang, M. Kamp, Q. Dou, "FedBN: Federated Learning on
  Non-IID Features via Local Batch Normalization", ICLR 2021. Every BatchNorm layer (scale,
  shift and running statistics) stays local; everything else is averaged as in FedAvg. Only
  for models with BatchNorm. (Running statistics are personal client state under every
  split, see :class:`~partialfl.problems.model.ModelProblem`; FedBN adds the affine ones.)

Usage::

    algorithm, split = build_preset("fedrep", model, SGDConfig(lr=0.05, batch_size=32))
    problem = ModelProblem(split, data)
    run_rounds(problem, algorithm, rounds=100, clients_per_round=10)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partialfl.algorithms.base import Algorithm
from partialfl.algorithms.context import AlgorithmContext
from partialfl.algorithms.personal import FedAlt, FedSim
from partialfl.registry import entry, option, register, with_trait

if TYPE_CHECKING:
    from torch import Tensor, nn

    from partialfl.local.sgd import SGDConfig
    from partialfl.split import Split


def _positive(opts) -> None:
    for f in dataclasses.fields(opts):
        v = getattr(opts, f.name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{f.name} must be a positive integer, got {v!r}")


def _common(ctx: AlgorithmContext) -> dict[str, Any]:
    return dict(w_init=ctx.w_init, **ctx.common())


def _named(alg: Algorithm, name: str) -> Algorithm:
    alg.name = name  # logs and progress bars say "fedrep", not "fedalt"
    return alg


# -- FedPer --------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadOptions:
    """The personal head."""

    layers: int = option(1, "the last `layers` layer(s) are personal")

    def __post_init__(self) -> None:
        _positive(self)


def _head_split(model, opts, example_input=None) -> Split:
    from partialfl.split import make_split

    return make_split(model, "output", layers=opts.layers, example_input=example_input)


@register("algorithm", "fedper", options=HeadOptions, split="preset", make_split=_head_split,
          title="FedPer", paper="Arivazhagan et al. 2019, Federated Learning with "
          "Personalization Layers (arXiv:1912.00818)", split_kind="output",
          personal="the last `layers` layer(s) (the head)",
          schedule="FedSim: local epochs on (θ, w_m) jointly, server averages Δθ")
def _fedper(opts: HeadOptions, ctx: AlgorithmContext) -> Algorithm:
    """FedPer: a personal head trained jointly with the global body (FedSim)."""
    return _named(FedSim(ctx.trainer(), **_common(ctx)), "fedper")


# -- FedRep --------------------------------------------------------------------------------
@dataclass(frozen=True)
class FedRepOptions:
    """The personal head and FedRep's local schedule."""

    layers: int = option(1, "the last `layers` layer(s) are personal")
    head_epochs: int = option(10, "epochs on the head w_m with θ fixed (client gd: "
                              "full-gradient steps)")
    body_epochs: int = option(1, "then epochs on the body θ with w_m fixed")

    def __post_init__(self) -> None:
        _positive(self)


@register("algorithm", "fedrep", options=FedRepOptions, split="preset",
          make_split=_head_split, title="FedRep", paper="Collins et al. 2021, Exploiting "
          "Shared Representations for Personalized Federated Learning (ICML)",
          split_kind="output", personal="the last `layers` layer(s) (the head)",
          schedule="FedAlt: `head_epochs` epochs on w_m (θ fixed), then `body_epochs` epochs "
          "on θ (w_m fixed), server averages Δθ")
def _fedrep(opts: FedRepOptions, ctx: AlgorithmContext) -> Algorithm:
    """FedRep: the head first (``head_epochs``, θ fixed), then the body (``body_epochs``,
    w_m fixed) (FedAlt)."""
    def passes(epochs: int):  # a gd client's epoch: one full-gradient step
        local = ctx.trainer()
        if "epochs" in {f.name for f in dataclasses.fields(local)}:
            return dataclasses.replace(local, epochs=epochs, steps=None)
        return ctx.trainer(steps=epochs)

    return _named(FedAlt(passes(opts.head_epochs), local_theta=passes(opts.body_epochs),
                         **_common(ctx)), "fedrep")


# -- LG-FedAvg -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LGOptions:
    """The global head."""

    global_layers: int = option(1, "the last `global_layers` layer(s) are global")

    def __post_init__(self) -> None:
        _positive(self)


def _lg_split(model, opts, example_input=None) -> Split:
    """Personal = everything below the top ``global_layers`` layer(s) (the global head, the
    personal side of ``output`` with that many layers)."""
    from partialfl.split import Split, make_split

    head = make_split(model, "output", layers=opts.global_layers, example_input=example_input)
    return Split(model, "input", head.personal_names, head.global_names)


@register("algorithm", "lg-fedavg", options=LGOptions, split="preset", make_split=_lg_split,
          title="LG-FedAvg", paper="Liang et al. 2020, Think Locally, Act Globally: Federated "
          "Learning with Local and Global Representations (arXiv:2001.01523)",
          split_kind="input", personal="every layer but the last `global_layers` (the "
          "global head)", schedule="FedSim: local epochs on (θ, w_m) jointly, server "
          "averages Δθ")
def _lg_fedavg(opts: LGOptions, ctx: AlgorithmContext) -> Algorithm:
    """LG-FedAvg: personal representation layers, a global head (FedSim)."""
    return _named(FedSim(ctx.trainer(), **_common(ctx)), "lg-fedavg")


# -- FedBN ---------------------------------------------------------------------------------
def _bn_split(model, opts=None, example_input=None) -> Split:
    from torch import nn

    from partialfl.split import Split, SplitError

    bns = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        raise SplitError("preset 'fedbn' keeps the BatchNorm layers local, but this model has "
                         "none; for other normalization layers use FedSim with split 'norm'")
    names = [n for n, _ in model.named_parameters()]
    pers = {n for n in names if any(n.startswith(f"{b}.") for b in bns)}
    return Split(model, "norm", tuple(n for n in names if n not in pers),
                 tuple(n for n in names if n in pers))


@register("algorithm", "fedbn", split="preset", make_split=_bn_split, title="FedBN",
          paper="Li et al. 2021, FedBN: Federated Learning on Non-IID Features via Local Batch "
          "Normalization (ICLR)", split_kind="norm", personal="every BatchNorm layer (affine "
          "parameters and running statistics)", schedule="FedSim: local epochs on (θ, w_m) "
          "jointly, server averages Δθ (FedAvg on the non-BatchNorm parameters)")
def _fedbn(opts: None, ctx: AlgorithmContext) -> Algorithm:
    """FedBN: every BatchNorm layer stays local, the rest is averaged (FedSim)."""
    return _named(FedSim(ctx.trainer(), **_common(ctx)), "fedbn")


# -- by name -------------------------------------------------------------------------------
def preset_names() -> tuple[str, ...]:
    """The registered presets (algorithms that bring their own split)."""
    return with_trait("algorithm", "split", "preset")


def preset_split(name: str, model: nn.Module, options: Any = None,
                 example_input: Tensor | tuple | None = None) -> Split:
    """The split of preset ``name`` for ``model`` (``options``: the preset's options)."""
    e = _preset(name)
    opts = e.parse(options or {}, name) if not dataclasses.is_dataclass(options) else options
    make: Callable = e.trait("make_split")
    return make(model, opts, example_input)


def _preset(name: str):
    e = entry("algorithm", name, "preset")
    if e.trait("split") != "preset":
        raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(preset_names())}")
    return e


def build_preset(
    name: str,
    model: nn.Module,
    local: SGDConfig,
    *,
    example_input: Tensor | tuple | None = None,
    w_init: str = "pretrained",
    server_opt=None,
    aggregator=None,
    weighting: str = "uniform",
    **options,
) -> tuple[Algorithm, Split]:
    """The algorithm and split of preset ``name`` for ``model``.

    Args:
        name: a registered preset (:func:`preset_names`).
        model: the user's ``nn.Module`` (not copied: the split refers to it).
        local: the client SGD (lr, batch size, clipping; its epochs/steps are the local
            schedule E, except for ``fedrep``, whose epochs are ``head_epochs`` /
            ``body_epochs``).
        example_input: a batch, to order layers by execution (see
            :func:`partialfl.split.make_split`).
        w_init: where w_m starts (``pretrained`` = the model's own values).
        server_opt, aggregator, weighting: as for every algorithm (default: server SGD lr 1 on
            −mean Δθ, i.e. averaging).
        **options: the preset's options (e.g. ``layers=2``, ``head_epochs=5``).

    Returns:
        ``(algorithm, split)``: build the problem with ``ModelProblem(split, data)``.
    """
    e = _preset(name)
    try:
        opts = e.parse(options, f"preset {name!r}")
    except ValueError as err:
        raise ValueError(str(err)) from None
    split = e.trait("make_split")(model, opts, example_input)
    ctx = AlgorithmContext(local, server_opt, aggregator, weighting, w_init, name)
    return e.create(opts, ctx), split
