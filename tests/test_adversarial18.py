"""Adversarial round 18 (issue 21, tried again from scratch): regression tests of what broke.

Each test fails on the code it was written against (xfail, strict) until the defect is fixed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest


# -- area 3 on Flower's asynchronous jobs: one hostile client fills more than δ of a buffer ----
def _client0_huge(partition, mtype, content):
    from flwr.app import Array

    if mtype != "train" or "vectors" not in content.keys():
        return
    cohort = list(content["update"]["cohort"])
    if 0 in cohort:  # the one hostile client of the 8: every update it sends is 1e30
        a = content["vectors"]["theta"].numpy().copy()
        a[cohort.index(0)] = 1e30
        content["vectors"]["theta"] = Array(a)


@pytest.mark.xfail(strict=True, reason="adv18: FedBuff's buffer may hold several updates of "
                   "one Byzantine client; the robust rule's f counts rows, not clients")
def test_one_hostile_client_within_delta_never_moves_theta_under_fedbuff(loopback):
    """2 SuperNodes, 8 clients, ``[asynchronous] rule = {name = "fedbuff", buffer = 4}``,
    concurrency 1, ``[aggregation] name = "tm", delta = 0.25``: the trimmed mean tolerates
    f = ⌊0.25·4⌋ = 1 Byzantine update per step. Only client 0 is hostile (1 of 8 clients,
    fraction 0.125 < δ), sending 1e30 in every update. Jobs go to idle clients, so the same
    client can fill several slots of one buffer: the first buffer held jobs of clients
    [2, 0, 3, 0] — two 1e30 rows among 4, one survives the trim — and θ reached ~2.6e27 in
    40 applied updates, with no failure, warning or refusal (the docs: "a robust aggregation
    rule is checked at the updates one step aggregates", which counts rows, not clients).
    The synchronous rounds never give a client two rows. Expected: θ stays bounded (one
    update per client per buffer, f counted over distinct clients, or a refusal)."""
    from _flower_sims import ls_run

    from partialfl.flower.server import run_server

    run = ls_run(40, eval_every=0, spec={
        "aggregation": {"name": "tm", "delta": 0.25},
        "asynchronous": {"rule": {"name": "fedbuff", "buffer": 4}, "concurrency": 1},
        "personalize": {"server": {"lr": 0.05}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            report = run_server(loopback(2, tamper=_client0_huge), run)
        except (RuntimeError, ValueError) as e:  # a one-line refusal is fine too
            assert "\n" not in str(e)
            return
    assert np.abs(report.theta["theta"]).max() < 1e3
