"""Adversarial round 40a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes). Each test failed on the code it was written against (adv40a at
14c911d) because of the defect it names, and passes since the fix: ``privacy.values_only``
rebuilds every tree in θ's order (other names sorted) in the simulator's message path, and
``runtime.clients.checked`` puts a result's rows in the asked cohort's order.

* Area 5, privacy by value in process: the *order* of a message's containers. What reaches
  ``server_update`` is :func:`partialfl.privacy.server_view` of
  :func:`~partialfl.privacy.values_only` of the client's :class:`ClientUpdates`, which
  rebuilds every tree with a dict comprehension over the *client's* dict — so the order of
  the leaves of ``vectors`` (and of ``extra`` trees and server metrics) is the order the
  client's code chose. θ with L leaves gives log2(L!) free bits per message (a ToyNet body
  of 8 leaves: 15 bits; a ResNet-18 body of 62 leaves: ≈ 280 bits), every round, a function
  of anything the client holds, its personal w_m included; the screen
  (:func:`~partialfl.privacy.screen`) compares names as sets only. Flower's wire has no such
  channel: ``codec._tree`` rebuilds each tree in θ's order.
  Likewise the *order of the client ids*: in process a client computation's result must name
  a subset of the asked clients, each at most once (``runtime.clients.checked``), in any
  order, and ``server_view`` keeps that order (rows permuted with it) — a cohort of k
  clients computed together gives log2(k!) bits; the Flower server refuses a reply whose ids
  are not exactly the asked ones in order (round 35a).
  Suspected root cause: ``privacy.server_view`` / ``values_only`` (or ``faults.receive``)
  keep the client's container order instead of rebuilding trees in θ's order (and rows in
  the asked cohort's order), as the Flower decoder does.

Tried and held (not tested here): area 5 — Flower's wire for the same order channels (the
server's ``codec._tree`` rebuilds trees in θ's order, ``rounds.merge`` sorts rows by id, the
node sends the asked ids); server metrics' and extras' order on the wire (fixed names); the
node's evaluation (always over all its own clients, the server cannot choose a subset to
difference); area 2 (read) — replies matched by message id, Fortran-ordered or byte-swapped
arrays (refused by dtype, or canonical on the node's ``ascontiguousarray``); area 6 (read) —
the only code a spec names is ``model.name`` with ``:`` and ``plugins`` (data sources unpickle
nothing, ``hf-disk`` reads arrow files, pretrained ResNet weights load with
``weights_only=True``, ``init-from`` is ``.npz`` read without pickles).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.types import ClientUpdates


class _Spy(AlgorithmWrapper):
    """Records the leaf order and client-id order of every message ``server_update`` gets."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.orders: list[tuple[str, ...]] = []
        self.ids: list[list[int]] = []

    def server_update(self, state, updates, ctx):
        self.orders.append(tuple(updates.vectors))
        self.ids.append([int(c) for c in np.asarray(updates.cohort)])
        return self.base.server_update(state, updates, ctx)


def _bit(values) -> int:
    """One bit of a client's personal value (the lowest mantissa bit of its first entry, in
    its own dtype)."""
    x = np.ascontiguousarray(np.asarray(values).reshape(-1)[:1])
    return int(x.view(np.dtype(f"u{x.itemsize}"))[0] & 1)


class _OrderLeak(AlgorithmWrapper):
    """An honest update, its leaves listed in θ's order or reversed, by one bit of the first
    client's personal gradient (its data at its personal head w_m)."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.leaked: list[int] = []

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u = res.updates
        w = problem.init_w(cohort, "pretrained", 0, 0)  # the personal head's gradient on its data
        g = next(iter(problem.grad_w(cohort, state.theta, w).values()))
        bit = _bit(g.detach().cpu().numpy())
        self.leaked.append(bit)
        names = list(u.vectors)
        vectors = {n: u.vectors[n] for n in (names[::-1] if bit else names)}
        return ClientResult(ClientUpdates(vectors, u.weights, u.cohort, u.grad_evals,
                                          u.metrics, u.extra), res.client_state)


@pytest.mark.parametrize("runner", ["sync", "async"])
def test_the_order_of_a_messages_leaves_carries_nothing_of_w(runner):
    """A ToyNet (θ: its 8 body leaves, the output layer personal), FedAvg-style FFGG in
    process; a leaky client lists its update's leaves in θ's order or reversed, by one bit of
    its personal w_m. Found: ``server_update`` receives the leaves in the client's order,
    which follows that bit. Expected: values only — every message reaches the server with
    its leaves in θ's order."""
    from _nn_toy import one_thread, toy_data, toy_model

    from partialfl.algorithms.ffgg import FFGG
    from partialfl.build import make_solver
    from partialfl.problems.model import ModelProblem
    from partialfl.runtime import run_rounds
    from partialfl.runtime.asynchronous import run_async
    from partialfl.server import SGD
    from partialfl.split import make_split

    p = ModelProblem(make_split(toy_model(0), "output"), toy_data(4), vectorize=False)
    leak = _OrderLeak(FFGG(make_solver("gd", tau=1, lr=0.05), SGD(lr=0.05)))
    spy = _Spy(leak)
    with warnings.catch_warnings(), one_thread():
        warnings.simplefilter("ignore")
        if runner == "sync":
            run_rounds(p, spy, 6, clients_per_round=1, seed=0)
        else:
            run_async(p, spy, steps=6, concurrency=2, seed=0)
    theta_order = tuple(p.init_theta())
    assert spy.orders and 1 in leak.leaked
    assert set(spy.orders) == {theta_order}, (
        f"server_update received the leaves in {len(set(spy.orders))} orders, following the "
        f"clients' bits {leak.leaked}")


class _IdOrderLeak(AlgorithmWrapper):
    """An honest update for a cohort of clients, its rows (ids with them) in the asked order
    or reversed, by one bit of the first client's personal optimum w_m*."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.leaked: list[int] = []
        self.asked: list[list[int]] = []

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        self.asked.append([int(c) for c in cohort])
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u = res.updates
        w = next(iter(problem.w_star(cohort, state.theta).values()))
        bit = _bit(w) if len(cohort) > 1 else 0
        self.leaked.append(bit)
        if not bit:
            return res
        rev = np.arange(len(cohort))[::-1].copy()
        cs = None if res.client_state is None else {n: v[rev] for n, v in
                                                    res.client_state.items()}
        return ClientResult(ClientUpdates(
            {n: v[rev] for n, v in u.vectors.items()}, np.asarray(u.weights)[rev],
            np.asarray(u.cohort)[rev], u.grad_evals,
            {n: np.asarray(v)[rev] for n, v in u.metrics.items()},
            {e: {n: v[rev] for n, v in t.items()} for e, t in u.extra.items()}), cs)


def test_the_order_of_a_messages_client_ids_carries_nothing_of_w():
    """Least squares in process, FFGG, 3 clients per round computed together; a leaky client
    computation returns its rows (and ids) in the asked order or reversed, by one bit of its
    first client's w_m*. Found: ``server_update`` receives the ids in the reversed order in
    exactly the rounds whose bit is 1. Expected: the ids in one canonical order (the asked
    cohort's), whatever the client computation returned."""
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.build import make_solver
    from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
    from partialfl.runtime import run_rounds
    from partialfl.server import SGD

    p = LeastSquaresProblem(LeastSquaresSpec(num_clients=6, n=20, d_theta=3, d_w=2, seed=0))
    leak = _IdOrderLeak(FFGG(make_solver("cg", tau=3), SGD(lr=1 / p.L)))
    spy = _Spy(leak)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_rounds(p, spy, 8, clients_per_round=3, seed=0)
    assert spy.ids and 1 in leak.leaked and len(spy.ids) == len(leak.asked)
    assert spy.ids == leak.asked, (
        f"server_update received the ids {spy.ids}, asked {leak.asked}: reversed exactly where "
        f"the client's bit {leak.leaked} is 1")
