"""``partialfl reproduce dp`` (issue 24 item 4): the rows' privacy blocks, the contrasts of its
summary, stage 1 on other (public) clients, and the quick run end to end (real data)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from _nn_toy import one_thread, toy_data, toy_model

from partialfl.build import Task
from partialfl.dp_accounting import Mechanism, epsilon, solve_noise_multiplier
from partialfl.local.sgd import SGDConfig
from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, StageConfig
from partialfl.stats import contrast_interval, paired_difference

FEDAVG = MethodConfig(algorithm="fedavg", split="none")
FFGG = MethodConfig(algorithm="ffgg", split="output")


def _counts(seed, s=2, m=12, n=50, p=0.6):
    g = np.random.default_rng(seed)
    t = g.integers(20, n, size=(s, m)).astype(float)
    return g.binomial(t.astype(int), p).astype(float), t


def test_contrast_interval_is_paired_difference_for_two_terms_and_pairs_every_term():
    (c, t), (bc, bt) = _counts(0), _counts(1, p=0.5)
    two = contrast_interval([(1, c, t), (-1, bc, bt)])
    ref = paired_difference(c, t, bc, bt)
    assert (two.estimate, two.low, two.high, two.se) == pytest.approx(
        (ref.estimate, ref.low, ref.high, ref.se), abs=1e-12)
    # a difference of differences whose terms cancel client by client: exactly 0, no spread
    dd = contrast_interval([(1, c, t), (-1, bc, bt), (-1, c, t), (1, bc, bt)])
    assert dd.estimate == pytest.approx(0, abs=1e-12) and dd.high - dd.low < 1e-12
    # the estimate is the contrast of pooled accuracies
    (c2, t2), (c3, t3) = _counts(2, p=0.7), _counts(3, p=0.4)
    acc = [(x.sum(1) / y.sum(1)).mean() for x, y in ((c, t), (bc, bt), (c2, t2), (c3, t3))]
    four = contrast_interval([(1, c, t), (-1, bc, bt), (-1, c2, t2), (1, c3, t3)])
    assert four.estimate == pytest.approx(acc[0] - acc[1] - acc[2] + acc[3], abs=1e-12)
    assert four.low <= four.estimate <= four.high
    with pytest.raises(ValueError, match="same seeds and clients"):
        contrast_interval([(1, c, t), (1, c[:, :5], t[:, :5])])


def test_each_row_gets_the_same_noise_on_theta_and_the_run_uses_the_solved_z():
    """FFGG's gradient clip is C_Δ / η_s (same bound on the θ step as FedAvg's Δθ), δ is
    0.1/M, ε = ∞ means z = 0; the wrapper built from the block solves z for the target ε
    over the stage's rounds with Poisson sampling at k/M, as the accountant does."""
    from partialfl.build import build_algorithm
    from partialfl.reproductions.dp import DELTA_FACTOR, Private, settings
    from partialfl.reproductions.femnist import FFGG_SERVER_LR

    st = next(s for s in settings() if s.key == "femnist")
    table = Private(st, 3.0, quick=False)
    fed, ffgg = table.privacy(FEDAVG, 70), table.privacy(FFGG, 70)
    assert fed["clip_norm"] == st.clip
    assert ffgg["clip_norm"] == pytest.approx(st.clip / FFGG_SERVER_LR)
    assert fed["delta"] == DELTA_FACTOR / 70 and fed["target_epsilon"] == 3.0
    assert fed["sampling"] == "poisson" and "noise_multiplier" not in fed
    inf = Private(st, math.inf, quick=False).privacy(FFGG, 70)
    assert inf["noise_multiplier"] == 0.0 and "target_epsilon" not in inf
    from partialfl.registry import component

    stage = StageConfig(rounds=40, clients_per_round=10, client=SGDConfig(lr=0.01))
    spec = RunSpec(method=FEDAVG, personalize=stage,
                   privacy=component("wrapper", fed, "privacy"))
    alg = build_algorithm(spec, stage, num_clients=70)
    plan = alg.plan(70)
    z = solve_noise_multiplier(Mechanism(0.0, 70, 10, "poisson"), 3.0, 40, 0.1 / 70)
    assert plan.mechanism.noise_multiplier == z > 0
    assert alg.epsilon(40, 70) == epsilon(Mechanism(z, 70, 10, "poisson"), 40, 0.1 / 70) <= 3


def test_stage1_runs_on_its_own_task_when_given(tmp_path):
    """``run_pipeline(stage1_task=…)``: stage 1 trains on other clients (its record names
    their task), stages 2 and 3 on the task's; the result differs from stage 1 on the same
    clients."""
    from partialfl.pipeline.stages import run_pipeline

    stage = StageConfig(rounds=2, clients_per_round=3, client=SGDConfig(lr=0.1, batch_size=4))
    cfg = RunSpec(method=FFGG, pretrain=stage, personalize=stage,
                  finetune=FinetuneConfig(lr=0.1, epochs=1, batch_size=4))
    private = Task(data=toy_data(6), model_fn=toy_model, name="toy")
    public = Task(data=toy_data(4, seed=7), model_fn=toy_model, name="toy-public")
    with one_thread():
        a = run_pipeline(cfg, private, tmp_path / "a", progress=False, stage1_task=public)
        b = run_pipeline(cfg, private, tmp_path / "b", progress=False)
    rec = json.loads((tmp_path / "a" / "stage1" / "config.json").read_text())
    assert rec["task"] == "toy-public"
    assert json.loads((tmp_path / "b" / "stage1" / "config.json").read_text())["task"] == "toy"
    assert a.metrics["client_ids"] == b.metrics["client_ids"] == list(private.data.client_ids)
    assert a.metrics["per_client_test_correct"] != b.metrics["per_client_test_correct"]


def _record():
    """A two-ε record like the study's, built from synthetic counts."""
    labels = ["FedAvg", "FedAvg + FT (output)", "FFGG (output)"]
    by_eps = {}
    for j, eps in enumerate(("1", "inf")):
        counts = {lab: [x.tolist() for x in _counts(10 * j + i, p=0.4 + 0.1 * i + 0.2 * j)]
                  for i, lab in enumerate(labels)}
        priv = {lab: {"round": [5, 5], "dp_epsilon": [0.999 if eps == "1" else math.inf] * 2,
                      "dp_noise_multiplier": [2.5 if eps == "1" else 0.0] * 2,
                      "dp_delta": [0.01] * 2, "dp_clip_norm": [0.1, 0.1]}
                for lab in ("FedAvg", "FFGG (output)")}
        by_eps[eps] = {"counts": counts, "privacy": priv}
    panel = {"title": "toy", "seeds": [0, 1], "by_eps": by_eps, "public": ["a"],
             "private": [str(i) for i in range(12)], "clip": 0.1, "ffgg_server_lr": 0.1,
             "matched": {"FFGG (output)": "FedAvg + FT (output)"},
             "size": {"pretrain_rounds": 3, "rounds": 5, "finetune_epochs": 1,
                      "clients_per_round": 3}}
    return {"quick": False, "epsilons": ["1", "inf"], "panels": {"har": panel},
            "seconds": {"har": 60.0}, "total_seconds": 60.0}


def test_summary_gives_the_gap_and_its_change_with_the_paired_intervals(tmp_path):
    from partialfl.reproductions.dp_report import contrast, epsilon_plot, summary

    rec = _record()
    p = rec["panels"]["har"]
    text = summary(rec, ["- design"])
    gap = contrast(p, [(1, "FFGG (output)", "1"), (-1, "FedAvg + FT (output)", "1")])
    dd = contrast(p, [(1, "FFGG (output)", "1"), (-1, "FedAvg + FT (output)", "1"),
                      (-1, "FFGG (output)", "inf"), (1, "FedAvg + FT (output)", "inf")])
    assert f"{100 * gap.estimate:+.2f} [{100 * gap.low:+.2f}, {100 * gap.high:+.2f}]" in text
    assert f"{100 * dd.estimate:+.2f} [{100 * dd.low:+.2f}, {100 * dd.high:+.2f}]" in text
    assert "| 1 | 2.5 | 0.9990 | 0.01 | 0.1 | 5 |" in text  # z, ε spent, δ, C, rounds
    assert "| ∞ | 0 | ∞ | 0.01 | 0.1 | 5 |" in text
    epsilon_plot(tmp_path / "e.png", rec)
    assert (tmp_path / "e.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.data
def test_dp_quick_writes_summary_plot_and_the_accountants_epsilon(tmp_path, data_dir):
    """The quick study end to end through the CLI: summary and plot written, and every
    run's ε and z equal the accountant's for the run's parameters (z solved for the
    target over stage 2's rounds, Poisson at k/M, δ = 0.1/M)."""
    import subprocess
    import sys

    from _summaries import check_standalone_summary

    from partialfl.reproductions.dp import DELTA_FACTOR, QUICK_EPSILONS, settings

    out = tmp_path / "dp"
    r = subprocess.run([sys.executable, "-m", "partialfl", "reproduce", "dp", "--quick",
                        "--out", str(out), "--data-dir", str(data_dir)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    text = (out / "summary.md").read_text()
    check_standalone_summary(text, quick=True)
    assert "## HAR by subject" in text and "## FEMNIST by writer" in text
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 10_000
    record = json.loads((out / "dp.json").read_text())
    # the record rebuilt from the finished tables alone is the same, but for the time
    from partialfl.reproductions.dp import collect

    collect(out, quick=True)
    again = json.loads((out / "dp.json").read_text())
    assert again["panels"] == record["panels"] and again["epsilons"] == record["epsilons"]
    assert again["total_seconds"] is None and "not recorded" in (out / "summary.md").read_text()
    for st in settings():
        p = record["panels"][st.key]
        size = st.size(True)
        M, k, R = len(p["private"]), p["size"]["clients_per_round"], size.rounds
        assert set(p["public"]).isdisjoint(p["private"])
        zero = p["by_eps"]["0"]["counts"]  # no private round: joint = fine-tuning the part
        for label, base in p["matched"].items():
            assert zero[label] == zero[base]
        for eps in QUICK_EPSILONS:
            name = "inf" if math.isinf(eps) else f"{eps:g}"
            for pr in p["by_eps"][name]["privacy"].values():
                assert pr["round"] == [R] * len(size.seeds)
                assert pr["dp_delta"] == [pytest.approx(DELTA_FACTOR / M)] * len(size.seeds)
                if math.isinf(eps):
                    assert pr["dp_noise_multiplier"] == [0.0] * len(size.seeds)
                    assert all(math.isinf(e) for e in pr["dp_epsilon"])
                    continue
                z = solve_noise_multiplier(Mechanism(0.0, M, k, "poisson"), eps, R,
                                           DELTA_FACTOR / M)
                assert pr["dp_noise_multiplier"] == [pytest.approx(z, rel=1e-12)] * len(
                    size.seeds)
                want = epsilon(Mechanism(z, M, k, "poisson"), R, DELTA_FACTOR / M)
                assert pr["dp_epsilon"] == [pytest.approx(want, rel=1e-9)] * len(size.seeds)
                assert want <= eps


def test_a_row_whose_stage2_loses_its_clients_is_a_recorded_result_not_a_crash(
        tmp_path, monkeypatch):
    """At small ε a row's clients may all turn non-finite (FFGG's fine-tuning on a θ drowned
    in noise): the group is recorded as failed in ``failed.json``, returned with its error,
    and a resumed study reads the record instead of running the group again."""
    from partialfl.reproductions.dp import FAILED, Private, settings
    from partialfl.reproductions.tables import Table
    from partialfl.runtime.faults import ClientFaultError

    calls = []

    def boom(self, *a, **k):
        calls.append(a)
        raise ClientFaultError("467 of 927 client computations were lost")

    monkeypatch.setattr(Table, "run_group", boom)
    st = next(s for s in settings() if s.key == "har")
    table, size = Private(st, 1.0, quick=True), st.size(True)
    labels = ("FFGG (adapter)",)
    for _ in range(2):
        got = table.run_group(tmp_path, None, size, "sequential", "cpu", {}, 0, labels, False)
        assert got == [("FFGG (adapter)", 0, {"method": "ffgg-adapter", "seed": 0,
                                               "failed": "467 of 927 client computations "
                                                         "were lost"}, 0.0)]
    assert len(calls) == 1  # the second call read the record
    assert json.loads((tmp_path / "seed0" / "ffgg-adapter" / FAILED).read_text())["error"] \
        .startswith("467 of 927")

    def other(self, *a, **k):
        raise ValueError("a bug is not a result")

    monkeypatch.setattr(Table, "run_group", other)
    with pytest.raises(ValueError, match="a bug"):
        table.run_group(tmp_path, None, size, "sequential", "cpu", {}, 1, labels, False)


def test_summary_and_plot_show_a_failed_row_with_its_error_and_no_contrast(tmp_path):
    from partialfl.reproductions.dp_report import epsilon_plot, summary

    rec = _record()
    by = rec["panels"]["har"]["by_eps"]["1"]
    del by["counts"]["FFGG (output)"], by["privacy"]["FFGG (output)"]
    by["failed"] = {"FFGG (output)": ["5 of 9 client computations were lost"]}
    panel = rec["panels"]["har"]  # run in the study's order: ε = ∞ before ε = 1
    panel["by_eps"] = {"inf": panel["by_eps"]["inf"], "1": by}
    text = summary(rec, ["- design"])
    assert text.index("| 1 | 2.5 |") < text.index("| ∞ | 0 |")  # tables in ε order
    assert "| FFGG (output) | failed (1) |" in text
    assert "1. FFGG (output) at ε = 1: 5 of 9 client computations were lost" in text
    gap_row = next(line for line in text.splitlines()
                   if line.startswith("| FFGG (output) | –"))
    assert gap_row.count("–") == 1  # no gap at ε = 1, a gap at ∞
    epsilon_plot(tmp_path / "e.png", rec)
    assert (tmp_path / "e.png").stat().st_size > 10_000
