"""Adversarial round 35a (issue 21, areas 2 and 5, tried again from scratch by someone who did
not write the fixes). The test failed on the code it was written against (adv35a at c47dec5)
because of the defect it names, and passes since the fix.

* Area 5, a field of a train reply with no freedom at all: the client ids. A reply's
  ``update.cohort`` must be exactly the ids the server asked for, in order — the server
  checks that (``codec._decode_updates``: ``reply is for clients …, asked for …``), and in
  process the runtime refuses such a result (``MalformedResult``) before the server step sees
  it. But a SuperNode does not: ``flower.client.train`` screens the client computation's
  ``ClientUpdates`` with ``node.screened`` → ``privacy.check_updates``, whose
  ``scalars_refusal`` only asks that ``cohort`` be "one integer id per client" (shape and
  dtype), and ``codec.encode_updates`` then writes ``[int(c) for c in updates.cohort]`` — the
  ids the client's code returned, not the ids asked. A leaky client returning, as its ids,
  the int64 bits of w_m*[0] (its personal optimum, a function of its own data) gets 64 bits
  per client per round to the ServerApp — and the server's refusal quotes them in its log
  and the report's failures (``reply cohort id must be an integer in [0, 9.0072e+15], got
  -4621755080802950039``). The plain path's other scalar fields have a documented free
  value (a weight ≤ max(1, n_m), a bounded ``grad_evals``); the ids have none, so the node
  can send the asked ids themselves (or refuse its cohort) and nothing of the client's
  value leaves. Sync and asynchronous Flower runs share the node's ``train``.

Tried and held (not tested here): the same id leak in process (sequential rounds and
``run_async``: ``MalformedResult`` before the server step; its text in the researcher's own
log is a known non-defect); local DP clip factors for NaN/∞ rows (NaN kept, ∞ zeroed);
``ratio_of_sums`` with two nodes' 1.7e308 sums; evaluation replies (keys, counts, units,
correct ≤ total, zero loss weight, negative sums); SecAgg+ contributions (ids not sent:
``node_contribution`` combines rows and sends its own ``len(cohort)``); DP ``rounds`` budget
with round −1 and replays (counted by the ledger, fresh noise per repeated (key, round));
duplicate ids in a local-DP cohort (identical rows: the same noise per (key, round, id));
θ⁰ and the personalize split (data-independent for every shipped algorithm and split).
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
from _flower_sims import ASYNC_1, ls_run  # noqa: E402


class _IdLeak(AlgorithmWrapper):
    """A client whose message names as its clients' ids the int64 bits of w_m*[0] (its
    personal optimum at the server's θ); everything else is the honest update."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.leaked: list[np.ndarray] = []

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u, k = res.updates, len(cohort)
        w = np.asarray(next(iter(problem.w_star(cohort, state.theta).values())),
                       dtype=np.float64).reshape(k, -1)
        ids = np.ascontiguousarray(w[:, 0]).view(np.int64)
        self.leaked.append(ids.copy())
        return ClientResult(ClientUpdates(u.vectors, u.weights, ids, u.grad_evals, u.metrics,
                                          u.extra), res.client_state)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_client_ids_of_a_train_reply_carry_nothing_of_w(loopback, mode):  # noqa: F811
    """Least squares on 2 loopback SuperNodes, ClientApp and ServerApp built with a factory
    wrapping FFGG in :class:`_IdLeak` (synchronous rounds, or the asynchronous FedAsync
    loop). A message hook (what ``audit-dir`` writes) sees every reply the server receives.
    Expected: no received train reply, and no failure reason of the report, holds a leaked
    id — the node sends the ids it was asked for (or refuses its cohort on the node)."""
    from partialfl.build import build
    from partialfl.flower.client import make_client_app
    from partialfl.flower.server import run_server

    made: list[_IdLeak] = []

    def factory(cfg, problem):
        made.append(_IdLeak(build(cfg.run).algorithm))
        return made[-1]

    got, rep = [], None
    run = ls_run(1) if mode == "sync" else ls_run(**{**ASYNC_1, "rounds": 2})
    grid = loopback(2, client_app=make_client_app(factory))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rep = run_server(grid, run, message_hook=got.append, algorithm_factory=factory)
        except RuntimeError:  # every node failed: the run aborts (that is fine)
            pass
    leaked = {int(x) for m in made for a in m.leaked for x in a}
    assert leaked  # the leaky client computed
    trains = [m for m in got if m.metadata.message_type == "train" and not m.has_error()]
    sent = {int(c) for m in trains for c in m.content["update"]["cohort"]}
    assert not sent & leaked, (f"{len(sent & leaked)} ids the server received are w_m*'s "
                               "bits")
    if rep is not None:
        text = " ".join(f.reason for f in rep.failures)
        assert not any(str(x) in text for x in leaked), "the report quotes w_m*'s bits"
