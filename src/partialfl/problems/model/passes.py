"""A model problem's computations over a cohort of clients, under a batching mode: full-data
gradients and forward passes (in chunks of ``chunk`` examples per client) and minibatch
gradients. Each supplies a vmapped kernel (a group of clients, minibatches padded and masked)
and a one-client kernel (plain autograd, no padding);
:func:`partialfl.batching.map_clients` runs them over the groups the caller's mode makes.
:class:`CohortPasses` is a mixin of :class:`~partialfl.problems.model.ModelProblem`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from partialfl.batching import Loop, Vmap, in_process, map_clients
from partialfl.problems.base import check_cohort
from partialfl.problems.model.data import chunk_batches
from partialfl.problems.model.kernels import channels_last, row, rows
from partialfl.types import Params


class CohortPasses:
    """The cohort computations (see the module docstring); the problem supplies ``mode`` (its
    default for calls made outside a run), the kernels, ``chunk`` and the data."""

    def call_mode(self, mode=None) -> Vmap | Loop:
        """The batching mode of one call: the caller's ``mode`` (a run passes its executor's,
        :attr:`partialfl.batching.Executor.kernel_mode`), else the problem's default
        :attr:`mode`. A normalization layer with ``momentum=None`` refuses a :class:`Vmap`."""
        mode = self.mode if mode is None else in_process(mode)
        if mode.vectorized and self._cumulative_norms:
            raise ValueError(f"module {self._cumulative_norms[0]!r} has momentum=None "
                             "(cumulative average), which cannot run under vmap; give it a "
                             "momentum or run the clients in a loop (mode Loop(), backend "
                             "sequential)")
        return mode

    def minibatch_grads(
        self, cohort, theta: Params, w: Params, batches: Sequence[np.ndarray | None], wrt: str,
        *, with_state: bool = False, mode=None,
    ) -> tuple[Params, Tensor] | tuple[Params, Tensor, Params]:
        """Gradients of each client's mean loss on its minibatch ``batches[i]`` (indices into
        its training examples; ``None``/empty = no step) w.r.t. ``wrt`` ∈ {w, theta, both}.

        Returns the stacked gradients ``[k, ...]`` (zeros for clients without a batch) and the
        minibatch losses ``[k]``; with ``with_state=True`` also the running statistics after
        the step's forward pass (unchanged for clients without a batch; ``{}`` if none).
        ``mode``: the caller's batching mode (see :meth:`call_mode`)."""
        cohort = check_cohort(cohort, self.num_clients)
        mode = self.call_mode(mode)
        if wrt not in ("w", "theta", "both"):
            raise ValueError(f"wrt must be 'w', 'theta' or 'both', got {wrt!r}")
        k = len(cohort)
        theta_dims = self._theta_dims(theta, k)
        w, state = self._split_state(w)
        store = self._store["train"]
        # torch cannot differentiate a train-mode BatchNorm under vmap and autocast: plain path
        if state and self._amp is not None:
            mode = Loop()

        def one(pos):
            i = int(pos[0])
            bi = batches[i]
            st_i = row(state, None, i)
            if bi is None or len(bi) == 0:
                return (self._zeros_like_wrt(theta, w, wrt, 1),
                        torch.zeros(1, device=self.device),
                        {n: v.unsqueeze(0).clone() for n, v in st_i.items()})
            gi = store.gather(int(cohort[i]), bi)
            train, frozen, _, _ = self._arrange(row(theta, theta_dims, i), row(w, None, i),
                                                None, wrt)
            g, (loss, st) = self._scaled(self._plain_step, train, frozen, st_i, *gi, None)
            return ({n: v.unsqueeze(0) for n, v in g.items()}, loss.detach().unsqueeze(0),
                    {n: v.unsqueeze(0) for n, v in st.items()})

        def many(pos):
            sl = slice(int(pos[0]), int(pos[-1]) + 1)
            return self._minibatch_vmap(cohort[sl], rows(theta, theta_dims, sl),
                                        rows(w, None, sl), rows(state, None, sl),
                                        batches[sl], wrt)

        out = map_clients(many, k, mode, single=one)
        return out if with_state else out[:2]

    @property
    def plain_sgd_ok(self) -> bool:
        """Whether :meth:`plain_sgd` applies: no running statistics (their update is a
        per-step copy) and no fp16 loss scaling (a step may be retried)."""
        return not self.state_names and self.scaler is None

    def plain_sgd(self, client: int, theta: Params, w: Params, plan: Sequence[np.ndarray],
                  wrt: str, lr: float) -> tuple[Params, Params, Tensor]:
        """ONE client's local SGD on ``wrt`` ∈ {w, theta, both}: for each minibatch b of
        ``plan`` (indices into its training examples), x ← x − η ∇_x mean_{i∈b} ℓ_i(θ, w)
        (the inner loop of Alg. 1 / FedAvg's local steps). Returns ``(θ', w', Σ_b loss_b)``,
        unstacked (θ' the input θ when not trained).

        The fast twin of :func:`partialfl.local.sgd.run_sgd`'s loop for a group of one
        client (mode ``Loop``): the trained leaves are made once, in the run's memory format,
        and updated in place (η·g, then the subtraction: the reference's two roundings), so
        a step dispatches no per-leaf views, copies or ``requires_grad_`` — bit for bit the
        reference loop on the same leaves (``tests/test_plain_sgd.py``). The leaves are fresh
        allocations, so a client's result does not depend on its row in a stacked cohort
        (the reference trains views into the stack, and a BLAS kernel may round differently
        on a row that is not aligned). Needs :attr:`plain_sgd_ok`."""
        if not self.plain_sgd_ok:
            raise ValueError("plain_sgd needs a problem without running statistics and "
                             "without fp16 loss scaling (use minibatch_grads)")
        store = self._store["train"]
        train, frozen, _, _ = self._arrange(theta, w, None, wrt)
        if self.memory_format == "channels_last":
            train, frozen = channels_last(train), channels_last(frozen)
        leaves = {n: v.detach().clone().requires_grad_(True) for n, v in train.items()}
        params, xs = {**frozen, **leaves}, list(leaves.values())
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for b in plan:
            x, y = store.gather(int(client), b)
            with torch.enable_grad():
                s, d, _ = self._batch_loss(dict(params), x, y, None, one=True)
                val = s / torch.clamp(d, min=1e-12)
                gs = torch.autograd.grad(val, xs, allow_unused=True)
            with torch.no_grad():
                for v, g in zip(xs, gs):
                    if g is not None:  # an unused leaf's gradient is zero: v − η·0 = v
                        v.sub_(lr * g)
            total += val.detach().to(total.dtype)
        out = {n: v.detach().contiguous() for n, v in leaves.items()}
        return ({**theta, **{n: out[n] for n in theta if n in out}},
                {**w, **{n: out[n] for n in w if n in out}}, total)

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

    def _per_group(self, mode, kernel, single, cohort, theta, w, *args):
        """``map_clients`` over the cohort as ``mode`` groups it (a :class:`Vmap`: groups of
        ≤ max_examples / chunk clients): ``kernel`` (vmapped) or ``single`` (one client) on
        each group's rows."""
        k = len(cohort)
        theta_dims = self._theta_dims(theta, k)

        def part(fn):
            def call(pos):
                sl = slice(int(pos[0]), int(pos[-1]) + 1)
                return fn(cohort[sl], rows(theta, theta_dims, sl), rows(w, None, sl), *args)
            return call

        return map_clients(part(kernel), k, mode, per_client=self.chunk,
                           single=part(single))

    def _full_grad(self, cohort, theta, w, wrt, mode=None) -> Params:
        """∇_wrt f_m(θ, w_m) on each client's full training data, stacked ``[k, ...]``."""
        cohort = check_cohort(cohort, self.num_clients)
        mode = self.call_mode(mode)
        self._split_state(w)  # running statistics present (used in eval mode)
        acc, den = self._per_group(mode, self._full_grad_vmap, self._full_grad_one, cohort,
                                   theta, w, wrt)
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
            batches = chunk_batches(sizes, j, self.chunk)
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
        train, frozen, _, _ = self._arrange(row(theta, self._theta_dims(theta, 1), 0),
                                            row(w, None, 0), None, wrt)
        n_1 = int(store.sizes[cohort[0]])
        for j in range(0, n_1, self.chunk):
            bi = np.arange(j, min(n_1, j + self.chunk))
            xy = store.gather(int(cohort[0]), bi)
            g, d = self._scaled(self._plain_sum, train, frozen, *xy, None)
            for n in acc:
                acc[n][0] += g[n]
            den[0] += d
        return acc, den

    def _full_pass(self, cohort, theta, w, split, what, mode=None):
        """Forward-only sums over each client's data: loss (num, den) [+ metric counts]."""
        cohort = check_cohort(cohort, self.num_clients)
        mode = self.call_mode(mode)
        self._split_state(w)  # running statistics present (used in eval mode)
        with torch.no_grad():
            sums = self._per_group(mode, self._pass_vmap, self._pass_one, cohort, theta, w,
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
            batches = chunk_batches(sizes, j, self.chunk)
            idx, mask = store.padded(cohort, batches, max(len(b) for b in batches))
            sums += torch.stack(fn(params, *store.take(idx), mask)).to(self._acc)
        return sums.T

    def _pass_one(self, cohort, theta, w, store) -> Tensor:
        """:meth:`_pass_vmap` for one client, no padding."""
        sums = torch.zeros((4, 1), dtype=self._acc, device=self.device)
        params = {**row(theta, self._theta_dims(theta, 1), 0), **row(w, None, 0)}
        n_1 = int(store.sizes[cohort[0]])
        for j in range(0, n_1, self.chunk):
            bi = np.arange(j, min(n_1, j + self.chunk))
            res = self._forward_fn(params, *store.gather(int(cohort[0]), bi), None, True)
            sums[:, 0] += torch.stack(res).to(self._acc)
        return sums.T

