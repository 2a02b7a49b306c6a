"""The plain-autograd client step (the sequential path) equals the functorch one bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _nn_toy import one_thread, toy_data, toy_model

from partialfl.problems.model import ModelProblem
from partialfl.split import make_split


@pytest.mark.parametrize("kind,wrt", [("none", "theta"), ("output", "w"), ("input", "theta"),
                                      ("adapter", "both")])
def test_plain_autograd_step_equals_functorch(kind, wrt):
    with one_thread():
        pb = ModelProblem(make_split(toy_model(0), kind, seed=0), toy_data(), vectorize=False)
        theta = pb.init_theta()
        w = {n: v[0] + 0.1 for n, v in pb.init_w(np.array([3]), "random", 0, 0).items()}
        train, frozen, _, _ = pb._arrange(theta, w, None, wrt)
        x, y = pb._store["train"].gather(3, np.arange(5))
        mask = torch.ones(5)
        # the step functions also take (and return) running statistics: none here
        for plain, ref, stats in ((pb._plain_step, pb._step_fn, ({},)),
                                  (pb._plain_sum, pb._sum_grad_fn, ())):
            g, aux = plain(train, frozen, *stats, x, y, mask, None)
            g_ref, aux_ref = ref(train, frozen, *stats, x, y, mask, None)
            if stats:
                assert aux[1] == aux_ref[1] == {}
                aux, aux_ref = aux[0], aux_ref[0]
            assert g.keys() == g_ref.keys()
            assert all(torch.equal(g[n], g_ref[n]) for n in g) and torch.equal(aux, aux_ref)
            assert any(float(v.abs().max()) > 0 for v in g.values())
        # one client alone gives the same row as inside a cohort
        batches = [np.array([0, 2]), np.array([1, 4, 3])]
        cohort = np.array([0, 3])
        g2, l2 = pb.minibatch_grads(cohort, theta, {n: torch.stack([v, v]) for n, v in
                                                    w.items()}, batches, wrt)
        g1, l1 = pb.minibatch_grads(cohort[1:], theta, {n: v[None] for n, v in w.items()},
                                    batches[1:], wrt)
        assert all(torch.equal(g1[n][0], g2[n][1]) for n in g1) and torch.equal(l1[0], l2[1])
