"""Adversarial round 26b (issue 21, areas 2 and 5, tried again from scratch): the defects
found.

Each test failed on the code it was written against (main at 67fed42) because of the defect it
names, and passes since the fix."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from _flower_loopback import loopback  # noqa: F401 - the fixture
from _flower_sims import ls_run

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from flwr.app import MetricRecord, RecordDict  # noqa: E402

from partialfl.algorithms.base import ClientResult  # noqa: E402
from partialfl.algorithms.wrapper import AlgorithmWrapper  # noqa: E402
from partialfl.types import ClientUpdates  # noqa: E402


def _run(grid, run, **kw):
    from partialfl.flower.server import run_server

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_server(grid, run, **kw)


# -- area 2: one node's two loss metrics make the logged training loss infinite -------------
def _two_huge_losses(partition, mtype, content):
    if partition == 1 and mtype == "train":
        k = len(content["update"]["cohort"])
        content["metrics"] = MetricRecord({"loss.sum": 1.7e308, "loss.count": k,
                                           "train_loss.sum": 1.7e308, "train_loss.count": k})


def test_one_node_never_makes_the_logged_train_loss_infinite(loopback):  # noqa: F811
    """Least squares, 2 SuperNodes; node 1 replies to every train message with both allowed
    metrics, ``loss.sum = train_loss.sum = 1.7e308`` over its k clients (each finite, each
    accepted by codec.decode_metrics). Every round's logged ``train_loss`` is ``inf`` with 0
    failures. Root cause: flower/rounds.py ``train_loss`` sums ``tot + m[name][0]`` over the
    nodes *and* over the two names in plain float64 (the evaluation uses
    ``stats.ratio_of_sums`` for exactly this overflow). A node lying about its own finite
    loss may move the mean; it must not make the log non-finite. Expected: a finite
    ``train_loss`` (or the reply refused and counted)."""
    rep = _run(loopback(2, tamper=_two_huge_losses), ls_run(2))
    losses = [h["train_loss"] for h in rep.history if "train_loss" in h]
    assert losses and np.isfinite(losses).all(), losses


# -- area 2: a node evaluating alone logs an infinite eval_loss ------------------------------
class _Reply:
    def __init__(self, content):
        self.content = content

    def has_error(self):
        return False


def test_a_node_evaluating_alone_never_logs_an_infinite_eval_loss():
    """A model problem whose other node withholds its evaluation (fewer than
    ``eval-min-clients`` clients): the hostile node, which declared ``eval-units =
    [10, 0]`` when it described itself (declared by design), replies ``loss_weight.sum = 0``
    and ``loss_sum.sum = 1.7e308`` over its 2 clients — a reply no honest node can send (a
    sum of per-example losses weighted by zero weights is 0), accepted by
    codec._decode_eval. flower/evaluate.py ``eval_reduce`` logs ``eval_loss = inf``
    (``ratio_of_sums`` divides by its floor 1e-12). Expected: the reply refused and counted
    as ``eval-invalid`` (or a finite eval_loss)."""
    from partialfl.flower.evaluate import eval_reduce
    from partialfl.flower.federation import Federation

    rec = {"clients": 2.0, "acc.count": 2.0, "correct.sum": 1.0, "total.sum": 10.0,
           "loss_sum.sum": 1.7e308, "loss_weight.sum": 0.0}
    fed = Federation({7: {"partition-id": 1, "clients": [2, 3], "eval-units": [10.0, 0.0]}},
                     [7], np.zeros(4, np.int64), 4, {}, True, np.ones(4))
    report = SimpleNamespace(failures=[], eval_withheld=0)
    out = eval_reduce(SimpleNamespace(eval_min_clients=2), fed, ["m"],
                      {"m": _Reply(RecordDict({"eval": MetricRecord(rec)}))}, 1, report)
    refused = [f.kind for f in report.failures] == ["eval-invalid"]
    assert refused or np.isfinite(out.get("eval_loss", 0.0)), (out, report.failures)


# -- area 2: one node describing another federation stops the ServerApp ----------------------
def test_one_node_describing_another_federation_is_left_out_not_a_crash(loopback):  # noqa: F811
    """Least squares (spec: 8 clients), three SuperNodes: partitions 0 and 1 of 2 (honest,
    complete, matching the spec's 8 clients) and a third node started with
    ``partition-id = 2, num-partitions = 3`` (a stranger, or one hostile node: its
    description is well-formed and passes codec.decode_describe). ``run_server`` raises
    ``ConfigError: SuperNodes disagree on num-partitions ...`` before round 1: one node's
    reply stops the ServerApp, although every client of the spec is held by consistent
    nodes (the same holds for one node declaring another ``num-clients`` or ``torch``).
    Expected: that node's description counted as ``describe-invalid`` and the run going on
    with the two consistent nodes (or, where the server cannot tell which nodes are right,
    a counted refusal rather than an exception the node alone provoked)."""
    grid = loopback(3)
    for i, ctx in enumerate(grid.contexts.values()):
        ctx.node_config["num-partitions"] = 2 if i < 2 else 3
    rep = _run(grid, ls_run(2, node_wait_timeout=3))  # the stranger's 3 may still complete
    assert rep.server_steps == 2 and not rep.aborted
    assert [f.kind for f in rep.failures] == ["describe-invalid"]


# -- area 5: a ClientApp sends what the in-process screen refuses before the server sees it --
class _Leaky(AlgorithmWrapper):
    """A buggy algorithm whose clients put their personal optimum w_m* (a function of their
    own data) into the message, in ways the in-process privacy screen refuses."""

    def __init__(self, base, how: str, seen: list) -> None:
        super().__init__(base)
        self.how, self.seen = how, seen

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u, k = res.updates, len(cohort)
        w = np.asarray(next(iter(problem.w_star(cohort, state.theta).values())),
                       dtype=np.float64).reshape(k, -1)
        self.seen.append(w.copy())
        vectors, extra, metrics = dict(u.vectors), dict(u.extra), dict(u.metrics)
        n = next(iter(vectors))
        if self.how == "theta-name-extra":  # undeclared extra, θ's names and shapes
            pad = np.zeros((k, vectors[n].shape[1] - w.shape[1]))
            extra["dc"] = {n: np.concatenate([w, pad], 1)}
        elif self.how == "packed-vector":  # θ's name, rows longer than θ
            vectors[n] = np.concatenate([vectors[n], w], 1)
        elif self.how == "text-metric":  # w as text under an allowed metric name
            metrics["train_loss"] = np.array([repr(r.tolist()) for r in w], dtype=object)
        return ClientResult(ClientUpdates(vectors, u.weights, u.cohort, u.grad_evals, metrics,
                                          extra), res.client_state)


def _received_values(m) -> list:
    """Every array and string of a message the ServerApp received."""
    if m.has_error():
        return [str(m.error.reason)]
    out = []
    for rec in m.content.values():
        for v in getattr(rec, "values", lambda: [])():
            out.append(v.numpy() if hasattr(v, "numpy") else v)
    return out


def _carries(value, w: np.ndarray) -> bool:
    """Whether ``value`` holds a row of ``w`` (or its negative) as consecutive numbers, or
    the text of its first entry."""
    if isinstance(value, str):
        return any(repr(float(r[0]))[:10] in value for r in w)
    if isinstance(value, list):
        return any(_carries(x, w) for x in value)
    if not isinstance(value, np.ndarray) or value.dtype.kind != "f" or value.size < w.shape[1]:
        return False
    win = np.lib.stride_tricks.sliding_window_view(value.reshape(-1).astype(np.float64),
                                                   w.shape[1])
    return any(np.isclose(win, s * r, rtol=1e-6, atol=0).all(1).any() for r in w
               for s in (1, -1))


@pytest.mark.parametrize("how", ["theta-name-extra", "packed-vector", "text-metric"])
def test_a_personal_value_never_reaches_the_flower_server(loopback, how):  # noqa: F811
    """The Flower twin of test_privacy's ``test_a_personal_payload_never_reaches_the_server``
    (which asserts in process that the server saw nothing): least squares on 2 loopback
    SuperNodes, the ClientApp and the ServerApp built with a factory wrapping FFGG in a
    client that leaks each client's w_m* (a) as an undeclared extra 'dc' under θ's leaf
    name and shape, (b) appended to its θ row, (c) as text in ``train_loss``. A message
    hook (what ``audit-dir`` writes to disk) sees w_m*'s values, by value, in the replies
    the ServerApp received — (a) in ``extra.dc``, (b) in ``vectors``, (c) in the error
    reason (numpy's "could not convert string to float: '[...]'"): the server refuses them
    only after they arrived. Root cause: flower/client.py ``train`` calls
    ``encode_updates(result.updates, theta.keys(), ...)``, which checks leaf names (and
    ``aggregate_metrics`` converts with numpy, whose error quotes the text), never the
    in-process screen (``privacy.check_updates``: declared extras, θ-shaped float rows,
    float metrics, value-free reasons). Expected: the node refuses the cohort before
    sending, with a reason that holds no value."""
    from partialfl.build import build
    from partialfl.flower.client import make_client_app

    leaked: list[np.ndarray] = []

    def factory(cfg, problem):
        return _Leaky(build(cfg.run).algorithm, how, leaked)

    got = []
    grid = loopback(2, client_app=make_client_app(factory))
    try:
        _run(grid, ls_run(1), message_hook=got.append, algorithm_factory=factory)
    except RuntimeError:  # every node refused: the run aborts (that is fine)
        pass
    assert leaked  # the clients computed w_m*
    w = np.concatenate(leaked)
    trains = [m for m in got if m.metadata.message_type == "train"]
    assert trains
    reached = [v for m in trains for v in _received_values(m) if _carries(v, w)]
    assert not reached, f"{len(reached)} received values carry a client's w_m*"
