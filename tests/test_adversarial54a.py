"""Adversarial round 54a (issue 21, areas 2, 5 and 6 on Flower, tried again from scratch by
someone who did not write the fixes, against 3d02241: round 53a's SecAgg+ ``_drop_unkeyed``
and ``exit_with_parent``). Each test failed on that code because of the defect it names,
and passes since the fix: a share-keys reply must send shares to every neighbour but the node itself
(``secagg.check_reply``); a short one is that node's own ``invalid`` failure, and
``_drop_unkeyed`` takes it out of the round.

* Area 2, one SuperNode whose SecAgg+ ``share_keys`` reply is well-formed but names fewer
  destinations than the neighbours the server sent it fails the round of EVERY node — the
  hostile twin of round 53a's drop-out at ``share_keys``: with 4 loopback SuperNodes (least
  squares, shares 3, threshold 2, ``max_failure_fraction`` 0.9, 2 rounds), partition 1
  answering the ``share_keys`` message with an empty ``destination_list`` /
  ``ciphertext_list`` (a node keeps its own share; Flower's ClientApp sends one to each
  other neighbour) passes
  :func:`partialfl.flower.secagg.check_reply` (it checks that the destinations are
  *among* the request's neighbours and distinct, not that they are all of them), stays in
  the workflow's ``active_node_ids`` (so ``_drop_unkeyed`` keeps it), sends its masked
  vector, and at ``unmask`` the honest nodes are asked for key shares of it they never
  received (``KeyError`` in ``secaggplus_mod._unmask``; "Not enough shares to recover
  secret"): ``RunAborted: 10 of 10 requested client updates failed (100% >
  max-failure-fraction 0.9); failures by kind {'timeout': 3, 'error': 4}, partitions lost:
  [0, 2, 3]`` — 0 server steps, the honest partitions blamed. One node stalls the whole
  federation for good with one well-formed, checkable reply. The server knows which
  neighbours' keys it sent (the request's keys), so the short reply can be refused as
  that node's ``invalid`` failure (a drop-out at ``share_keys``, which ``_drop_unkeyed``
  then handles as in round 53a). The same with 3 and 5 nodes (every honest partition
  lost). Suspected root cause: ``secagg._check_reply``'s ``SHARE_KEYS`` branch (``among``
  is a subset test; the destinations should be exactly the request's neighbours other
  than the node itself).

Tried and held (run unless marked "read"): SecAgg+ over 4 loopback nodes — a node whose
share_keys reply keeps only one of its two destinations (the round finishes, nothing
counted: the shares that went out reach the threshold), a node whose unmask reply names no
shares (finishes); zeroed unmask shares fail the round, counted (documented: "shares that
do not combine"). User models over 3 loopback SuperNodes that allow imports, pretrain and
personalize, ``output`` and ``input`` splits, plain and SecAgg+, evaluation every round:
GroupNorm + LayerNorm, an ``nn.Embedding`` (also ``sparse=True``, ``max_norm``,
``padding_idx``) with a float buffer, a weight tied across θ and w (``head.weight =
mid.weight``: one name, θ's, in θ⁰ and every update), a buffer the forward overwrites from
the data (never in any reply) — all finish without failures; what the server receives
(describe info and θ⁰ names/shapes = θ's parameters only; train vectors θ-shaped;
evaluation sums over ≥ 2 clients, nothing from a node holding 1 client) holds no leaf,
buffer or shape of w. ``partialfl flower local`` of the GroupNorm model, 3 nodes,
``--secagg --insecure --allow-code``: finishes (60 %), no ``flwr-serverapp`` left. (read)
``exit_with_parent`` / ``started_by_superlink``: only ``flwr-serverapp`` /
``flwr-simulation`` processes watch; nothing a node sends reaches it.

Observed, not filed: a node sending undecryptable (``b"x"``) or swapped ciphertexts in its
share_keys reply fails every honest neighbour at ``collect_masked_vectors`` ("Insufficient
available nodes", every partition lost): the server cannot read node-to-node ciphertexts
(SecAgg+ is semi-honest, a known non-defect). (read) ``secaggplus_mod._unmask`` does not
check that the active and dead lists are disjoint (a hostile server could ask for both
shares of one node): the semi-honest server caveat. (read) ``exit_with_parent`` reads its
parent's pid when ``run_server`` starts, so a SuperLink that dies during the ServerApp's
start-up (imports) is not noticed by it; Flower's own monitor, given the parent's pid,
raises SIGINT then (whether that ends the process in that window was not run).
"""

from __future__ import annotations

import logging
import warnings

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402


def _short_share_keys(how: str):
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    def hostile(partition, mtype, content):
        if partition != 1 or RECORD_KEY_CONFIGS not in content.keys():
            return
        cfg = content[RECORD_KEY_CONFIGS]
        if Key.DESTINATION_LIST not in cfg.keys():
            return
        d, c = list(cfg[Key.DESTINATION_LIST]), list(cfg[Key.CIPHERTEXT_LIST])
        keep = [] if how == "empty" else d[:1]  # none, or one of its 2 neighbours
        cfg[Key.DESTINATION_LIST] = [x for x in d if x in keep]
        cfg[Key.CIPHERTEXT_LIST] = [y for x, y in zip(d, c) if x in keep]
    return hostile


def _secagg(loopback, how):  # noqa: F811
    from partialfl.flower.server import run_server

    run = ls_run(2, 5, secagg=True, secagg_clip=64.0, spec={"max_failure_fraction": 0.9})
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_server(loopback(4, tamper=_short_share_keys(how)), run)
    finally:
        logging.disable(logging.NOTSET)


def test_an_empty_share_keys_reply_is_that_nodes_own_failure(loopback):  # noqa: F811
    """Found: ``RunAborted: 10 of 10 requested client updates failed ... partitions lost:
    [0, 2, 3]``. Expected: only partition 1 counted, both rounds applied."""
    report = _secagg(loopback, "empty")
    assert report.server_steps == 2 and not report.aborted
    assert {f.partition for f in report.failures} == {1}


def test_control_a_share_keys_reply_one_short_still_unmasks(loopback):  # noqa: F811
    """The run finishes (a reply one destination short is now that node's own failure)."""
    report = _secagg(loopback, "one")
    assert report.server_steps == 2 and not report.aborted
    assert {f.partition for f in report.failures} <= {1}
