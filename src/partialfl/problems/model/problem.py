"""The model problem: a torch module split into θ and w, federated data, the problem protocol
(see :mod:`partialfl.problems.model` for the definition of f_m and how it is computed)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from partialfl.batching import MAX_EXAMPLES, Loop, Vmap, in_process
from partialfl.devices import LossScaler, amp_dtype, check_precision, resolve_device
from partialfl.problems.base import W_INITS, check_cohort
from partialfl.problems.model.data import check_split, flat_split
from partialfl.problems.model.head import HeadCache
from partialfl.problems.model.kernels import Kernels
from partialfl.problems.model.losses import LossFn, Metric, accuracy, cross_entropy
from partialfl.problems.model.modules import fresh_stats, resettable_owners, running_stat_modules
from partialfl.problems.model.passes import CohortPasses
from partialfl.rng import global_torch_seed, round_path
from partialfl.spec.base import MEMORY_FORMATS
from partialfl.split import Split
from partialfl.types import Params


def default_mode(mode, vectorize: bool | None = None, batching=None,
                 max_vmap_examples: int | None = None) -> Vmap | Loop:
    """A model problem's default batching mode from ``mode`` or its older spellings
    (``vectorize``, ``batching``, ``max_vmap_examples``); ``Vmap()`` when none is given."""
    if mode is not None and (vectorize is not None or batching is not None
                             or max_vmap_examples is not None):
        raise TypeError("give the batching mode as mode=… alone (vectorize, batching and "
                        "max_vmap_examples are older spellings of it)")
    if max_vmap_examples is not None:
        Vmap(max_vmap_examples)  # validates
    if mode is None and batching is not None:
        mode = in_process(batching)
        if max_vmap_examples is not None and mode.vectorized:
            mode = Vmap(max_vmap_examples)
    if mode is None:
        mode = (Loop() if vectorize is False else
                Vmap(MAX_EXAMPLES if max_vmap_examples is None else max_vmap_examples))
    if not isinstance(mode, Vmap | Loop):
        raise TypeError(f"mode must be a Vmap or a Loop (partialfl.batching), got {mode!r}")
    return in_process(mode)


class ModelProblem(CohortPasses, HeadCache, Kernels):
    """A federated problem over a torch model (see the module docstring).

    Args:
        split: the model and its global / personal parameter names (:mod:`partialfl.split`).
        data: a :class:`~partialfl.data.federated.FederatedDataset`; client m = position m.
        loss_fn: ``(output, y) -> ℓ [B]`` or ``(ℓ [B], d [B])`` (default: cross-entropy).
        metric: ``(output, y) -> (correct [B], total [B])`` (default: top-1 accuracy).
        w_pretrained: the personal values (optionally with running statistics, default the
            module's buffers) that ``init_w(..., "pretrained")`` restarts from
            (default: the split model's current values — after stage 1 of the pipeline, the
            pre-trained layers; for inserted adapters, their zero-output initialisation).
        mode: the batching mode of calls that pass none (calls made outside a run; a run
            passes its executor's with every call): ``Vmap(max_examples)`` (default
            ``Vmap()``) or ``Loop()``. ``vectorize`` (True: ``Vmap(max_vmap_examples)``,
            False: ``Loop()``), ``batching`` (a run's backend: its in-process mode) and
            ``max_vmap_examples`` are older spellings of it.
        chunk: examples per client per forward pass in full-data passes (loss, ∇θ, metrics).
        device: where the module, θ and w live (``cpu``, ``cuda``, ``cuda:N``, ``mps``,
            ``auto``); the split's module is moved there.
        precision: ``fp32``, ``bf16`` or ``fp16`` (autocast of the forward pass).
        memory_format: ``contiguous`` or ``channels_last``: one client's passes (the
            sequential, threads and processes backends) run 4-D inputs and weights
            channels-last, where CPU convolutions and pooling are much faster; the values are
            the same maths in another summation order (not bit for bit those of
            ``contiguous``, but bit for bit the same across those backends). Batched (vmap)
            passes stay contiguous.
        data_on_device: keep the whole dataset on ``device`` (True), in pinned host memory with
            per-batch copies (False), or decide by size (None: on the device when it takes
            under 1 GiB there).
    """

    def __init__(
        self,
        split: Split,
        data,
        *,
        loss_fn: LossFn = cross_entropy,
        metric: Metric = accuracy,
        w_pretrained: Params | None = None,
        mode: Vmap | Loop | None = None,
        chunk: int = 256,
        device: str | torch.device = "cpu",
        precision: str = "fp32",
        memory_format: str = "contiguous",
        data_on_device: bool | None = None,
        vectorize: bool | None = None,
        batching=None,
        max_vmap_examples: int | None = None,
    ) -> None:
        if not isinstance(split, Split):
            raise TypeError(f"split must be a partialfl.split.Split, got {type(split).__name__}")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        #: the batching mode of calls that pass none (see :meth:`call_mode`)
        self.mode = default_mode(mode, vectorize, batching, max_vmap_examples)
        self._norm_modules, state, self._fp32_names, self._cumulative_norms = \
            running_stat_modules(split.model)
        self.call_mode()  # a layer that cannot run under vmap refuses a Vmap default now
        self.device = resolve_device(device)
        self.precision = check_precision(precision, self.device)
        self._amp = amp_dtype(self.precision)
        if memory_format not in MEMORY_FORMATS:
            raise ValueError(f"memory_format must be one of {', '.join(MEMORY_FORMATS)}, got "
                             f"{memory_format!r}")
        self.memory_format = memory_format
        self._acc = torch.float32 if self.device.type == "mps" else torch.float64
        self.scaler = LossScaler() if self.precision == "fp16" else None
        self.split = split
        self.module = split.model.to(self.device).eval()
        self.data = data
        self.loss_fn, self.metric = loss_fn, metric
        self.chunk = chunk
        self.theta_names = tuple(split.global_names)
        self.w_names = tuple(split.personal_names)
        theta0, w0 = split.params()
        self._theta0 = theta0
        self.theta_shapes = {n: tuple(v.shape) for n, v in theta0.items()}
        self.w_shapes = {n: tuple(v.shape) for n, v in w0.items()}
        #: names of the personal client state s_m: normalization running statistics
        self.state_names = tuple(state)
        self.state_shapes = {n: tuple(v.shape) for n, v in state.items()}
        self._state0 = {n: v.to(self.device) for n, v in state.items()}
        self.w_pretrained = self._check_w(w0 if w_pretrained is None else w_pretrained)
        self.num_clients = data.num_clients
        self._store = {s: flat_split(data, s, self.device, data_on_device)
                       for s in ("train", "test")}
        self._build_fns()

    def _check_w(self, w: Mapping[str, Tensor]) -> Params:
        """w_pretrained: the personal parameters, plus running statistics (default: the
        module's own buffers)."""
        w = {**self._state0, **w}
        if set(w) != set(self.w_names) | set(self.state_names):
            raise KeyError(f"personal values must have exactly the names {list(self.w_names)}"
                           f" (and optionally {list(self.state_names)}), got {sorted(w)}")
        out = {}
        shapes = {**self.w_shapes, **self.state_shapes}
        for n in (*self.w_names, *self.state_names):
            v = torch.as_tensor(w[n]).detach().to(self.device)
            if tuple(v.shape) != shapes[n]:
                raise ValueError(f"personal value {n!r} has shape {tuple(v.shape)}, expected "
                                 f"{shapes[n]}")
            out[n] = v.clone()
        return out

    def _split_state(self, w: Params) -> tuple[Params, Params]:
        """``(personal parameters, running statistics)`` of a personal tree."""
        missing = [n for n in self.state_names if n not in w]
        if missing:
            raise KeyError(f"the personal tree lacks the running statistics {missing[:4]} "
                           "(personal client state of the BatchNorm layers; init_w gives them)")
        return ({n: v for n, v in w.items() if n not in self.state_names},
                {n: w[n] for n in self.state_names})

    # -- Problem protocol ----------------------------------------------------------------
    def init_theta(self, rng: np.random.Generator | None = None) -> Params:
        """θ⁰: the split model's current global values (seed the model when you build it)."""
        return {n: v.clone() for n, v in self._theta0.items()}

    def init_w(self, cohort: np.ndarray, how: str, seed: int, round_: int) -> Params:
        """Personal parameters for the cohort, stacked ``[k, ...]``.

        * ``pretrained`` — every client restarts from :attr:`w_pretrained`;
        * ``zero`` — all zeros (note: a low-rank adapter with both factors 0 cannot move);
        * ``random`` — a fresh initialisation as a newly built model would have it (each
          module's own ``reset_parameters``), seeded per (seed, round, client).

        Running statistics (:attr:`state_names`) start from :attr:`w_pretrained` for
        ``pretrained`` and from a fresh layer's (mean 0, variance 1, count 0) otherwise.
        """
        cohort = check_cohort(cohort, self.num_clients)
        k = len(cohort)

        def rep(tree):
            return {n: v.unsqueeze(0).repeat(k, *([1] * v.dim())) for n, v in tree.items()}

        if how == "pretrained":
            return rep(self.w_pretrained)
        state = rep(fresh_stats(self._state0))
        if how == "zero":
            return {**{n: torch.zeros((k, *s), dtype=self.w_pretrained[n].dtype,
                                   device=self.device)
                       for n, s in self.w_shapes.items()}, **state}
        if how == "random":
            rows = [self._random_w(seed, round_, int(m)) for m in cohort]
            return {**{n: torch.stack([r[n] for r in rows]).to(self.device)
                       for n in self.w_names}, **state}
        raise ValueError(f"unknown personal initialisation {how!r}; allowed: {', '.join(W_INITS)}")

    def thread_replica(self) -> ModelProblem:
        """A copy to run clients in another thread at the same time as this problem
        (:mod:`partialfl.runtime.threads`): the same data, settings and θ⁰ (shared, read
        only), its own module — ``functional_call`` swaps the module's parameters while it
        runs and normalization layers switch between train and eval mode — with its own
        functorch transforms and fp16 loss scaler."""
        new = copy.copy(self)
        new.module = copy.deepcopy(self.module)
        names = {id(m): n for n, m in self.module.named_modules()}
        mods = dict(new.module.named_modules())
        new._norm_modules = tuple(mods[names[id(m)]] for m in self._norm_modules)
        new.scaler = copy.deepcopy(self.scaler)
        new._build_fns()
        return new

    def _random_w(self, seed: int, round_: int, cid: int) -> Params:
        owners = resettable_owners(self.module, self.w_names)
        mods = dict(self.module.named_modules())
        out: Params = {}
        with global_torch_seed(seed, "init_w", *round_path(round_), cid):  # thread-safe
            for owner in owners:
                # re-initialise a CPU copy: the CPU generator, hence the same w on every device
                fresh = copy.deepcopy(mods[owner]).to("cpu")
                fresh.reset_parameters()
                for n, p in fresh.named_parameters():
                    full = f"{owner}.{n}" if owner else n
                    if full in self.w_shapes:
                        out[full] = p.detach().clone()
        return out

    def num_examples(self, cohort: np.ndarray, split: str = "train") -> np.ndarray:
        """Number of examples of each client: ``[k]``."""
        cohort = check_cohort(cohort, self.num_clients)
        return self._store[check_split(split)].sizes[cohort].copy()

    def loss(self, cohort, theta: Params, w: Params, *, mode=None) -> np.ndarray:
        """f_m(θ, w_m) on the full training data of each client: ``[k]`` (``mode``: the
        caller's batching mode, see :meth:`call_mode`)."""
        num, den = self._full_pass(cohort, theta, w, "train", "loss", mode)
        return (num / np.maximum(den, 1e-12)).astype(np.float64)

    def grad_theta(self, cohort, theta: Params, w: Params, *, mode=None) -> Params:
        """∇_θ f_m(θ, w_m) on the full training data, stacked ``[k, ...]``."""
        return self._full_grad(cohort, theta, w, "theta", mode)

    def grad_w(self, cohort, theta: Params, w: Params, *, mode=None) -> Params:
        """∇_w f_m(θ, w_m) on the full training data, stacked ``[k, ...]``."""
        return self._full_grad(cohort, theta, w, "w", mode)

    def lipschitz_w(self, cohort) -> np.ndarray:
        """Not available for a neural network: raises TypeError (give the solver a stepsize)."""
        raise TypeError("a neural-network problem has no known smoothness constant in w; give "
                        "the local solver an explicit learning rate")

    # -- evaluation ----------------------------------------------------------------------
    def metric_counts(self, cohort, theta: Params, w: Params, split: str = "test", *,
                      mode=None) -> dict[str, np.ndarray]:
        """Per-client sums on ``split``: ``correct``, ``total`` (from the metric) and
        ``loss_sum``, ``loss_weight`` (from the loss), each ``[k]``."""
        num, den, cor, tot = self._full_pass(cohort, theta, w, check_split(split), "metric",
                                             mode)
        return {"correct": cor, "total": tot, "loss_sum": num, "loss_weight": den}

