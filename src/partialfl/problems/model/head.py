"""FFGG's client in one forward pass when w is the model's output layer (the head).

FFGG (Algorithm 1) on client m: w_m ← SGD on f_m(θ, ·) with θ fixed, then g_m = ∇_θ f_m(θ, w_m)
on the full training data. When w is exactly the parameters of the layer h that produces the
model's output, f_m(θ, w) = Σ_i ℓ(h_w(φ_θ(x_i)), y_i) / Σ_i d_i with features φ_θ(x_i) that do
not depend on w. So the body φ_θ runs once per example: its forward pass on the client's data
(in chunks of ``chunk`` examples, the graph kept), the fine-tuning steps on the detached
features (h alone per minibatch), then ∇_θ by back-propagating ℓ(h_{w_m}(φ_θ(x)), y) through the
kept graph, chunk by chunk. Same steps and sums as fine-tuning through the whole model and
then taking the full-data gradient (:meth:`~partialfl.problems.model.ModelProblem.plain_sgd`
and ``_full_grad``), without the fine-tuning's forward passes through the body: a round of
FFGG with output personalization does about a quarter less work (``benchmarks/peers.py``).
The results are those of the two-pass path within float rounding (the body's features come
from chunks instead of minibatches; a matrix product may round a row differently in another
batch size) — bit for bit for the EMNIST CNN on CPU, whose convolutions compute each row
alone (``tests/test_head_cache.py``). Every backend takes the same path, so a run is the same
bit for bit on the sequential, ``threads`` and ``processes`` backends.

Applies (:meth:`HeadCache.head_cache_ok`) to one client's plain passes (mode ``Loop``) when
the personal parameters are all the parameters of one module, none of them 4-D or tied to
another module, with no running statistics, no autocast and no loss scaling. A forward pass
checks that the module is called once, positionally, without hooks, and that its output is
the model's, unchanged after it (its version counter); and the first client a problem serves
(per process or thread replica) runs both paths, the one pass kept only if the two agree
within float rounding (a body that reads the
head's weights, an input transformed by a hook, an output changed in place). Otherwise the
problem takes the two passes for good. A client with more than
:data:`HEAD_CACHE_EXAMPLES` examples takes the two passes (the kept graph grows with its data).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from partialfl.problems.model.kernels import call_with, member_slots
from partialfl.problems.model.losses import pair
from partialfl.types import Params

#: a client with more training examples than this takes the two passes (see the docstring)
HEAD_CACHE_EXAMPLES = 1024


class HeadCache:
    """The one-pass FFGG client (see the module docstring); a mixin of
    :class:`~partialfl.problems.model.ModelProblem`."""

    def _head_module(self) -> tuple[str, torch.nn.Module] | None:
        """``(prefix, module)`` whose parameters are exactly the personal ones, else None."""
        if not self.w_names:
            return None
        prefix = self.w_names[0].rpartition(".")[0]
        mods = dict(self.module.named_modules())
        head = mods.get(prefix)
        if head is None:
            return None
        own = {f"{prefix}.{n}" if prefix else n for n, _ in head.named_parameters()}
        return (prefix, head) if own == set(self.w_names) else None

    def head_cache_ok(self) -> bool:
        """Whether :meth:`head_finetune_grad` may run the one-pass path (see the module
        docstring; the forward check of the head's place comes on first use)."""
        if getattr(self, "_head_checked", None) is False or not self.plain_sgd_ok:
            return False
        if self._amp is not None or self._slots is None:
            return False
        found = self._head_module()
        if found is None:
            return False
        if any(len(self._slots.get(n, ())) != 1 for n in self.w_names):
            return False  # a tied weight: the features would depend on w
        return all(len(self.w_shapes[n]) != 4 for n in self.w_names)

    def head_finetune_grad(self, client: int, theta: Params, w0: Params,
                           plan: Sequence[np.ndarray], lr: float
                           ) -> tuple[Params, Tensor, Params, Tensor]:
        """ONE client's FFGG step: w fine-tuned from ``w0`` by SGD with stepsize ``lr`` on the
        minibatches of ``plan`` (θ fixed), then Σ_i ∇_θ ℓ_i(θ, w') on its full training data.
        Returns ``(w', Σ_b minibatch loss, Σ ∇_θ, Σ loss weights)``, unstacked: what
        :meth:`plain_sgd` (``wrt="w"``) and the full-data gradient pass give.

        The first client this problem serves (per process or thread replica) runs both
        paths: the one pass is kept only if it gives the two passes' values (within float
        rounding) — a model whose body reads the head's weights, hooks that transform the
        head's input or in-place changes to its output pass the forward checks but not
        this one."""
        n = int(self._store["train"].sizes[client])
        if n > HEAD_CACHE_EXAMPLES or n == 0 or not len(plan) or not self.head_cache_ok():
            return self._two_passes(client, theta, w0, plan, lr)
        fast = self._one_pass(client, theta, w0, plan, lr, n)
        if fast is None:
            self._head_checked = False  # the head is not the model's last layer
            return self._two_passes(client, theta, w0, plan, lr)
        if getattr(self, "_head_checked", None) is True:
            return fast
        ref = self._two_passes(client, theta, w0, plan, lr)
        self._head_checked = all(_close(a, b) for a, b in zip(fast, ref))
        return fast if self._head_checked else ref  # every client the same path

    def _one_pass(self, client, theta, w0, plan, lr, n):
        """:meth:`head_finetune_grad` in one forward pass through the body; None when the
        forward checks fail (the head called more than once, by keyword, with hooks, or its
        output not the model's or changed in place after it)."""
        prefix, head = self._head_module()
        if head._forward_hooks or head._forward_pre_hooks:
            return None
        store = self._store["train"]
        train, frozen, _, _ = self._arrange(theta, w0, None, "theta")
        leaves = {k: v.detach().requires_grad_(True) for k, v in train.items()}
        seen: list[tuple[tuple, dict, Tensor, int]] = []

        def hook(_mod, args, kwargs, out):
            seen.append((args, kwargs, out, out._version))

        feats, ys = [], []
        handle = head.register_forward_hook(hook, with_kwargs=True)
        try:
            for j in range(0, n, self.chunk):
                x, y = store.gather(client, np.arange(j, min(n, j + self.chunk)))
                del seen[:]
                with torch.enable_grad():
                    _, _, out = self._batch_loss({**frozen, **leaves}, x, y, None, one=True)
                if len(seen) != 1 or seen[0][1] or len(seen[0][0]) != 1 or \
                        seen[0][2] is not out or seen[0][0][0].dim() < 2 or \
                        out._version != seen[0][3]:  # changed in place after the head
                    return None
                feats.append(seen[0][0][0])
                ys.append(y)
        finally:
            handle.remove()
        w1, total = self._finetune_head(head, prefix, w0, torch.cat([f.detach() for f in feats]),
                                        torch.cat(ys), plan, lr)
        local = {k.removeprefix(prefix + ".") if prefix else k: v.detach()
                 for k, v in w1.items()}
        slots = member_slots(head)
        names = list(leaves)
        acc = {k: torch.zeros_like(v) for k, v in leaves.items()}
        den = torch.zeros((), device=self.device)
        for f, y in zip(feats, ys):
            with torch.enable_grad():
                num, d = pair(self.loss_fn(call_with(head, slots, dict(local), f), y))
                gs = torch.autograd.grad(num.sum(), [leaves[k] for k in names],
                                         allow_unused=True)
            for k, g in zip(names, gs):
                if g is not None:
                    acc[k] += g
            den += d.sum().detach()
        return w1, total, acc, den

    def _finetune_head(self, head, prefix: str, w0: Params, feats: Tensor, y: Tensor,
                       plan: Sequence[np.ndarray], lr: float) -> tuple[Params, Tensor]:
        """SGD on the head's parameters over the detached features: :meth:`plain_sgd`'s steps
        (η·g, then the subtraction) with the head alone in the forward pass."""
        leaves = {n: v.detach().clone().requires_grad_(True) for n, v in w0.items()}
        local = {n.removeprefix(prefix + ".") if prefix else n: v for n, v in leaves.items()}
        slots = member_slots(head)
        xs = list(leaves.values())
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for b in plan:
            rows = torch.from_numpy(np.asarray(b, dtype=np.int64)).to(feats.device)
            with torch.enable_grad():
                num, den = pair(self.loss_fn(call_with(head, slots, dict(local),
                                                       feats.index_select(0, rows)),
                                             y.index_select(0, rows)))
                val = num.sum() / torch.clamp(den.sum(), min=1e-12)
                gs = torch.autograd.grad(val, xs, allow_unused=True)
            with torch.no_grad():
                for v, g in zip(xs, gs):
                    if g is not None:
                        v.sub_(lr * g)
            total += val.detach().to(total.dtype)
        return {n: v.detach().contiguous() for n, v in leaves.items()}, total

    def _two_passes(self, client, theta, w0, plan, lr):
        """:meth:`head_finetune_grad` by :meth:`plain_sgd` and the full-data gradient."""
        _, w1, total = self.plain_sgd(client, theta, w0, plan, "w", lr)
        acc, den = self._full_grad_one(np.array([client]), theta,
                                       {n: v.unsqueeze(0) for n, v in w1.items()}, "theta")
        return w1, total, {n: v[0] for n, v in acc.items()}, den[0]


def _close(a, b) -> bool:
    """Whether two results (trees or tensors) agree within float rounding (never where
    either is not finite)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False  # a diverged θ: nothing to compare, the two passes are kept
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-6 * (1 + float(b.abs().max()))))
