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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from partialfl.algorithms.base import Algorithm
from partialfl.algorithms.model import FedAlt, FedSim
from partialfl.local.sgd import SGDConfig
from partialfl.split import Split, SplitError, make_split


@dataclass(frozen=True)
class Preset:
    """A named baseline: an algorithm (``fedsim``/``fedalt``), a split and its options.

    Attributes:
        name: the registry name (key of :data:`PRESETS`).
        title: the name as the paper writes it.
        paper: the reference.
        algorithm: ``"fedsim"`` or ``"fedalt"`` (:mod:`partialfl.algorithms.model`).
        split: the split kind the personal side corresponds to.
        personal: which parameters are personal, in words.
        schedule: the local schedule, in words.
        options: the preset's options and their defaults (:func:`build_preset` ``**options``).
    """

    name: str
    title: str
    paper: str
    algorithm: str
    split: str
    personal: str
    schedule: str
    options: Mapping[str, Any]
    _split_fn: Callable[..., Split] = dataclasses.field(repr=False, compare=False)

    def make_split(self, model: nn.Module, example_input: Tensor | tuple | None = None,
                   **options) -> Split:
        """The preset's split of ``model`` (``options``: see :attr:`options`; the schedule
        options are accepted and ignored here)."""
        opts = self._options(options)
        return self._split_fn(model, example_input,
                              **{k: v for k, v in opts.items() if k not in _SCHEDULE})

    def make_algorithm(self, local: SGDConfig, *, w_init: str = "pretrained",
                       init_seed: int = 0, server_opt=None, aggregator=None,
                       weighting: str = "uniform", **options) -> Algorithm:
        """The preset's algorithm (``options``: see :attr:`options`; the split options are
        accepted and ignored here). See :func:`build_preset` for the arguments."""
        opts = self._options(options)
        common = dict(w_init=w_init, init_seed=init_seed, server_opt=server_opt,
                      aggregator=aggregator, weighting=weighting)
        if self.algorithm == "fedalt":
            head = dataclasses.replace(local, epochs=opts["head_epochs"], steps=None)
            body = dataclasses.replace(local, epochs=opts["body_epochs"], steps=None)
            alg: Algorithm = FedAlt(head, local_theta=body, **common)
        else:
            alg = FedSim(local, **common)
        alg.name = self.name  # logs and progress bars say "fedrep", not "fedalt"
        return alg

    def _options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        bad = sorted(set(options) - set(self.options))
        if bad:
            allowed = ", ".join(self.options) or "none"
            raise ValueError(f"unknown option(s) {bad} for preset {self.name!r}; allowed: "
                             f"{allowed}")
        out = {**self.options, **options}
        for k, v in out.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"preset {self.name!r} option {k!r} must be a positive "
                                 f"integer, got {v!r}")
        return out


#: options that set the local schedule (the others shape the split)
_SCHEDULE = ("head_epochs", "body_epochs")


def _head_split(model, example_input, layers: int) -> Split:
    return make_split(model, "output", layers=layers, example_input=example_input)


def _lg_split(model, example_input, global_layers: int) -> Split:
    """Personal = everything below the top ``global_layers`` layer(s) (the global head, the
    personal side of ``output`` with that many layers)."""
    head = make_split(model, "output", layers=global_layers, example_input=example_input)
    return Split(model, "input", head.personal_names, head.global_names)


def _bn_split(model, example_input) -> Split:
    bns = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        raise SplitError("preset 'fedbn' keeps the BatchNorm layers local, but this model has "
                         "none; for other normalization layers use FedSim with split 'norm'")
    names = [n for n, _ in model.named_parameters()]
    pers = {n for n in names if any(n.startswith(f"{b}.") for b in bns)}
    return Split(model, "norm", tuple(n for n in names if n not in pers),
                 tuple(n for n in names if n in pers))


#: the presets by name
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("fedper", "FedPer", "Arivazhagan et al. 2019, Federated Learning with "
           "Personalization Layers (arXiv:1912.00818)", "fedsim", "output",
           "the last `layers` layer(s) (the head)",
           "FedSim: local epochs on (θ, w_m) jointly, server averages Δθ",
           {"layers": 1}, _head_split),
    Preset("fedrep", "FedRep", "Collins et al. 2021, Exploiting Shared Representations for "
           "Personalized Federated Learning (ICML)", "fedalt", "output",
           "the last `layers` layer(s) (the head)",
           "FedAlt: `head_epochs` epochs on w_m (θ fixed), then `body_epochs` epochs on θ "
           "(w_m fixed), server averages Δθ",
           {"layers": 1, "head_epochs": 10, "body_epochs": 1}, _head_split),
    Preset("lg-fedavg", "LG-FedAvg", "Liang et al. 2020, Think Locally, Act Globally: "
           "Federated Learning with Local and Global Representations (arXiv:2001.01523)",
           "fedsim", "input", "every layer but the last `global_layers` (the global head)",
           "FedSim: local epochs on (θ, w_m) jointly, server averages Δθ",
           {"global_layers": 1}, _lg_split),
    Preset("fedbn", "FedBN", "Li et al. 2021, FedBN: Federated Learning on Non-IID Features "
           "via Local Batch Normalization (ICLR)", "fedsim", "norm",
           "every BatchNorm layer (affine parameters and running statistics)",
           "FedSim: local epochs on (θ, w_m) jointly, server averages Δθ (FedAvg on the "
           "non-BatchNorm parameters)", {}, _bn_split),
)}


def get_preset(name: str) -> Preset:
    """The preset ``name``; a clear error listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}") from None


def build_preset(
    name: str,
    model: nn.Module,
    local: SGDConfig,
    *,
    example_input: Tensor | tuple | None = None,
    w_init: str = "pretrained",
    init_seed: int = 0,
    server_opt=None,
    aggregator=None,
    weighting: str = "uniform",
    **options,
) -> tuple[Algorithm, Split]:
    """The algorithm and split of preset ``name`` for ``model``.

    Args:
        name: a key of :data:`PRESETS`.
        model: the user's ``nn.Module`` (not copied: the split refers to it).
        local: the client SGD (lr, batch size, clipping; its epochs/steps are the local
            schedule E, except for ``fedrep``, whose epochs are ``head_epochs`` /
            ``body_epochs``).
        example_input: a batch, to order layers by execution (see
            :func:`partialfl.split.make_split`).
        w_init, init_seed: where w_m starts (``pretrained`` = the model's own values).
        server_opt, aggregator, weighting: as for every algorithm (default: server SGD lr 1 on
            −mean Δθ, i.e. averaging).
        **options: the preset's :attr:`Preset.options` (e.g. ``layers=2``,
            ``head_epochs=5``).

    Returns:
        ``(algorithm, split)``: build the problem with ``ModelProblem(split, data)``.
    """
    preset = get_preset(name)
    split = preset.make_split(model, example_input, **options)
    alg = preset.make_algorithm(local, w_init=w_init, init_seed=init_seed,
                                server_opt=server_opt, aggregator=aggregator,
                                weighting=weighting, **options)
    return alg, split
