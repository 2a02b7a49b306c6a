"""Model problems: a torch model, a split into global θ and personal w, and federated data.

Client m's loss is the mean over its training examples,

    f_m(θ, w) = Σ_i ℓ(h(x_i; θ, w), y_i) / Σ_i d_i,

where ``loss_fn(output, y)`` returns per-example losses ℓ (then d_i = 1) or a pair
``(ℓ_i, d_i)`` (e.g. summed token losses and token counts for next-word prediction). The model
h is evaluated functionally on ONE shared module, ``torch.func.functional_call(module,
{**θ, **w}, x)``, so every client uses the same module object and clients can be batched.

Everything is batched over a *cohort* (positions 0..M-1 of the FederatedDataset): w trees carry
a leading client axis ``[k, ...]``; θ is either shared (the parameter's own shape) or per
client (``[k, ...]``, e.g. during local θ-steps). Two execution paths give the same numbers:

* vectorised (``vectorize=True``, a group of k > 1 clients): ``torch.func.vmap`` over the
  clients, with each client's minibatch padded to a common size and masked (masked examples
  add exact zeros to the loss and its gradient; a client with nothing left this step gets a
  zero gradient);
* plain (``vectorize=False`` or a group of one client): one client, no padding.

Which clients form a group is decided by :func:`partialfl.batching.map_clients` with the
problem's mode :attr:`ModelProblem.batching` (``Vmap(max_vmap_examples)`` or ``Loop()``);
each computation here only supplies its vmapped kernel and its one-client kernel.

Dropout is off (the module is put in ``eval()`` mode). Other buffers are constants of the
module, except the running statistics of normalization layers (BatchNorm's ``running_mean``,
``running_var``, ``num_batches_tracked``): those are **personal client state** s_m. They
travel in the personal tree next to w (``init_w`` returns them, names in
:attr:`ModelProblem.state_names`), are never differentiated and never part of θ, so no
update sent to the server contains them. A minibatch step (:meth:`minibatch_grads`) runs the
normalization layers in train mode — the batch's own statistics, with s_m updated by the
layer's momentum rule and returned with ``with_state=True`` — and the vectorised path then
groups clients by minibatch size instead of padding (padding would change the batch
statistics), so it takes the same steps as the plain path (with ``precision`` bf16/fp16 these
steps run client by client: torch cannot differentiate a train-mode BatchNorm under vmap and
autocast). Full-data passes (loss, ∇θ, ∇w,
metrics) use eval mode: f_m(θ, w, s_m) normalizes with the client's running statistics.
A BatchNorm without running statistics (``track_running_stats=False``) is refused (its
evaluation would depend on how the data is chunked).

Devices and precision (:mod:`partialfl.devices`): the module, θ and w live on ``device``; the
data stays in (pinned) host memory and each minibatch is copied with a non-blocking transfer,
unless it is small enough to be kept on the device whole (``data_on_device``). ``precision``
``bf16``/``fp16`` runs the forward pass under ``torch.autocast`` (fp16 with dynamic loss
scaling); parameters and gradients stay fp32. All randomness comes from CPU generators, so a
run takes the same steps on every device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from partialfl.batching import Loop, Vmap, in_process, map_clients
from partialfl.devices import LossScaler, amp_dtype, check_precision, resolve_device
from partialfl.problems.base import W_INITS, check_cohort
from partialfl.rng import global_torch_seed
from partialfl.split import Split
from partialfl.types import Params

LossFn = Callable[[Tensor, Tensor], "Tensor | tuple[Tensor, Tensor]"]
Metric = Callable[[Tensor, Tensor], "tuple[Tensor, Tensor]"]


# ----------------------------------------------------------------------------- losses, metrics
def cross_entropy(output: Tensor, y: Tensor) -> Tensor:
    """Per-example cross-entropy of logits ``[B, C]`` against labels ``[B]``."""
    return F.cross_entropy(output, y, reduction="none")


def accuracy(output: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-example ``(correct, total)`` counts of a classifier: ``argmax == y`` and 1."""
    return (output.argmax(-1) == y).to(output.dtype), torch.ones_like(y, dtype=output.dtype)


def masked_token_accuracy(ignore_index: int = -100) -> Metric:
    """Per-sequence ``(correct, total)`` token counts for outputs ``[B, T, V]`` and targets
    ``[B, T]``; positions with target ``ignore_index`` are not counted (next-word tasks)."""

    def metric(output: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        valid = (y != ignore_index).to(output.dtype)
        hit = (output.argmax(-1) == y).to(output.dtype) * valid
        return hit.sum(-1), valid.sum(-1)

    return metric


def _pair(v: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    if isinstance(v, tuple):
        if len(v) != 2:
            raise ValueError("a loss/metric that returns a tuple must return (value, weight)")
        return v
    return v, torch.ones_like(v)


# ----------------------------------------------------------------------------- the problem
class ModelProblem:
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
        vectorize: use ``torch.func.vmap`` across the clients of a cohort.
        batching: a batching mode (:mod:`partialfl.batching`, e.g. the run's backend); if
            given, it decides ``vectorize`` (a pool's workers each run one client: a loop).
        chunk: examples per client per forward pass in full-data passes (loss, ∇θ, metrics).
        max_vmap_examples: at most this many examples in one vmapped call (clients × batch);
            larger cohorts are processed in groups of clients.
        device: where the module, θ and w live (``cpu``, ``cuda``, ``cuda:N``, ``mps``,
            ``auto``); the split's module is moved there.
        precision: ``fp32``, ``bf16`` or ``fp16`` (autocast of the forward pass).
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
        vectorize: bool = True,
        batching=None,
        chunk: int = 256,
        max_vmap_examples: int = 2048,
        device: str | torch.device = "cpu",
        precision: str = "fp32",
        data_on_device: bool | None = None,
    ) -> None:
        if not isinstance(split, Split):
            raise TypeError(f"split must be a partialfl.split.Split, got {type(split).__name__}")
        if batching is not None:
            vectorize = in_process(batching).vectorized
        self._norm_modules, state, self._fp32_names = _running_stat_modules(split.model,
                                                                           vectorize)
        for v, what in ((chunk, "chunk"), (max_vmap_examples, "max_vmap_examples")):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be a positive integer, got {v!r}")
        self.device = resolve_device(device)
        self.precision = check_precision(precision, self.device)
        self._amp = amp_dtype(self.precision)
        self._acc = torch.float32 if self.device.type == "mps" else torch.float64
        self.scaler = LossScaler() if self.precision == "fp16" else None
        self.split = split
        self.module = split.model.to(self.device).eval()
        self.data = data
        self.loss_fn, self.metric = loss_fn, metric
        self.chunk, self.max_vmap_examples = chunk, max_vmap_examples
        #: how this process maps over a cohort's clients (:func:`partialfl.batching.map_clients`)
        self.batching = Vmap(max_vmap_examples) if vectorize else Loop()
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
        self._store = {s: _flat_split(data, s, self.device, data_on_device)
                       for s in ("train", "test")}
        self._build_fns()

    @property
    def vectorize(self) -> bool:
        """Whether groups of clients run vmapped (:attr:`batching` is a ``Vmap``)."""
        return self.batching.vectorized

    def _build_fns(self) -> None:
        self._step_fn = self._build_step_fn()
        self._sum_grad_fn = self._build_sum_grad_fn()
        self._forward_fn = self._build_forward_fn()
        self._vcache: dict = {}

    _DERIVED = ("_step_fn", "_sum_grad_fn", "_forward_fn", "_vcache")

    def __getstate__(self) -> dict:
        """Pickling (e.g. to spawned worker processes) leaves out the functorch transforms,
        which are rebuilt on unpickling."""
        return {k: v for k, v in self.__dict__.items() if k not in self._DERIVED}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._build_fns()

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
        state = rep(_fresh_stats(self._state0))
        if how == "zero":
            return {**{n: torch.zeros((k, *s), dtype=self.w_pretrained[n].dtype,
                                   device=self.device)
                       for n, s in self.w_shapes.items()}, **state}
        if how == "random":
            rows = [self._random_w(seed, round_, int(m)) for m in cohort]
            return {**{n: torch.stack([r[n] for r in rows]).to(self.device)
                       for n in self.w_names}, **state}
        raise ValueError(f"unknown personal initialisation {how!r}; allowed: {', '.join(W_INITS)}")

    def _random_w(self, seed: int, round_: int, cid: int) -> Params:
        owners = _resettable_owners(self.module, self.w_names)
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
        return self._store[_check_split(split)].sizes[cohort].copy()

    def loss(self, cohort, theta: Params, w: Params) -> np.ndarray:
        """f_m(θ, w_m) on the full training data of each client: ``[k]``."""
        num, den = self._full_pass(cohort, theta, w, "train", "loss")
        return (num / np.maximum(den, 1e-12)).astype(np.float64)

    def grad_theta(self, cohort, theta: Params, w: Params) -> Params:
        """∇_θ f_m(θ, w_m) on the full training data, stacked ``[k, ...]``."""
        return self._full_grad(cohort, theta, w, "theta")

    def grad_w(self, cohort, theta: Params, w: Params) -> Params:
        """∇_w f_m(θ, w_m) on the full training data, stacked ``[k, ...]``."""
        return self._full_grad(cohort, theta, w, "w")

    def lipschitz_w(self, cohort) -> np.ndarray:
        """Not available for a neural network: raises TypeError (give the solver a stepsize)."""
        raise TypeError("a neural-network problem has no known smoothness constant in w; give "
                        "the local solver an explicit learning rate")

    # -- evaluation ----------------------------------------------------------------------
    def metric_counts(self, cohort, theta: Params, w: Params, split: str = "test"
                      ) -> dict[str, np.ndarray]:
        """Per-client sums on ``split``: ``correct``, ``total`` (from the metric) and
        ``loss_sum``, ``loss_weight`` (from the loss), each ``[k]``."""
        num, den, cor, tot = self._full_pass(cohort, theta, w, _check_split(split), "metric")
        return {"correct": cor, "total": tot, "loss_sum": num, "loss_weight": den}

    # -- minibatch gradients (used by partialfl.local.sgd) -----------------------------
    def minibatch_grads(
        self, cohort, theta: Params, w: Params, batches: Sequence[np.ndarray | None], wrt: str,
        *, with_state: bool = False,
    ) -> tuple[Params, Tensor] | tuple[Params, Tensor, Params]:
        """Gradients of each client's mean loss on its minibatch ``batches[i]`` (indices into
        its training examples; ``None``/empty = no step) w.r.t. ``wrt`` ∈ {w, theta, both}.

        Returns the stacked gradients ``[k, ...]`` (zeros for clients without a batch) and the
        minibatch losses ``[k]``; with ``with_state=True`` also the running statistics after
        the step's forward pass (unchanged for clients without a batch; ``{}`` if none)."""
        cohort = check_cohort(cohort, self.num_clients)
        if wrt not in ("w", "theta", "both"):
            raise ValueError(f"wrt must be 'w', 'theta' or 'both', got {wrt!r}")
        k = len(cohort)
        theta_dims = self._theta_dims(theta, k)
        w, state = self._split_state(w)
        store = self._store["train"]
        # torch cannot differentiate a train-mode BatchNorm under vmap and autocast: plain path
        mode = Loop() if (state and self._amp is not None) else self.batching

        def one(pos):
            i = int(pos[0])
            bi = batches[i]
            st_i = _row(state, None, i)
            if bi is None or len(bi) == 0:
                return (self._zeros_like_wrt(theta, w, wrt, 1),
                        torch.zeros(1, device=self.device),
                        {n: v.unsqueeze(0).clone() for n, v in st_i.items()})
            gi = store.gather(int(cohort[i]), bi)
            train, frozen, _, _ = self._arrange(_row(theta, theta_dims, i), _row(w, None, i),
                                                None, wrt)
            ones = torch.ones(len(bi), device=self.device)
            g, (loss, st) = self._scaled(self._plain_step, train, frozen, st_i, *gi, ones)
            return ({n: v.unsqueeze(0) for n, v in g.items()}, loss.detach().unsqueeze(0),
                    {n: v.unsqueeze(0) for n, v in st.items()})

        def many(pos):
            sl = slice(int(pos[0]), int(pos[-1]) + 1)
            return self._minibatch_vmap(cohort[sl], _rows(theta, theta_dims, sl),
                                        _rows(w, None, sl), _rows(state, None, sl),
                                        batches[sl], wrt)

        out = map_clients(many, k, mode, single=one)
        return out if with_state else out[:2]

    def _minibatch_vmap(self, cohort, theta, w, state, batches, wrt):
        """The vmapped kernel of :meth:`minibatch_grads` (a group of k > 1 clients)."""
        k = len(cohort)
        theta_dims = self._theta_dims(theta, k)
        store = self._store["train"]
        sizes = [0 if x is None else len(x) for x in batches]
        b = max(sizes, default=0)
        if b == 0:
            return (self._zeros_like_wrt(theta, w, wrt, k), torch.zeros(k, device=self.device),
                    state)
        if not state:
            idx, mask = store.padded(cohort, batches, b)
            train, frozen, tdims, fdims = self._arrange(theta, w, theta_dims, wrt)
            fn = self._vmapped(self._step_fn, (tdims, fdims, {}))
            x, y = store.take(idx)
            g, (loss, _) = self._scaled(fn, train, frozen, {}, x, y, mask)
            return g, loss.detach(), {}
        # running statistics need each batch as is: group by size instead of padding
        groups = [np.flatnonzero(np.asarray(sizes) == s) for s in sorted(set(sizes) - {0})]
        acc = self._zeros_like_wrt(theta, w, wrt, k)
        losses = torch.zeros(k, device=self.device)
        new_state = {n: v.clone() for n, v in state.items()}
        for pos in groups:
            tp = torch.from_numpy(pos).to(self.device)
            th = {n: (v if theta_dims[n] is None else v[tp]) for n, v in theta.items()}
            idx, mask = store.padded(cohort[pos], [batches[i] for i in pos],
                                     max(sizes[i] for i in pos))
            train, frozen, tdims, fdims = self._arrange(
                th, {n: v[tp] for n, v in w.items()}, theta_dims, wrt)
            fn = self._vmapped(self._step_fn, (tdims, fdims, {n: 0 for n in state}))
            x, y = store.take(idx)
            g, (loss, st) = self._scaled(fn, train, frozen,
                                         {n: v[tp] for n, v in state.items()}, x, y, mask)
            for n in acc:
                acc[n][tp] = g[n]
            for n in st:
                new_state[n][tp] = st[n]
            losses[tp] = loss.detach()
        return acc, losses, new_state

    # -- internals -----------------------------------------------------------------------
    def _theta_dims(self, theta: Params, k: int) -> dict[str, int | None]:
        dims = {}
        for n, v in theta.items():
            s = self.theta_shapes.get(n)
            if s is None:
                raise KeyError(f"{n!r} is not a global parameter of this problem")
            if tuple(v.shape) == s:
                dims[n] = None
            elif tuple(v.shape) == (k, *s):
                dims[n] = 0
            else:
                raise ValueError(f"θ leaf {n!r} has shape {tuple(v.shape)}; expected {s} "
                                 f"(shared) or {(k, *s)} (per client)")
        if set(theta) != set(self.theta_names):
            raise KeyError(f"θ must have exactly the global names {list(self.theta_names)[:6]}…")
        return dims

    def _arrange(self, theta, w, theta_dims, wrt):
        """``(trained, frozen, their in_dims)``; running statistics in w are always frozen."""
        st = {n: w[n] for n in self.state_names if n in w}
        w = {n: v for n, v in w.items() if n not in st}
        sd = {n: 0 for n in st}
        wd = {n: 0 for n in w}
        td = theta_dims or {n: None for n in theta}
        if wrt == "w":
            return w, {**theta, **st}, wd, {**td, **sd}
        if wrt == "theta":
            return theta, {**w, **st}, td, {**wd, **sd}
        return {**theta, **w}, st, {**td, **wd}, sd

    def _zeros_like_wrt(self, theta, w, wrt, k):
        names = {"w": self.w_names, "theta": self.theta_names,
                 "both": self.theta_names + self.w_names}[wrt]
        shapes = {**self.theta_shapes, **self.w_shapes}
        ref = {**theta, **w}
        return {n: torch.zeros((k, *shapes[n]), dtype=ref[n].dtype, device=ref[n].device)
                for n in names}

    def _batch_loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor):
        if self._amp is None:
            out = functional_call(self.module, params, (x,))
            num, den = _pair(self.loss_fn(out, y))
        else:
            # cast the float leaves and inputs explicitly (differentiably: gradients stay
            # fp32), since autocast does not reach every op under vmap (a batched conv); ops
            # that autocast keeps in fp32 (softmax, cross-entropy) still upcast
            # BatchNorm parameters and running statistics stay fp32 (its running statistics
            # are updated in place: a cast copy would drop the update)
            low = {n: (v.to(self._amp) if v.is_floating_point() and n not in self._fp32_names
                       else v) for n, v in params.items()}
            xl = x.to(self._amp) if x.is_floating_point() else x
            with torch.autocast(self.device.type, dtype=self._amp):
                out = functional_call(self.module, low, (xl,))
                num, den = _pair(self.loss_fn(out, y))
            num, den = num.float(), den.float()
        m = mask.to(num.dtype)
        return (num * m).sum(), (den * m).sum(), out

    def _scaled(self, fn, *args):
        """``fn(*args, scale) -> (grads of scale·loss, aux)``, unscaled: fp16 runs it under
        the dynamic loss scaler, other precisions with scale None (= 1)."""
        if self.scaler is None:
            return fn(*args, None)
        return self.scaler.run(lambda scale: fn(*args, scale))

    def _build_step_fn(self):
        """``(train, frozen, stats, x, y, mask, scale) -> (∇_train scale·mean loss, (mean
        loss, stats'))`` (``scale`` None: 1): normalization layers in train mode, ``stats'``
        their running statistics after this batch (updated in place on a copy by the layers
        themselves)."""

        def mean_loss(train, frozen, stats, x, y, mask, scale):
            stats = {n: v.clone() for n, v in stats.items()}
            with _train_mode(self._norm_modules if stats else ()):
                s, d, _ = self._batch_loss({**frozen, **train, **stats}, x, y, mask)
            val = s / torch.clamp(d, min=1e-12)
            return ((val if scale is None else val * scale),
                    (val.detach(), {n: v.detach() for n, v in stats.items()}))

        return grad(mean_loss, has_aux=True)

    def _plain_grad(self, train, frozen, x, y, mask, scale, *, mean: bool,
                    stats: Params | None = None):
        """ONE client's ``_step_fn`` (``mean``, with running statistics ``stats``) or
        ``_sum_grad_fn`` with plain autograd: the same backward arithmetic without a functorch
        transform per call (less overhead)."""
        leaves = {n: v.detach().requires_grad_(True) for n, v in train.items()}
        stats = {n: v.clone() for n, v in (stats or {}).items()}
        with torch.enable_grad(), _train_mode(self._norm_modules if stats else ()):
            s, d, _ = self._batch_loss({**frozen, **leaves, **stats}, x, y, mask)
            val = s / torch.clamp(d, min=1e-12) if mean else s
            out = val if scale is None else val * scale
            gs = torch.autograd.grad(out, list(leaves.values()), allow_unused=True)
        g = {n: torch.zeros_like(leaves[n]) if gi is None else gi for n, gi in zip(leaves, gs)}
        if mean:
            return g, (val.detach(), {n: v.detach() for n, v in stats.items()})
        return g, d.detach()

    def _plain_step(self, train, frozen, stats, x, y, mask, scale):
        """:meth:`_plain_grad` of the mean loss (the plain twin of ``_step_fn``)."""
        return self._plain_grad(train, frozen, x, y, mask, scale, mean=True, stats=stats)

    def _plain_sum(self, train, frozen, x, y, mask, scale):
        """:meth:`_plain_grad` of the summed loss (the plain twin of ``_sum_grad_fn``)."""
        return self._plain_grad(train, frozen, x, y, mask, scale, mean=False)

    def _build_sum_grad_fn(self):
        """``(train, frozen, x, y, mask, scale) -> (∇_train scale·Σ masked loss, Σ weights)``.
        """

        def sum_loss(train, frozen, x, y, mask, scale):
            s, d, _ = self._batch_loss({**frozen, **train}, x, y, mask)
            return (s if scale is None else s * scale), d.detach()

        return grad(sum_loss, has_aux=True)

    def _build_forward_fn(self):
        """``(params, x, y, mask) -> (Σ loss, Σ loss weight, Σ correct, Σ total)``."""

        def fwd(params, x, y, mask):
            s, d, out = self._batch_loss(params, x, y, mask)
            c, t = self.metric(out, y)
            m = mask.to(c.dtype)
            return s, d, (c * m).sum(), (t * m).sum()

        return fwd

    def _vmapped(self, fn, dims: tuple[dict, ...]):
        """vmap of ``fn(*trees, x, y, mask, scale)`` over clients, cached per in_dims."""
        key = (id(fn), *(tuple(sorted(d.items())) for d in dims))
        out = self._vcache.get(key)
        if out is None:
            out = self._vcache[key] = vmap(fn, in_dims=(*dims, 0, 0, 0, None))
        return out

    def _vmapped_fwd(self, fn, dims: dict):
        key = (id(fn), "fwd", tuple(sorted(dims.items())))
        out = self._vcache.get(key)
        if out is None:
            out = self._vcache[key] = vmap(fn, in_dims=(dims, 0, 0, 0))
        return out

    def _per_group(self, kernel, single, cohort, theta, w, *args):
        """``map_clients`` over the cohort in groups of ≤ max_vmap_examples / chunk clients:
        ``kernel`` (vmapped) or ``single`` (one client) on each group's rows."""
        k = len(cohort)
        theta_dims = self._theta_dims(theta, k)

        def part(fn):
            def call(pos):
                sl = slice(int(pos[0]), int(pos[-1]) + 1)
                return fn(cohort[sl], _rows(theta, theta_dims, sl), _rows(w, None, sl), *args)
            return call

        return map_clients(part(kernel), k, self.batching, per_client=self.chunk,
                           single=part(single))

    def _full_grad(self, cohort, theta, w, wrt) -> Params:
        cohort = check_cohort(cohort, self.num_clients)
        self._split_state(w)  # running statistics present (used in eval mode)
        acc, den = self._per_group(self._full_grad_vmap, self._full_grad_one, cohort, theta, w,
                                   wrt)
        scale = 1.0 / torch.clamp(den, min=1e-12)
        return {n: v * scale.reshape((-1,) + (1,) * (v.dim() - 1)) for n, v in acc.items()}

    def _full_grad_vmap(self, cohort, theta, w, wrt) -> tuple[Params, Tensor]:
        """Σ over each client's training data of ∇ loss, and Σ weights (vmapped kernel)."""
        store = self._store["train"]
        k = len(cohort)
        sizes = store.sizes[cohort]
        nchunks = int(np.ceil(sizes.max() / self.chunk)) if sizes.max() > 0 else 0
        acc = self._zeros_like_wrt(theta, w, wrt, k)
        den = torch.zeros(k, device=self.device)
        train, frozen, tdims, fdims = self._arrange(theta, w, self._theta_dims(theta, k), wrt)
        fn = self._vmapped(self._sum_grad_fn, (tdims, fdims))
        for j in range(nchunks):
            batches = _chunk_batches(sizes, j, self.chunk)
            idx, mask = store.padded(cohort, batches, max(len(b) for b in batches))
            x, y = store.take(idx)
            g, d = self._scaled(fn, train, frozen, x, y, mask)
            for n in acc:
                acc[n] += g[n]
            den += d
        return acc, den

    def _full_grad_one(self, cohort, theta, w, wrt) -> tuple[Params, Tensor]:
        """:meth:`_full_grad_vmap` for one client with plain autograd, no padding."""
        store = self._store["train"]
        acc = self._zeros_like_wrt(theta, w, wrt, 1)
        den = torch.zeros(1, device=self.device)
        train, frozen, _, _ = self._arrange(_row(theta, self._theta_dims(theta, 1), 0),
                                            _row(w, None, 0), None, wrt)
        n_1 = int(store.sizes[cohort[0]])
        for j in range(0, n_1, self.chunk):
            bi = np.arange(j, min(n_1, j + self.chunk))
            xy = store.gather(int(cohort[0]), bi)
            ones = torch.ones(len(bi), device=self.device)
            g, d = self._scaled(self._plain_sum, train, frozen, *xy, ones)
            for n in acc:
                acc[n][0] += g[n]
            den[0] += d
        return acc, den

    def _full_pass(self, cohort, theta, w, split, what):
        """Forward-only sums over each client's data: loss (num, den) [+ metric counts]."""
        cohort = check_cohort(cohort, self.num_clients)
        self._split_state(w)  # running statistics present (used in eval mode)
        with torch.no_grad():
            sums = self._per_group(self._pass_vmap, self._pass_one, cohort, theta, w,
                                   self._store[split])
        sums = sums.T.cpu().numpy()
        if what == "loss":
            return sums[0], sums[1]
        return sums[0], sums[1], sums[2], sums[3]

    def _pass_vmap(self, cohort, theta, w, store) -> Tensor:
        """``[k, 4]``: Σ loss, Σ loss weight, Σ correct, Σ total per client (vmapped)."""
        k = len(cohort)
        theta_dims = self._theta_dims(theta, k)
        sums = torch.zeros((4, k), dtype=self._acc, device=self.device)
        fn = self._vmapped_fwd(self._forward_fn, {**theta_dims, **{n: 0 for n in w}})
        params = {**theta, **w}
        sizes = store.sizes[cohort]
        nchunks = int(np.ceil(sizes.max() / self.chunk)) if sizes.max() > 0 else 0
        for j in range(nchunks):
            batches = _chunk_batches(sizes, j, self.chunk)
            idx, mask = store.padded(cohort, batches, max(len(b) for b in batches))
            sums += torch.stack(fn(params, *store.take(idx), mask)).to(self._acc)
        return sums.T

    def _pass_one(self, cohort, theta, w, store) -> Tensor:
        """:meth:`_pass_vmap` for one client, no padding."""
        sums = torch.zeros((4, 1), dtype=self._acc, device=self.device)
        params = {**_row(theta, self._theta_dims(theta, 1), 0), **_row(w, None, 0)}
        n_1 = int(store.sizes[cohort[0]])
        for j in range(0, n_1, self.chunk):
            bi = np.arange(j, min(n_1, j + self.chunk))
            res = self._forward_fn(params, *store.gather(int(cohort[0]), bi),
                                   torch.ones(len(bi), device=self.device))
            sums[:, 0] += torch.stack(res).to(self._acc)
        return sums.T


# ----------------------------------------------------------------------------- helpers
def round_path(round_: int) -> tuple:
    """The rng path component for a round: non-negative rounds as is, negative ones (used
    for deployment / evaluation outside training) as ``("offline", -round_)``."""
    r = int(round_)
    return (r,) if r >= 0 else ("offline", -r)


def _chunk_batches(sizes: np.ndarray, j: int, chunk: int) -> list[np.ndarray]:
    """Chunk j (examples [j·chunk, (j+1)·chunk)) of every client; empty past its end."""
    return [np.arange(min(int(n), j * chunk), min(int(n), (j + 1) * chunk)) for n in sizes]


def _check_split(split: str) -> str:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return split


def _flat_split(data, split: str, device: torch.device, on_device: bool | None):
    """The flat view ModelProblem reads: the data's own (lazy, e.g. an on-disk
    :class:`~partialfl.data.store.StoreDataset`, whose batches are copied to ``device``) if it
    offers one, else tensors in memory."""
    own = getattr(data, "flat_split", None)
    if own is not None:
        return own(split, device)
    return _FlatSplit(data, split, device, on_device)


def padded_rows(offsets: np.ndarray, sizes: np.ndarray, cohort: np.ndarray, batches, b: int
                ) -> tuple[Tensor, Tensor]:
    """Global row indices ``[k, b]`` of the cohort's minibatches (padding repeats the client's
    first example, or row 0) and the float mask ``[k, b]``."""
    k = len(cohort)
    idx = np.zeros((k, b), dtype=np.int64)
    mask = np.zeros((k, b), dtype=np.float32)
    for i, (m, bi) in enumerate(zip(cohort, batches)):
        base = offsets[m] if sizes[m] > 0 else 0
        idx[i] = base
        if bi is not None and len(bi):
            idx[i, : len(bi)] = base + np.asarray(bi)
            mask[i, : len(bi)] = 1.0
    return torch.from_numpy(idx), torch.from_numpy(mask)


class _FlatSplit:
    """One split of a FederatedDataset as flat tensors + per-client offsets.

    On a CPU device the tensors are used in place. On an accelerator they are either moved to
    the device whole (``on_device``; None: when they take under 1 GiB) or kept in pinned host
    memory, and each gathered batch is copied with a non-blocking transfer."""

    DEVICE_BUDGET = 1 << 30

    def __init__(self, data, split: str, device: torch.device | None = None,
                 on_device: bool | None = None) -> None:
        device = torch.device("cpu") if device is None else device
        xs, ys = getattr(data, f"{split}_x"), getattr(data, f"{split}_y")
        self.sizes = np.array([y.shape[0] for y in ys], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.x = torch.cat(list(xs)) if self.sizes.sum() else xs[0][:0]
        self.y = torch.cat(list(ys)) if self.sizes.sum() else ys[0][:0]
        if self.x.shape[0] == 0:  # keep indexing valid for all-empty splits
            self.x = torch.zeros((1, *xs[0].shape[1:]), dtype=xs[0].dtype)
            self.y = torch.zeros((1, *ys[0].shape[1:]), dtype=ys[0].dtype)
        self.device = device
        self.resident = True
        if device.type != "cpu":
            nbytes = sum(t.element_size() * t.numel() for t in (self.x, self.y))
            self.resident = nbytes < self.DEVICE_BUDGET if on_device is None else bool(on_device)
            if self.resident:
                self.x, self.y = self.x.to(device), self.y.to(device)
            elif device.type == "cuda":
                self.x, self.y = self.x.pin_memory(), self.y.pin_memory()

    def take(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """Examples at global indices ``idx`` (any shape), on the device."""
        if self.device.type == "cpu":
            return self.x[idx], self.y[idx]
        if self.resident:
            idx = idx.to(self.device, non_blocking=True)
            return self.x[idx], self.y[idx]
        x, y = self.x[idx], self.y[idx]
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def gather(self, m: int, idx: np.ndarray) -> tuple[Tensor, Tensor]:
        return self.take(torch.from_numpy(self.offsets[m] + np.asarray(idx, dtype=np.int64)))

    def padded(self, cohort: np.ndarray, batches, b: int) -> tuple[Tensor, Tensor]:
        """Global indices ``[k, b]`` (on the host) and the float mask ``[k, b]`` (on the
        device); see :func:`padded_rows`."""
        idx, mask = padded_rows(self.offsets, self.sizes, cohort, batches, b)
        if self.device.type != "cpu":
            mask = mask.to(self.device, non_blocking=True)
        return idx, mask


def _rows(tree: Params, dims: Mapping[str, int | None] | None, sl: slice) -> Params:
    """The rows ``sl`` of a tree whose leaves are stacked (dim 0) or shared (None): views."""
    return {n: (v if dims is not None and dims[n] is None else v[sl]) for n, v in tree.items()}


def _row(tree: Params, dims: Mapping[str, int | None] | None, i: int) -> Params:
    """Client i's leaves of a tree whose leaves are stacked (dim 0) or shared (None)."""
    if dims is None:
        return {n: v[i] for n, v in tree.items()}
    return {n: (v if dims[n] is None else v[i]) for n, v in tree.items()}


def _running_stat_modules(model: nn.Module, vectorize: bool
                          ) -> tuple[tuple[nn.Module, ...], Params, frozenset[str]]:
    """Normalization layers with running statistics, those statistics (name → buffer copy)
    and the names of their parameters and statistics. Refuses what cannot be personal client
    state (see the module docstring)."""
    mods, state, names = [], {}, set()
    for name, m in model.named_modules():
        if not isinstance(m, nn.modules.batchnorm._NormBase):
            continue
        if not m.track_running_stats:
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                raise ValueError(
                    f"module {name!r} is a BatchNorm without running statistics "
                    "(track_running_stats=False): it would normalize evaluation batches with "
                    "their own statistics; keep track_running_stats=True (the statistics are "
                    "personal client state) or use GroupNorm / LayerNorm")
            continue
        if m.momentum is None and vectorize:
            raise ValueError(f"module {name!r} has momentum=None (cumulative average), which "
                             "cannot run under vmap; give it a momentum or use "
                             "vectorize=False")
        mods.append(m)
        for b, v in m.named_buffers(recurse=False):
            if v is not None:
                state[f"{name}.{b}" if name else b] = v.detach().clone()
        names.update(f"{name}.{p}" if name else p for p, _ in m.named_parameters(recurse=False))
    return tuple(mods), state, frozenset(names) | frozenset(state)


def _fresh_stats(state: Params) -> Params:
    """Running statistics of a freshly built layer: mean 0, variance 1, count 0."""
    return {n: (torch.ones_like(v) if n.endswith("running_var") else torch.zeros_like(v))
            for n, v in state.items()}


class _train_mode:
    """Context: the given modules in train mode (batch statistics), eval mode afterwards."""

    def __init__(self, modules) -> None:
        self.modules = modules

    def __enter__(self) -> None:
        for m in self.modules:
            m.train()

    def __exit__(self, *exc) -> None:
        for m in self.modules:
            m.eval()


def _resettable_owners(module: nn.Module, names: Sequence[str]) -> list[str]:
    """Maximal submodules whose parameters are all personal and that can re-initialise
    themselves (``reset_parameters``), covering every personal name."""
    wanted = set(names)
    chosen: list[str] = []
    covered: set[str] = set()
    for mname, m in module.named_modules():
        if any(mname == c or mname.startswith(c + ".") for c in chosen if c) or "" in chosen:
            continue
        pnames = [f"{mname}.{n}" if mname else n for n, _ in m.named_parameters()]
        if pnames and set(pnames) <= wanted and hasattr(m, "reset_parameters"):
            chosen.append(mname)
            covered.update(pnames)
    missing = sorted(wanted - covered)
    if missing:
        raise ValueError(
            f"init 'random' needs reset_parameters() on a module owning only personal "
            f"parameters; none for {missing[:6]}"
        )
    return chosen
