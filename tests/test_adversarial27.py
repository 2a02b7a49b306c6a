"""Adversarial round 27 (issue 21, tried again from scratch): the defects found.

Each test failed on the code it was written against (bef6f52) because of the defect it names,
and passes since the fix."""

from __future__ import annotations

import numpy as np
import pytest

from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.ffgg import FFGG
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.build import make_solver
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.runtime import run_rounds
from partialfl.server import SGD
from partialfl.types import ClientUpdates


class _Spy(AlgorithmWrapper):
    """Records every message ``server_update`` receives."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.seen: list[ClientUpdates] = []

    def server_update(self, state, updates, ctx):
        self.seen.append(updates)
        return self.base.server_update(state, updates, ctx)


class _Tagged(np.ndarray):
    """An ndarray subclass that can carry attributes."""


class _TaggedInt(int):
    """An int subclass that can carry attributes."""


class _Leaky(AlgorithmWrapper):
    """A client that hides its personal optimum w_m* (a function of its own data) in a
    message whose values, names, shapes and dtypes all pass the privacy screen."""

    def __init__(self, base, how: str) -> None:
        super().__init__(base)
        self.how, self.leaked = how, []

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u, k = res.updates, len(cohort)
        w = np.asarray(next(iter(problem.w_star(cohort, state.theta).values())),
                       dtype=np.float64).reshape(k, -1)
        self.leaked.append(w.copy())
        vectors, weights, ids, ge = dict(u.vectors), u.weights, u.cohort, u.grad_evals
        n = next(iter(vectors))
        v = np.asarray(vectors[n])
        if self.how == "vector-view":  # θ-shaped rows: a view of [update | w]
            vectors[n] = np.concatenate([v, w], 1)[:, :v.shape[1]]
        elif self.how == "weights-view":  # the weights: a view of [weights | w]
            weights = np.concatenate([np.asarray(weights, np.float64)[:, None], w], 1)[:, 0]
        elif self.how == "weights-subclass":
            weights = np.asarray(weights, np.float64).view(_Tagged)
            weights.secret = w
        elif self.how == "cohort-subclass":
            ids = np.asarray(ids).view(_Tagged)
            ids.secret = w
        elif self.how == "grad-evals-subclass":
            ge = _TaggedInt(ge)
            ge.secret = w
        return ClientResult(ClientUpdates(vectors, weights, ids, ge, u.metrics, u.extra),
                            res.client_state)


def _carries(obj, w: np.ndarray, depth: int = 0) -> bool:
    """Whether ``obj``, the array it is a view of, or an attribute attached to it holds a row
    of ``w`` as consecutive numbers."""
    if depth > 3:
        return False
    if isinstance(obj, np.ndarray):
        if obj.base is not None and _carries(obj.base, w, depth + 1):
            return True
        if obj.dtype.kind == "f" and obj.size >= w.shape[1]:
            win = np.lib.stride_tricks.sliding_window_view(
                np.asarray(obj, np.float64).reshape(-1), w.shape[1])
            if any(np.isclose(win, r, rtol=1e-9, atol=0).all(1).any() for r in w):
                return True
    return any(_carries(x, w, depth + 1) for x in getattr(obj, "__dict__", {}).values())


def _received(how: str, runner) -> tuple[int, int]:
    p = LeastSquaresProblem(LeastSquaresSpec(num_clients=4, n=20, d_theta=3, d_w=2, seed=0))
    leaky = _Leaky(FFGG(make_solver("cg", tau=3), SGD(lr=1 / p.L)), how)
    spy = _Spy(leaky)
    runner(p, spy)
    w = np.concatenate(leaky.leaked)
    hits = sum(_carries(o, w) for u in spy.seen
               for o in [*u.vectors.values(), u.weights, u.cohort, u.grad_evals])
    return len(spy.seen), hits


def _sync(p, alg):
    run_rounds(p, alg, 2, clients_per_round=2, seed=0)


def _async(p, alg):
    from partialfl.runtime.asynchronous import run_async

    run_async(p, alg, steps=3, concurrency=2, seed=0)


def test_the_spy_sees_no_w_from_an_honest_client():
    """The control: the detector finds nothing in an honest FFGG run's messages."""
    seen, hits = _received("none", _sync)
    assert seen == 2 and hits == 0


@pytest.mark.parametrize("runner", [_sync, _async], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["vector-view", "weights-view", "weights-subclass",
                                 "cohort-subclass", "grad-evals-subclass"])
def test_a_personal_value_never_reaches_server_update_through_an_object(how, runner):
    """Least squares, FFGG, in process (sequential; also the asynchronous runtime): a client
    returns a message every field of which passes ``privacy.screen`` (θ-shaped float rows,
    one float weight and one integer id per client, one integer ``grad_evals``), but (a) its
    θ rows are a *view* of ``[update | w_m*]``, (b) its weights a view of ``[weights |
    w_m*]``, (c)/(d) its weights / cohort an ndarray subclass with ``w_m*`` attached as an
    attribute, (e) its ``grad_evals`` an ``int`` subclass with ``w_m*`` attached. A spy on
    ``server_update`` finds w_m*'s values in every message (``updates.vectors[n].base``,
    ``updates.weights.base``, ``updates.weights.secret``, ``updates.cohort.secret``,
    ``updates.grad_evals.secret``). Root cause: ``privacy.server_view`` passes ``weights``,
    ``cohort`` and ``grad_evals`` through as the client's objects, and ``arrays.plain``
    (which it applies to the rows, to strip subclasses and attributes — its docstring:
    "only the values") returns a view that keeps the client's whole buffer as ``.base``.
    Expected: the server receives values only — fresh plain arrays (a copy of the rows, or
    at least no base holding more than the row), ``int(grad_evals)``."""
    seen, hits = _received(how, runner)
    assert seen >= 1
    assert hits == 0, f"{hits} objects server_update received carry a client's w_m*"
