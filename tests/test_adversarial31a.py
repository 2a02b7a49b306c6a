"""Adversarial round 31a (issue 21, areas 2 and 5, tried again from scratch by someone who did
not write the fixes). Each test failed on the code it was written against (adv31a at
b9479e4) and passes since the fix.

* Area 5, text out of a node: ``kept_on_node`` wraps ``client_update``, the screen, the
  evaluation and (since round 30a) ``algorithm.init`` — but the ClientApp still evaluates
  client-side code outside it: the ``algorithm_factory(cfg, problem)`` that builds the
  node's algorithm on the node's problem (in ``node_runtime``), and the algorithm's
  declarations read after ``init`` (``shared_extra`` in ``train``). An exception raised
  there leaves the node as Flower's error reply with its text (w_m*'s bits).
* Area 2: one SuperNode's finite updates make θ non-finite; the in-process loop stops the
  run with a divergence warning, but the Flower report hides it (``stopped`` empty).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from partialfl.algorithms.wrapper import AlgorithmWrapper

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402


def _w_hex(problem, theta) -> str:
    """Client 7's personal optimum w_7* (a function of its data), first 4 coordinates."""
    w = np.asarray(next(iter(problem.w_star(np.asarray([7]), theta).values())),
                   dtype=np.float64).reshape(-1)
    return w[:4].tobytes().hex()


def _texts(grid, factory, rounds: int = 1) -> list[str]:
    """Every error text the ServerApp holds after a least-squares run on ``grid`` (2
    loopback SuperNodes and their ClientApp; the ServerApp's algorithm: ``factory``)."""
    from partialfl.flower.server import run_server

    got, text = [], ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rep = run_server(grid, ls_run(rounds), message_hook=got.append,
                             algorithm_factory=factory)
            text = " ".join(f.reason for f in rep.failures)
        except RuntimeError as e:  # no node described itself / the run aborted: fine
            text = str(e)
    return [str(m.error.reason) for m in got if m.has_error()] + [text]



def _plain(cfg, problem):
    from partialfl.build import build

    return build(cfg.run).algorithm


def test_an_error_of_the_algorithm_factory_on_a_node_stays_on_the_node(loopback):  # noqa: F811
    """2 loopback SuperNodes, least squares; the ClientApp's ``algorithm_factory(cfg,
    problem)`` — client-side code handed the node's problem — raises with the bits of
    w_7*. ``node_runtime`` calls it outside ``kept_on_node``: every describe reply is
    Flower's error reply ``ValueError: <hex of w_7*>``, which the ServerApp logs and quotes
    in its RuntimeError. Expected: as for ``algorithm.init`` (round 30a), the text stays in
    the node's log; the server learns where and what kind."""
    from partialfl.flower.client import make_client_app

    leaked: list[str] = []

    def factory(cfg, problem):
        alg = _plain(cfg, problem)
        leaked.append(_w_hex(problem, alg.init(problem, problem.init_theta(
            np.random.default_rng(0))).theta))
        raise ValueError(leaked[-1])

    texts = _texts(loopback(2, client_app=make_client_app(factory)), _plain)
    assert leaked
    found = [t for t in texts if any(c in t for c in leaked)]
    assert not found, f"{len(found)} texts the server holds carry w_7*: {found[0][:120]}"


class _LeakyDeclaration(AlgorithmWrapper):
    """The spec's algorithm; after ``init`` (on a node: its problem, its clients' data) its
    ``shared_extra`` declaration raises with the bits of w_7*."""

    def __init__(self, base, leaked: list) -> None:
        super().__init__(base)
        self.leaked, self.problem = leaked, None

    def init(self, problem, theta0):
        st = self.base.init(problem, theta0)
        self.problem, self.theta = problem, st.theta
        return st

    @property
    def shared_extra(self):
        if self.problem is not None and self.problem.num_clients and hasattr(
                self.problem, "w_star"):
            self.leaked.append(_w_hex(self.problem, self.theta))
            raise ValueError(self.leaked[-1])
        return ()

    @shared_extra.setter
    def shared_extra(self, value):
        pass


def test_an_error_of_an_algorithm_declaration_on_a_node_stays_on_the_node(
        loopback):  # noqa: F811
    """2 loopback SuperNodes, least squares, 1 round; the ClientApp's algorithm is the
    spec's wrapped so that its ``shared_extra`` declaration, read by ``train`` before
    ``client_update`` (outside ``kept_on_node``), raises with the bits of w_7*. Every train
    reply is Flower's error reply quoting them (the report's failures keep it). Expected:
    every piece of client-side code the node runs after it built the problem keeps its
    error text on the node."""
    from partialfl.flower.client import make_client_app

    leaked: list[str] = []
    app = make_client_app(lambda cfg, problem: _LeakyDeclaration(_plain(cfg, problem), leaked))
    texts = _texts(loopback(2, client_app=app), _plain)
    assert leaked
    found = [t for t in texts if any(c in t for c in leaked)]
    assert not found, f"{len(found)} texts the server holds carry w_7*: {found[0][:120]}"


def test_a_divergence_one_node_causes_is_not_hidden_by_the_flower_report(
        loopback):  # noqa: F811
    """Least squares (8 clients), FedAvg weighted by examples, 3 rounds, 2 loopback
    SuperNodes; partition 0 sends, every round, finite vectors of 1.7e308 with weights 200
    (each within its bound max(1, n_m) = 200: the reply passes every check). θ becomes
    non-finite after the second server step; the loop (``runtime.sync.run_rounds``) warns
    "the run diverged ..." and stops there, but ``flower.rounds.run_sync`` drops
    ``RunResult.diverged``: the report has θ = inf, ``aborted`` False, ``stopped`` "" ("ran
    all rounds") with 2 server steps of 3. Expected: the report (and its JSON) says why the
    run stopped early, as the in-process run does."""
    from flwr.app import Array, ArrayRecord

    from partialfl.flower.server import run_server

    def tamper(partition, mtype, content):
        if mtype == "train" and partition == 0:
            content["vectors"] = ArrayRecord({n: Array(np.full_like(a.numpy(), 1.7e308))
                                              for n, a in content["vectors"].items()})
            content["update"]["weights"] = [200.0] * len(content["update"]["weights"])

    spec = {"method": {"algorithm": "fedavg", "weighting": "examples"},
            "personalize": {"client": {"name": "gd", "tau": 5}}}
    from partialfl.flower.report import RunAborted

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rep = run_server(loopback(2, tamper=tamper), ls_run(3, spec=spec))
        except RunAborted as e:  # since round 36a the nodes refuse to send the non-finite
            # updates θ = ±1.7e308 gives: the run aborts, naming the node that grew θ
            assert "grew" in str(e) and "(partition 0)" in str(e), str(e)
            return
    finite = all(np.isfinite(v).all() for v in rep.theta.values())
    assert not finite and rep.server_steps < 3  # the attack worked: the run diverged
    assert rep.aborted or rep.stopped, (
        f"θ is not finite after {rep.server_steps} of 3 server steps, yet the report says "
        f"aborted={rep.aborted}, stopped={rep.stopped!r}")
