"""The per-batch kernels of a model problem: the functional loss of one (masked) batch, its
gradient as a ``torch.func`` transform (vmapped over a group of clients) and as plain
autograd (one client: the same backward arithmetic, less overhead), and the forward sums of
full-data passes. :class:`Kernels` is a mixin of
:class:`~partialfl.problems.model.ModelProblem`; which kernel runs for which clients is
decided by the caller's mode (:mod:`partialfl.problems.model.passes`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor
from torch.func import functional_call, grad, vmap

from partialfl.problems.model.losses import pair
from partialfl.problems.model.modules import train_mode
from partialfl.types import Params


def channels_last(tree: Params) -> Params:
    """The 4-D floating leaves channels-last (a differentiable copy; the rest as they are).
    ``to`` restrides even where the layout is ambiguous (one channel: ``contiguous`` would
    keep the NCHW strides, and a convolution chooses its kernel by the strides)."""
    cl = torch.channels_last
    return {n: (v.to(memory_format=cl) if v.dim() == 4 and v.is_floating_point() else v)
            for n, v in tree.items()}


#: name → the ``(_parameters or _buffers dict, key)`` slots a module's tensor of that name
#: occupies (every alias of a tied weight)
Slots = dict[str, list[tuple[dict, str]]]


def member_slots(module: torch.nn.Module) -> Slots | None:
    """Where :func:`call_with` puts each named parameter and buffer of ``module``, computed
    once; None when a module has parametrizations (only ``functional_call`` applies them)."""
    from torch.nn.utils import parametrize

    canonical: dict[int, str] = {}
    for n, t in [*module.named_parameters(), *module.named_buffers()]:
        canonical.setdefault(id(t), n)
    slots: Slots = {}
    seen: set[tuple[int, str]] = set()
    for _, m in module.named_modules(remove_duplicate=False):
        if parametrize.is_parametrized(m):
            return None
        for d in (m._parameters, m._buffers):
            for key, t in d.items():
                if t is None or (id(d), key) in seen or id(t) not in canonical:
                    continue
                seen.add((id(d), key))
                slots.setdefault(canonical[id(t)], []).append((d, key))
    return slots


def call_with(module: torch.nn.Module, slots: Slots, params: Params, x: Tensor) -> Tensor:
    """``module(x)`` with its parameters and buffers replaced by ``params`` for the call — what
    ``functional_call(module, params, (x,))`` computes (tied aliases bound together, a tensor
    the module reassigns written back into ``params``), without re-deriving the module's
    structure per call (one client's passes make one such call per step). Not thread-safe:
    each thread has its own module (:meth:`ModelProblem.thread_replica`)."""
    saved: list[tuple[dict, str, Tensor, str]] = []
    try:
        for n, v in params.items():
            for d, key in slots[n]:
                saved.append((d, key, d[key], n))
                d[key] = v
        return module(x)
    finally:
        for d, key, old, n in reversed(saved):  # every slot, even one the module deleted
            now = d.get(key, params[n])
            if now is not params[n]:  # the module replaced it (not an in-place update)
                params[n] = now
            d[key] = old


def rows(tree: Params, dims: Mapping[str, int | None] | None, sl: slice) -> Params:
    """The rows ``sl`` of a tree whose leaves are stacked (dim 0) or shared (None): views."""
    return {n: (v if dims is not None and dims[n] is None else v[sl]) for n, v in tree.items()}


def row(tree: Params, dims: Mapping[str, int | None] | None, i: int) -> Params:
    """Client i's leaves of a tree whose leaves are stacked (dim 0) or shared (None)."""
    if dims is None:
        return {n: v[i] for n, v in tree.items()}
    return {n: (v if dims[n] is None else v[i]) for n, v in tree.items()}


class Kernels:
    """The kernels (see the module docstring); needs the problem's ``module``, ``loss_fn``,
    ``metric``, names and shapes, ``device``, ``_amp``, ``scaler``, ``_norm_modules`` and
    ``_fp32_names``."""

    def _build_fns(self) -> None:
        self._step_fn = self._build_step_fn()
        self._sum_grad_fn = self._build_sum_grad_fn()
        self._forward_fn = self._build_forward_fn()
        self._vcache: dict = {}
        self._slots = member_slots(self.module)

    _DERIVED = ("_step_fn", "_sum_grad_fn", "_forward_fn", "_vcache", "_slots")

    def _call(self, params: Params, x: Tensor, one: bool) -> Tensor:
        """The module on ``x`` with ``params``: one client's plain pass binds them directly
        (:func:`call_with`), a transformed (vmapped) one through ``functional_call``."""
        if one and self._slots is not None and all(n in self._slots for n in params):
            return call_with(self.module, self._slots, params, x)
        return functional_call(self.module, params, (x,))

    def __getstate__(self) -> dict:
        """Pickling (e.g. to spawned worker processes) leaves out the functorch transforms,
        which are rebuilt on unpickling."""
        return {k: v for k, v in self.__dict__.items() if k not in self._DERIVED}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._build_fns()

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

    def _batch_loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor | None,
                    one: bool = False):
        """``(Σ mask·ℓ, Σ mask·d, output)`` of one batch (``mask`` None: every example).
        ``one``: one client's plain pass, where ``memory_format`` applies (not under vmap)."""
        if one and self.memory_format == "channels_last":
            params, x = channels_last(params), channels_last({"x": x})["x"]
        if self._amp is None:
            out = self._call(params, x, one)
            num, den = pair(self.loss_fn(out, y))
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
                out = self._call(low, xl, one)
                num, den = pair(self.loss_fn(out, y))
            num, den = num.float(), den.float()
        if mask is None:  # one client's own examples, no padding: the sums a mask of ones
            return num.sum(), den.sum(), out  # gives (ℓ·1 = ℓ exactly), two ops less each way
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
            with train_mode(self._norm_modules if stats else ()):
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
        with torch.enable_grad(), train_mode(self._norm_modules if stats else ()):
            s, d, _ = self._batch_loss({**frozen, **leaves, **stats}, x, y, mask, one=True)
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
        """``(params, x, y, mask) -> (Σ loss, Σ loss weight, Σ correct, Σ total)`` (``mask``
        None: every example)."""

        def fwd(params, x, y, mask, one=False):
            s, d, out = self._batch_loss(params, x, y, mask, one)
            c, t = self.metric(out, y)
            if mask is None:  # one client, no padding (see _batch_loss)
                return s, d, c.sum(), t.sum()
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
