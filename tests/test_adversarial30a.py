"""Adversarial round 30a (issue 21, areas 2 and 5, tried from scratch by someone who did not
write the fixes). Each test failed on the code it was written against (adv30a at 5ab5485)
and passes since the fix.

* SecAgg+ (area 2, and area 5's weight channel): a node's SecAgg+ contribution weighs its
  clients by the weights they return, unbounded — ``node_contribution`` never applies the
  ``0 <= w_m <= max(1, n_m)`` bound that ``decode_updates`` applies to a plain train reply,
  and ``check_reply`` does not compare the reply's clear ``fitres.num_examples`` with the
  example counts the node declared. One client returning a weight of 1e6 (its node declared
  200 examples) makes its node outweigh every other node in the round's aggregate, with no
  failure counted; the weight reaches the ServerApp in clear as ``num_examples`` (52 bits of
  the client's w_m* per round in the attack script).
* Node setup (area 5): ``node_runtime`` calls ``algorithm.init(problem, θ⁰)`` on the node's
  problem (its clients' data) outside ``kept_on_node``; an exception raised there leaves the
  node as Flower's error reply with its text, which the ServerApp logs and puts in the
  RuntimeError of a run no node could describe itself for.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.types import ClientUpdates

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402

FEDAVG = {"method": {"algorithm": "fedavg", "weighting": "examples"},
          "personalize": {"client": {"name": "gd", "tau": 5}}}


class _HeavyClient(AlgorithmWrapper):
    """The spec's algorithm whose cohort's first client returns weight ``heavy`` when it is
    client 7 (on the last of 3 SuperNodes); ``mean_only``: its server step is its base's."""

    mean_only = True

    def __init__(self, base, heavy: float | None) -> None:
        super().__init__(base)
        self.heavy = heavy

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u = res.updates
        w = np.asarray(u.weights, dtype=np.float64).copy()
        if self.heavy is not None and 7 in list(np.asarray(cohort)):
            w[list(np.asarray(cohort)).index(7)] = self.heavy
        return ClientResult(ClientUpdates(u.vectors, w, u.cohort, u.grad_evals, u.metrics,
                                          u.extra), res.client_state)


def _secagg_theta(loopback, heavy):  # noqa: F811
    from partialfl.aggregation.basic import Mean
    from partialfl.build import build
    from partialfl.flower.client import make_client_app
    from partialfl.flower.server import run_server

    def factory(cfg, problem):
        base = build(cfg.run).algorithm
        base.aggregator = Mean(weighted=True)  # weight each client by its example count
        return _HeavyClient(base, heavy)

    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = run_server(loopback(3, client_app=make_client_app(factory)),
                         ls_run(1, None, spec=FEDAVG, secagg=True, secagg_clip=64.0),
                         message_hook=got.append, algorithm_factory=factory)
    sent = [int(m.content["fitres.num_examples"]["num_examples"]) for m in got
            if not m.has_error() and "fitres.num_examples" in m.content]
    return rep, np.asarray(next(iter(rep.theta.values())), dtype=np.float64), sent


def test_one_client_weight_does_not_let_its_node_outweigh_the_others_under_secagg(
        loopback):  # noqa: F811
    """Least squares (8 clients of 200 examples, FedAvg weighted by examples) on 3 loopback
    SuperNodes, one SecAgg+ round over every client. Honest: every node's weight is
    ≤ 200 · its clients. With client 7 returning weight 1e6 its node sends
    ``num_examples`` ≈ 1e6 (the server declared total is 1600), nothing is counted as a
    failure, and θ after the round moves far beyond SecAgg+'s quantisation error from the
    honest θ. Expected: the client's weight bounded by max(1, n_m) (as a plain train reply
    is), or the node's reply refused as a counted failure."""
    _, honest, sent_honest = _secagg_theta(loopback, None)
    rep, attacked, sent = _secagg_theta(loopback, 1e6)
    assert max(sent_honest) <= 3 * 200
    # the heavy client's node counted as failed (it drops out of the SecAgg+ round)
    refused = [f for f in rep.failures if 7 in f.clients or f.partition == 2]
    assert refused or max(sent) <= 3 * 200, \
        f"a node sent num_examples {max(sent)} (declared ≤ 600) and nothing was refused"
    assert refused or np.abs(attacked - honest).max() < 1e-3, \
        f"θ moved by {np.abs(attacked - honest).max():g}"


class _LeakyInit(AlgorithmWrapper):
    """On a SuperNode: ``init`` reads client 7's personal optimum w_7* (the node's problem
    holds its data) and raises with its bits."""

    def __init__(self, base, leaked: list) -> None:
        super().__init__(base)
        self.leaked = leaked

    def init(self, problem, theta0):
        st = self.base.init(problem, theta0)
        w = np.asarray(next(iter(problem.w_star(np.asarray([7]), st.theta).values())),
                       dtype=np.float64).reshape(-1)
        self.leaked.append(w[:4].tobytes().hex())
        raise ValueError(self.leaked[-1])


def test_an_error_of_algorithm_init_on_a_node_stays_on_the_node(loopback):  # noqa: F811
    """2 loopback SuperNodes, least squares; the ClientApp's algorithm factory wraps the
    spec's algorithm in :class:`_LeakyInit` (the server's is the plain one). Every describe
    reply is Flower's error reply ``ValueError: <hex of w_7*>``: the ServerApp logs it
    ("did not describe itself (...)") and raises RuntimeError quoting it. Expected: as for
    ``client_update``, the text stays in the node's log; the server learns where and what
    kind."""
    from partialfl.build import build
    from partialfl.flower.client import make_client_app
    from partialfl.flower.server import run_server

    leaked: list[str] = []
    app = make_client_app(lambda cfg, problem: _LeakyInit(build(cfg.run).algorithm, leaked))
    got = []
    text = ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run_server(loopback(2, client_app=app), ls_run(1), message_hook=got.append,
                       algorithm_factory=lambda cfg, problem: build(cfg.run).algorithm)
        except RuntimeError as e:  # no node described itself: fine
            text = str(e)
    assert leaked
    errors = [str(m.error.reason) for m in got if m.has_error()] + [text]
    found = [t for t in errors if any(c in t for c in leaked)]
    assert not found, f"{len(found)} texts the server holds carry w_7*: {found[0][:120]}"
