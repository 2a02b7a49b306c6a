"""One client's passes bind θ and w into the module directly (``kernels.call_with``) instead
of ``torch.func.functional_call`` (which re-derives the module's structure on every call):
the same outputs, gradients and running statistics bit for bit, tied weights bound together,
the module's own tensors restored (also when the forward raises), and modules with
parametrizations left to ``functional_call``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from partialfl.problems.model.kernels import call_with, member_slots


class Tied(nn.Module):
    """A shared Linear reached under two paths, a BatchNorm and a tied output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.again = self.inp  # the same module twice
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 6, bias=False)
        self.out.weight = self.inp.weight  # a tied weight

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.again(self.inp(x)))))


def _params(m, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) if t.is_floating_point() else t.clone()
            for n, t in [*m.named_parameters(), *m.named_buffers()]}


def test_call_with_equals_functional_call_bit_for_bit():
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    outs = []
    for binder in ("call_with", "functional_call"):
        torch.manual_seed(0)
        m = Tied().train()
        own = {n: t for n, t in [*m.named_parameters(), *m.named_buffers()]}
        p = _params(m, 1)
        leaves = {n: v.requires_grad_(True) for n, v in p.items() if v.is_floating_point()
                  and "running" not in n}
        if binder == "call_with":
            slots = member_slots(m)
            assert set(slots) == set(own) and len(slots["inp.weight"]) == 2  # inp, out
            y = call_with(m, slots, p, x)
            # the module's own tensors are back, the tied alias included (functional_call
            # itself leaves this module's tie broken, so it is checked here only)
            now = dict([*m.named_parameters(), *m.named_buffers()])
            assert set(now) == set(own) and all(now[n] is own[n] for n in own)
            assert m.out.weight is m.inp.weight
        else:
            y = functional_call(m, p, (x,))
        g = torch.autograd.grad(y.square().sum(), list(leaves.values()))
        outs.append((y.detach(), g, p["bn.running_mean"].clone(), p["bn.num_batches_tracked"]))
    (y1, g1, r1, n1), (y2, g2, r2, n2) = outs
    assert torch.equal(y1, y2) and torch.equal(r1, r2) and int(n1) == int(n2) == 1
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_the_module_is_restored_when_the_forward_raises():
    m = nn.Linear(3, 2)
    w = m.weight
    with pytest.raises(RuntimeError):
        call_with(m, member_slots(m), {"weight": torch.zeros(2, 3)}, torch.zeros(4, 5))
    assert m.weight is w


def test_a_parametrized_module_is_left_to_functional_call():
    from torch.nn.utils import parametrize

    class Sym(nn.Module):
        def forward(self, x):
            return x.triu() + x.triu(1).transpose(-1, -2)

    m = nn.Sequential(nn.Linear(3, 3))
    parametrize.register_parametrization(m[0], "weight", Sym())
    assert member_slots(m) is None


def test_a_model_problem_uses_it_for_one_client_and_matches_vmap():
    """The one-client path (bound directly) and the vmapped path (functional_call) give the
    same gradients to float tolerance, as before."""
    from _nn_toy import toy_data, toy_model

    from partialfl.problems.model import ModelProblem
    from partialfl.split import make_split

    data = toy_data()
    one = ModelProblem(make_split(toy_model(0), "output"), data, vectorize=False)
    many = ModelProblem(make_split(toy_model(0), "output"), data, vectorize=True)
    assert one._slots is not None
    theta, w = one.init_theta(), one.init_w([0, 1, 2], "pretrained", 0, 0)
    batches = [torch.arange(4).numpy()] * 3
    ga, la = one.minibatch_grads([0, 1, 2], theta, w, batches, "both")
    gb, lb = many.minibatch_grads([0, 1, 2], theta, w, batches, "both")
    assert torch.allclose(la, lb, atol=1e-6)
    assert all(torch.allclose(ga[n], gb[n], atol=1e-5) for n in ga)
