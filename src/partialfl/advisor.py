"""Split advisor: which parameters to personalize, measured before any personalization run.

For a model, federated data and a pre-trained θ (all parameters, e.g. stage 1 of the
pipeline), every candidate group G of parameters (the ``input`` / ``output`` / ``adapter`` /
``norm`` splits and each single layer) is scored on ``clients`` sampled clients. Each sampled
client's training data is cut at random into a fitting part F_m (1 − ``holdout``) and a
validation part V_m (``holdout``); with w = the parameters of G (θ the rest, fixed):

* **validation drop** (the ranking score): ``drop_G = mean_m [ L_Vm(θ, w_pre) − L_Vm(θ, w_m^K) ]``
  where w_m^K is w after ``epochs`` SGD epochs on F_m alone (the stage-3 fine-tuning the
  split would get) — how much making G personal lowers a client's *held-out* loss. Measured
  on V_m, so a large group that only memorises F_m earns nothing;
* ``drop / 1k params`` — the same per thousand personal parameters (a cost-aware view);
* **gradient dissimilarity** ``D_G = mean_m ‖g_m − ḡ‖² / mean_m ‖g_m‖²`` of the per-client
  gradients g_m = ∇_w f_m(θ, w_pre) on F_m (0: every client pulls G the same way, 1: no
  shared direction) — the paper's view of heterogeneity that a personal w_m absorbs.

Groups are ranked by ``drop``; the recommendation is the top group if its drop is positive
by more than its spread over clients allows to call noise (mean − 2·s.e. > 0), else "do not
personalize". Every group is also given as the split a train config writes in its
``[method]`` table (:func:`split_toml`: a kind by name, a layer or group as a ``pattern``
split of its parameter-name regexes). :func:`spearman` (``scipy.stats.spearmanr``) compares
a ranking with measured table accuracies.

API::

    adv = advise(model, data, theta, epochs=3, lr=0.02, clients=10)
    print(adv.table()); adv.recommendation; adv.seconds
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from partialfl.data.federated import FederatedDataset
from partialfl.local.sgd import SGDConfig, run_sgd
from partialfl.problems.model import ModelProblem, accuracy, cross_entropy
from partialfl.rng import generator, torch_seed
from partialfl.split import Split, SplitError, make_split, parameterised_modules
from partialfl.tree import fitted
from partialfl.types import Params


def default_kinds() -> tuple[str, ...]:
    """The registered splits the advisor scores by default (trait ``advise``)."""
    from partialfl.registry import with_trait

    return with_trait("split", "advise")


@dataclass(frozen=True)
class GroupScore:
    """The measured diagnostics of one candidate group (see the module docstring)."""

    name: str
    params: int
    loss_before: float
    loss_after: float
    drop: float
    drop_se: float
    grad_dissimilarity: float
    split: str = ""  # the group as a train config's split (:func:`split_toml`)

    @property
    def drop_per_kparam(self) -> float:
        return 1000.0 * self.drop / max(self.params, 1)


@dataclass
class Advice:
    """Scores sorted by ``drop`` (best first), the recommendation and the cost."""

    scores: list[GroupScore]
    recommendation: str
    seconds: float
    settings: dict = field(default_factory=dict)

    def rank_of(self, name: str) -> int:
        return [s.name for s in self.scores].index(name) + 1

    def splits(self, top: int = 3) -> str:
        """How to write the ``top`` groups as a split: lines of a train config's
        ``[method]`` table."""
        return "\n".join(f"{s.split}    # {s.name}" for s in self.scores[:top])

    def table(self) -> str:
        rows = ["| rank | group | personal params | val. loss before → after | drop ± s.e. | "
                "drop / 1k params | grad. dissimilarity |",
                "| ---: | --- | ---: | --- | --- | ---: | ---: |"]
        for i, s in enumerate(self.scores, 1):
            rows.append(f"| {i} | {s.name} | {s.params:,} | {s.loss_before:.4f} → "
                        f"{s.loss_after:.4f} | {s.drop:+.4f} ± {s.drop_se:.4f} | "
                        f"{s.drop_per_kparam:+.4f} | {s.grad_dissimilarity:.3f} |")
        return "\n".join(rows)

    def as_dict(self) -> dict:
        return {"scores": [{**s.__dict__, "drop_per_kparam": s.drop_per_kparam, "rank": i}
                           for i, s in enumerate(self.scores, 1)],
                "recommendation": self.recommendation, "seconds": self.seconds,
                "settings": self.settings}


def candidate_splits(model: nn.Module, kinds: Sequence[str] | None = None, layers: bool = True,
                     split_fn: Callable[[nn.Module, str, Mapping], Split] | None = None,
                     seed: int = 0, groups: Mapping[str, Sequence[str]] | None = None
                     ) -> dict[str, Split]:
    """name → Split for every kind that applies to ``model`` (kinds that select nothing are
    left out), with ``layers`` one ``layer <module>`` split per parameterised module, and one
    per entry of ``groups`` (name → personal parameter-name regexes, e.g. a transformer
    block); a group equal to an earlier candidate is left out."""
    out: dict[str, Split] = {}
    for k in default_kinds() if kinds is None else kinds:
        try:
            if split_fn is not None:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(torch_seed(seed, "advisor-split"))
                    out[k] = split_fn(model, k, {})
            else:
                out[k] = make_split(model, k, seed=seed) if k == "adapter" else \
                    make_split(model, k)
        except (SplitError, ValueError):
            continue
    seen = {sp.personal_names for sp in out.values()}
    for name, pats in group_patterns(model, layers, groups).items():
        sp = make_split(model, "pattern", personal=list(pats))
        if sp.personal_names not in seen:  # e.g. "layer conv1" is the input split
            out[name] = sp
            seen.add(sp.personal_names)
    return out


def group_patterns(model: nn.Module, layers: bool = True,
                   groups: Mapping[str, Sequence[str]] | None = None) -> dict[str, list[str]]:
    """name → parameter-name regexes of the candidate groups that are not registered kinds:
    ``groups`` and, with ``layers``, ``layer <module>`` for each parameterised module (when
    there are several)."""
    extra = {k: list(v) for k, v in (groups or {}).items()}
    if layers:
        mods = parameterised_modules(model)
        for m in mods if len(mods) > 1 else ():
            extra[f"layer {m}"] = [f"^{re.escape(m)}\\.[^.]+$"]
    return extra


def split_toml(name: str, patterns: Sequence[str] | None = None) -> str:
    """Candidate ``name`` as the line of a train config's ``[method]`` table that makes it
    the personal part: a registered kind by name (``split = "output"``), a group by its
    regexes (``split = { name = "pattern", personal = ['^conv2\\.[^.]+$'] }``, TOML
    literal strings: no escaping)."""
    if patterns is None:
        return f'split = "{name}"'
    if any("'" in p or "\n" in p for p in patterns):
        raise ValueError(f"group {name!r}: a pattern holds a quote or newline: {patterns}")
    pats = ", ".join(f"'{p}'" for p in patterns)
    return f'split = {{ name = "pattern", personal = [{pats}] }}'


def _fit_val(data: FederatedDataset, cohort: np.ndarray, holdout: float, seed: int
             ) -> FederatedDataset:
    """Sampled clients with train = fitting part F_m and test = validation part V_m."""
    fx, fy, vx, vy = [], [], [], []
    for m in cohort:
        x, y = data.train_x[m], data.train_y[m]
        perm = torch.from_numpy(generator(seed, "advisor-holdout", int(m)).permutation(len(y)))
        k = max(1, int(round(holdout * len(y))))
        fx.append(x[perm[k:]])
        fy.append(y[perm[k:]])
        vx.append(x[perm[:k]])
        vy.append(y[perm[:k]])
    return FederatedDataset(fx, fy, vx, vy, [data.client_ids[m] for m in cohort],
                            data.num_classes)


def _val_loss(problem: ModelProblem, theta: Params, w: Params) -> np.ndarray:
    c = problem.metric_counts(np.arange(problem.num_clients), theta, w, "test")
    return c["loss_sum"] / np.maximum(c["loss_weight"], 1e-12)


def _dissimilarity(g: Params) -> float:
    flat = torch.cat([v.reshape(v.shape[0], -1).double() for v in g.values()], dim=1)
    num = (flat - flat.mean(0, keepdim=True)).pow(2).sum(1).mean()
    den = flat.pow(2).sum(1).mean()
    return float(num / den) if den > 0 else 0.0


def score_split(split: Split, data: FederatedDataset, cfg: SGDConfig, seed: int = 0,
                loss_fn=cross_entropy, metric=accuracy, name: str | None = None) -> GroupScore:
    """The diagnostics of one split on ``data`` (train = F_m, test = V_m) for the split's
    current parameter values (θ and w_pre)."""
    theta, w_pre = split.params()
    pb = ModelProblem(split, data, loss_fn=loss_fn, metric=metric, w_pretrained=w_pre)
    allc = np.arange(pb.num_clients)
    w0 = pb.init_w(allc, "pretrained", seed, -1)
    before = _val_loss(pb, theta, w0)
    w = run_sgd(pb, allc, theta, w0, train="w", cfg=cfg, seed=seed, round_=-1,
                stream="advisor").w
    after = _val_loss(pb, theta, w)
    d = before - after
    diss = _dissimilarity(pb.grad_w(allc, theta, w0))
    n = split.counts()["personal_params"]
    return GroupScore(name or split.kind, n, float(before.mean()), float(after.mean()),
                      float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1
                      else 0.0, diss)


def fit_theta(model: nn.Module, theta: Mapping[str, torch.Tensor]) -> nn.Module:
    """Copy ``theta`` (all of ``model``'s parameters by name, each of its shape, finite:
    :func:`partialfl.tree.fitted`) into ``model``; a ValueError naming what differs."""
    own = dict(model.named_parameters())
    bad = sorted(set(theta) ^ set(own))
    if bad:
        raise ValueError(f"theta must name exactly the model's parameters; differs in "
                         f"{bad[:5]}")
    cast = fitted(own, theta)
    with torch.no_grad():
        for n, v in cast.items():
            own[n].copy_(v)
    return model


def advise(model: nn.Module, data: FederatedDataset, theta: Mapping[str, torch.Tensor] | None
           = None, *, kinds: Sequence[str] | None = None, layers: bool = True,
           clients: int = 10, epochs: int = 3, lr: float = 0.02, batch_size: int = 32,
           clip_norm: float | None = None, holdout: float = 0.25, seed: int = 0,
           loss_fn=cross_entropy, metric=accuracy, split_fn=None,
           groups: Mapping[str, Sequence[str]] | None = None) -> Advice:
    """Rank the candidate groups of ``model`` (with pre-trained values ``theta``, all
    parameters by name; None: the model's own) on ``clients`` clients sampled from ``data``
    (see the module docstring). ``split_fn(model, kind, options)`` builds the named kinds
    for models with their own split rules (e.g. the transformer)."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be in (0, 1), got {holdout!r}")
    if clients < 2:
        raise ValueError(f"clients must be >= 2 (the spread needs two), got {clients!r}")
    t0 = time.perf_counter()
    if theta is not None:
        fit_theta(model, theta)
    eligible = np.flatnonzero(data.train_sizes() >= 4)
    if eligible.size < 2:
        raise ValueError("fewer than two clients with >= 4 training examples")
    k = min(clients, eligible.size)
    cohort = np.sort(generator(seed, "advisor-clients").choice(eligible, k, replace=False))
    fv = _fit_val(data, cohort, holdout, seed)
    cfg = SGDConfig(lr=lr, epochs=epochs, batch_size=batch_size, clip_norm=clip_norm)
    cands = candidate_splits(model, kinds, layers, split_fn, seed, groups)
    pats = group_patterns(model, layers, groups)
    scores = [replace(score_split(sp, fv, cfg, seed, loss_fn, metric, name),
                      split=split_toml(name, pats.get(name)))
              for name, sp in cands.items()]
    scores.sort(key=lambda s: s.drop, reverse=True)
    top = scores[0]
    if top.drop - 2 * top.drop_se > 0:
        rec = (f"personalize '{top.name}' ({top.params:,} parameters): it lowers the clients' "
               f"held-out loss most ({top.drop:+.4f} ± {top.drop_se:.4f}); in a train "
               f"config's [method] table: {top.split}")
    else:
        rec = ("do not personalize: no group lowers the clients' held-out loss by more than "
               f"its noise (best '{top.name}': {top.drop:+.4f} ± {top.drop_se:.4f})")
    return Advice(scores, rec, time.perf_counter() - t0,
                  {"clients": [data.client_ids[m] for m in cohort], "epochs": epochs, "lr": lr,
                   "batch_size": batch_size, "holdout": holdout, "seed": seed})


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation of two equally long sequences
    (``scipy.stats.spearmanr``: average ranks for ties; nan when one is constant)."""
    import warnings

    from scipy.stats import spearmanr

    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise ValueError("spearman needs two sequences of the same length >= 2")
    with warnings.catch_warnings():  # a constant input: nan, as documented
        warnings.simplefilter("ignore")
        return float(spearmanr(a, b).statistic)
