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


# -- area 8: evaluate follows a run's config.json / metrics.json linked from elsewhere ---------
@pytest.mark.xfail(strict=True, reason="adv18: evaluate confines only deploy.safetensors; it "
                   "reads config.json and metrics.json through a symbolic link")
@pytest.mark.parametrize("name", ["config.json", "metrics.json"])
def test_evaluate_refuses_a_run_file_linked_from_outside_the_run(tmp_path, user_module, capsys,
                                                                 name):
    """Issue 21 (8): a symlinked ``deploy.safetensors`` made ``evaluate`` score a run outside
    the folder; the fix (:func:`partialfl.pipeline.runs.confined`: "refuse a file a command
    reads from a run folder (the deployed model, metrics, logs) … that is a symbolic link")
    is applied by ``report`` and ``compare`` to ``metrics.json`` (adv13), but ``evaluate``
    confines only the deploy file: :func:`partialfl.pipeline.evaluation.evaluate_run` then
    reads ``config.json`` (the architecture, split, fine-tuning settings, seed) and
    ``metrics.json`` (``finetune_choice``: the epochs and lr of stage 3) with
    ``pio.read_json``, which follows links — so the scores come from settings outside the
    run, exit 0. Expected: exit 2 with one line naming the symbolic link."""
    from _user_project import client_folder, tiny_toml

    from partialfl.cli import main

    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--no-progress"]) == 0
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((run / name).read_bytes())
    (run / name).unlink()
    (run / name).symlink_to(outside)
    capsys.readouterr()
    rc = main(["evaluate", str(run), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "symbolic link" in err, (rc, err)
