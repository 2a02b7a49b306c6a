"""Adversarial round 32a (issue 21, areas 2 and 5, tried again from scratch by someone who did
not write the fixes). Each test failed on the code it was written against (adv32a at
8af09d0) because of the defect it names, and passes since the fix.

* Area 5, text out of a node: ``flower.node.kept_on_node`` keeps a client computation's
  error *message* on the node, but still reads the exception's *type*, which the client's
  code chose: the type's ``__name__`` goes to the server whenever the type claims
  ``__module__ == "builtins"`` (any class can), and the type's metaclass runs in the
  ``except`` clause (``{...}.get(t)`` hashes it, ``t.__module__`` / ``t.__name__`` read it):
  an exception raised there leaves the node with its text. Either way w_m*'s bits reach the
  ServerApp (its log, the report's failures).
* Area 5, text out of a node (SecAgg+): ``flower.secagg.node_contribution`` sums the
  client metrics with ``codec.aggregate_metrics`` *after* its ``kept_on_node`` block; the
  PrivacyError it raises quotes the metric's name (a client-chosen key, declared by the
  algorithm so the screen let it pass) in the node's error reply. The plain train path
  encodes inside ``kept_on_node`` and holds.
* Area 2 (SecAgg+): ``node_contribution`` averages non-finite client updates (faults: the
  privacy screen lets them pass so the runtime can skip them) into the node's masked
  contribution; Flower's ``secaggplus_mod`` quantises NaN/inf into integers and the server
  applies a finite, wrong aggregate with no failure counted — where the plain path refuses
  the reply (a counted failure) and in process the row is skipped.
* Area 2: an honest SuperNode holding a client without training examples (a ``folder``
  data set may have one; the loader accepts it, in process the run trains every other
  client) sends its cohort's ``train_loss.sum`` as NaN — local SGD's "not computed", which
  the privacy screen allows — and the codec (``decode_metrics``) refuses the whole reply:
  the node's every client update is lost, every round.
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


def _plain(cfg, problem):
    from partialfl.build import build

    return build(cfg.run).algorithm


def _w_hex(problem, theta, client: int) -> str:
    """Client ``client``'s personal optimum w* (a function of its data), first 4
    coordinates as the hex of their float64 bytes."""
    w = np.asarray(next(iter(problem.w_star(np.asarray([client]), theta).values())),
                   dtype=np.float64).reshape(-1)
    return w[:4].tobytes().hex()


class _HashLeak(type):
    """A metaclass whose hash raises with the text its class was given."""

    def __hash__(cls):
        raise ValueError(cls.secret)


def _named(secret: str) -> type:
    """An exception type named by w's bits, claiming to be Python's own."""
    return type("w" + secret, (Exception,), {"__module__": "builtins"})


def _hashing(secret: str) -> type:
    """An exception type whose metaclass raises with w's bits when the type is hashed."""
    return _HashLeak("E", (Exception,), {"secret": secret})


class _Raising(AlgorithmWrapper):
    """The spec's algorithm whose ``client_update`` raises an exception *type* built from
    the bits of its first client's w* (the message says nothing)."""

    def __init__(self, base, make, leaked: list) -> None:
        super().__init__(base)
        self.make, self.leaked = make, leaked

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        self.leaked.append(_w_hex(problem, state.theta, int(cohort[0])))
        raise self.make(self.leaked[-1])("nothing to see here")


@pytest.mark.parametrize("make", [_named, _hashing], ids=["type-name", "metaclass"])
def test_the_type_of_a_client_error_carries_nothing_of_w_to_the_server(
        loopback, make):  # noqa: F811
    """2 loopback SuperNodes, least squares, 1 round; the ClientApp's algorithm raises, in
    ``client_update``, an exception whose type (not its message) is built from the bits of
    its client's w*: named ``w<hex>`` with ``__module__ = "builtins"`` (``kept_on_node``
    sends ``t.__name__`` for Python's own types), or with a metaclass whose ``__hash__``
    raises ``ValueError(<hex>)`` (``kept_on_node`` hashes the type in its ``except``
    clause; the ValueError leaves the node as Flower's error reply). Expected: the error the
    server receives says where and what kind — never a name or text the client's code
    chose."""
    from partialfl.flower.client import make_client_app
    from partialfl.flower.server import run_server

    leaked: list[str] = []
    app = make_client_app(lambda cfg, problem: _Raising(_plain(cfg, problem), make, leaked))
    got, texts = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rep = run_server(loopback(2, client_app=app), ls_run(1), message_hook=got.append,
                             algorithm_factory=_plain)
            texts = [f.reason for f in rep.failures]
        except RuntimeError as e:  # every update failed: the run aborted — fine
            texts = [str(e)]
    texts += [str(m.error.reason) for m in got if m.has_error()]
    assert leaked
    found = [t for t in texts if any(s in t for s in leaked)]
    assert not found, f"{len(found)} texts the server holds carry w*: {found[0][:160]}"


def test_a_client_without_training_examples_does_not_lose_its_nodes_updates(
        loopback, tmp_path):  # noqa: F811
    """A ``folder`` data set of 4 clients (28×28 inputs, emnist_cnn, FFGG, 2 rounds), client
    1 with test examples only (the loader accepts it; in process every round trains the
    others, ``clients_failed`` 0). On 2 honest loopback SuperNodes, partition 0 (clients 0
    and 1) sends ``train_loss.sum = nan`` (client 1's loss: no local step) and the server
    refuses its reply as ``invalid`` ("reply metric 'train_loss.sum' must be finite, got
    nan"): client 0's update is lost too, every round. Expected: no failure — a client
    without a local step is left out of the loss sum and count (or its update sent without
    a loss), as in process."""
    from partialfl.flower.server import run_server

    rng = np.random.default_rng(0)
    for i in range(4):
        n = 0 if i == 1 else 6
        np.savez(tmp_path / f"c{i}.npz", train_x=rng.random((n, 28, 28)).astype(np.float32),
                 train_y=rng.integers(0, 3, n),
                 test_x=rng.random((3, 28, 28)).astype(np.float32),
                 test_y=rng.integers(0, 3, 3))
    spec = {"seed": 1, "model": {"name": "emnist_cnn"},
            "data": {"source": "folder", "path": str(tmp_path)},
            "method": {"algorithm": "ffgg"}, "pretrain": {"rounds": 0},
            "personalize": {"rounds": 2, "eval_every": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = run_server(loopback(2), {"spec": spec, "stage": "personalize"})
    assert rep.server_steps == 2
    assert not rep.failures, [f"{f.kind}: {f.reason}" for f in rep.failures]


def test_non_finite_client_updates_are_never_applied_silently_under_secagg(
        loopback):  # noqa: F811
    """Two cases, least squares (8 clients), one round on 3 loopback SuperNodes.

    (a) The same spec on the server and honest nodes: FedAvg, local GD with lr 0.15 for 3000
    steps (every client's local iterate overflows: its update is not finite), server lr
    0.001. Without SecAgg+ every reply is refused as ``invalid`` ("reply is not finite
    ...") and the run aborts (max-failure-fraction). With SecAgg+ nothing is counted: the
    unmasked aggregate of the quantised NaN/inf contributions is finite and θ moves (to
    ~0.19 in every coordinate from θ⁰ = 0).

    (b) FFGG; on the nodes the algorithm is wrapped in ``FaultInjector(at={(0, 7): "nan"})``
    (one faulty client). Without SecAgg+ the server refuses partition 2's reply ("reply is
    not finite for clients [7]"), a counted failure; in process the row is skipped as a
    fault. With SecAgg+ no failure is counted and θ after the round is thousands away from
    the honest run's (the quantisation error is ~1e-5).

    ``node_contribution`` averages the screened rows into ``p_i`` without the finiteness
    check the server applies to a plain reply, and Flower's ``secaggplus_mod`` quantises
    NaN/inf into integers. Expected: the node skips non-finite clients (or its contribution
    is refused as a counted failure); they are never applied."""
    from partialfl.flower.client import make_client_app
    from partialfl.flower.report import RunAborted
    from partialfl.flower.server import run_server
    from partialfl.runtime.faults import FaultInjector

    spec = {"method": {"algorithm": "fedavg"}, "personalize": {
        "client": {"name": "gd", "tau": 3000, "lr": 0.15}, "server": {"lr": 0.001}}}
    secagg = {"secagg": True, "secagg_clip": 64.0}
    faulty = make_client_app(lambda cfg, problem: FaultInjector(
        _plain(cfg, problem), at={(0, 7): "nan"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RunAborted, match="failed"):  # (a) plain: every reply refused
            # (by the nodes since round 36a: they send no non-finite update)
            run_server(loopback(3), ls_run(1, spec=spec))
        try:
            diverged = run_server(loopback(3), ls_run(1, spec=spec, **secagg))
            applied = not (diverged.failures or diverged.skipped_rounds)
        except RunAborted:
            applied = False  # counted: fine
        honest = run_server(loopback(3), ls_run(1, **secagg))
        rep = run_server(loopback(3, client_app=faulty), ls_run(1, **secagg),
                         algorithm_factory=_plain)
    moved = max(float(np.abs(rep.theta[n] - honest.theta[n]).max()) for n in rep.theta)
    counted = [f for f in rep.failures if 7 in f.clients or f.partition == 2]
    assert not applied, "(a) diverged updates were applied under SecAgg+, no failure counted"
    assert counted or moved < 1.0, (
        f"(b) θ moved by {moved:g} from the honest run's and no failure was counted")


class _DeclaredName(AlgorithmWrapper):
    """The spec's algorithm whose clients report, besides their update, a metric named by
    the bits of their first client's w* — a name it declares (``client_metrics``), so the
    privacy screen lets it pass; its value is 0."""

    def __init__(self, base, leaked: list) -> None:
        super().__init__(base)
        self.leaked, self.names = leaked, ()

    @property
    def client_metrics(self):
        return self.names

    @client_metrics.setter
    def client_metrics(self, value):
        pass

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        self.leaked.append("w" + _w_hex(problem, state.theta, int(cohort[0])))
        self.names = (self.leaked[-1],)
        res.updates.metrics[self.leaked[-1]] = np.zeros(len(cohort))
        return res


def test_a_secagg_contribution_error_stays_on_the_node(loopback):  # noqa: F811
    """Least squares, FFGG, one SecAgg+ round on 3 loopback SuperNodes; the ClientApp's
    algorithm reports a metric named ``w<hex of w*>``, declared in its ``client_metrics``
    (the screen lets it pass). Without SecAgg+ ``encode_updates`` refuses it inside
    ``kept_on_node``: the server learns "client_update failed on the node (an exception)".
    With SecAgg+ ``node_contribution`` sums the metrics with ``aggregate_metrics`` after the
    ``kept_on_node`` block: its ``PrivacyError: refusing to send metric 'w<hex>' ...``
    leaves the node as Flower's error reply (the ServerApp's message hook holds it).
    Expected: as on the plain path, the text stays in the node's log."""
    from partialfl.flower.client import make_client_app
    from partialfl.flower.server import run_server

    leaked: list[str] = []
    app = make_client_app(lambda cfg, problem: _DeclaredName(_plain(cfg, problem), leaked))
    got, texts = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rep = run_server(loopback(3, client_app=app), ls_run(1, secagg=True,
                                                                  secagg_clip=64.0),
                             message_hook=got.append, algorithm_factory=_plain)
            texts = [f.reason for f in rep.failures]
        except RuntimeError as e:  # every node dropped out: the run aborted — fine
            texts = [str(e)]
    texts += [str(m.error.reason) for m in got if m.has_error()]
    assert leaked
    found = [t for t in texts if any(s in t for s in leaked)]
    assert not found, f"{len(found)} texts the server holds carry w*: {found[0][:160]}"
