"""Adversarial round 36a (issue 21, areas 2 and 5, tried again from scratch by someone who did
not write the fixes). The test failed on the code it was written against (adv36a at b28fac7)
because of the defect it names, and passes since the fix.

* Area 5, local DP on a SuperNode: the noised update is the only release of a local-DP
  client, and the mechanism (clip to C, add N(0, z²C²)) is meant to hold whatever the base
  algorithm computes — the node's floor ``dp-min-noise`` "is what makes local DP hold
  against the server". But a row that is not finite passes the mechanism unchanged:
  ``dp.clip_factors`` keeps a NaN norm's factor NaN ("so the message path drops them"),
  ``_scale_rows`` multiplies the row by it and ``_gaussian`` adds the noise — and IEEE 754
  arithmetic propagates the NaN operand's payload, so each coordinate that was a NaN with
  51 payload bits is still exactly that NaN after clipping and noise. In process the message
  path drops such rows before the server sees them; on Flower the plain (non-SecAgg) train
  path does not: ``flower.client.train`` → ``node.screened`` → ``privacy.check_updates``
  does not look at finiteness (the SecAgg+ path refuses non-finite contributions on the
  node since round 32a), and ``codec.encode_updates`` sends the bytes. The ServerApp refuses
  the reply (``reply is not finite``), after receiving it: 51 un-noised bits of the client's
  own value per coordinate per round (here w_m*[0], its personal optimum, a function of its
  data), which no DP accounting covers. A non-finite row has no use on the wire (the server
  refuses it anyway); the node can refuse it as it does under SecAgg+. (An ∞ coordinate is
  the same channel: its row's factor is 0, ∞·0 is NaN, the other coordinates become noise, so
  the pattern of NaN positions — d bits — reaches the server.)

Tried and held (not tested here): a local-DP reply's weights (ones), metrics (dropped) and
extras (refused); ``train_loss`` NaN payloads (``aggregate_metrics`` drops NaN, the screen
refuses ∞); SecAgg+ contributions (clear ``fitres.metrics``: the node's counts and loss sums
as documented; non-finite rows refused on the node); evaluation replies of a local-DP node
(withheld); adaptive clipping's shared clip norm (refused with local DP); describe's θ⁰
(closed forms: the server's own); the in-process message path (non-finite rows screened
before the server's view).
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

#: the 51 payload bits of a quiet float64 NaN
_PAYLOAD = (1 << 51) - 1
_QNAN = 0x7FF8000000000000


class _NaNLeak(AlgorithmWrapper):
    """A base client (inside the DP wrapper) whose update row is, at every coordinate, a quiet
    NaN whose payload is the low 51 bits of w_m*[0] (its personal optimum at the server's θ)."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.leaked: set[int] = set()

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u, k = res.updates, len(cohort)
        w = np.asarray(next(iter(problem.w_star(cohort, state.theta).values())),
                       dtype=np.float64).reshape(k, -1)
        bits = (np.ascontiguousarray(w[:, 0]).view(np.uint64) & np.uint64(_PAYLOAD)) | \
            np.uint64(_QNAN)
        self.leaked |= {int(b) & _PAYLOAD for b in bits}
        vectors = {}
        for n, v in u.vectors.items():
            a = np.empty(np.shape(v), dtype=np.float64)
            a.reshape(k, -1).view(np.uint64)[:] = bits[:, None]
            vectors[n] = a.astype(np.asarray(v).dtype)
        return ClientResult(ClientUpdates(vectors, u.weights, u.cohort, u.grad_evals,
                                          u.metrics, u.extra), res.client_state)


def test_a_local_dp_nodes_update_carries_no_un_noised_bits_of_w(loopback):  # noqa: F811
    """Least squares (8 clients) on 2 loopback SuperNodes, each with the floor
    ``dp-min-noise = 1``; local DP (clip 1, z = 2, 4 clients per round), one round. The
    ClientApp and ServerApp are built with a factory whose DP wrapper's base is FFGG in
    :class:`_NaNLeak`. A message hook sees every reply the server receives. Expected: no
    received train reply holds a value that is not finite (the node refuses or drops such
    rows, as the SecAgg+ path and the in-process message path do), so no NaN payload — the
    leaked bits — reaches the server."""
    from partialfl.build import build
    from partialfl.flower.client import make_client_app
    from partialfl.flower.server import run_server

    made: list[_NaNLeak] = []

    def factory(cfg, problem):
        alg = build(cfg.run).algorithm
        made.append(_NaNLeak(alg.base))
        alg.base = made[-1]  # inside the DP wrapper: clipped and noised after it
        return alg

    run = ls_run(1, 4, spec={"privacy": {"name": "dp", "clip_norm": 1.0,
                                         "noise_multiplier": 2.0, "mode": "local",
                                         "sampling": "fixed"}})
    got = []
    grid = loopback(2, node_config={"dp-min-noise": 1.0}, client_app=make_client_app(factory))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run_server(grid, run, message_hook=got.append, algorithm_factory=factory)
        except RuntimeError:  # every node failed: the run aborts (that is fine)
            pass
    leaked = {b for m in made for b in m.leaked}
    assert leaked  # the leaky client computed
    trains = [m for m in got if m.metadata.message_type == "train" and not m.has_error()]
    sent: set[int] = set()
    nonfinite = 0
    for m in trains:
        for a in m.content["vectors"].values():
            x = np.asarray(a.numpy(), dtype=np.float64).reshape(-1)
            nonfinite += int((~np.isfinite(x)).sum())
            sent |= {int(b) & _PAYLOAD for b in x[np.isnan(x)].view(np.uint64)}
    assert not sent & leaked, (f"{nonfinite} non-finite values reached the server; "
                               f"{len(sent & leaked)} NaN payloads are w_m*'s bits, un-noised")
    assert nonfinite == 0, f"{nonfinite} non-finite values reached the server"
