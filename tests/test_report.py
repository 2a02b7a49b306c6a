"""Summary helpers shared by the reproductions: the numbers in the tables and verdicts."""

import math

import pytest

from partialfl.pipeline.report import (
    accuracy_cells,
    docstring_bullets,
    markdown_table,
    percent_mean_std,
    versus_baselines,
)


def run(acc, before, train=0.9):
    return {"test_acc": acc, "test_acc_before_ft": before, "train_acc": train,
            "test_acc_p10": acc - 0.1, "test_acc_p50": acc, "test_acc_p90": acc + 0.1}


def test_percent_mean_std_ignores_nan_and_formats_single_values():
    assert percent_mean_std([0.5, 0.7]) == "60.00 ± 10.00"
    assert percent_mean_std([0.5, math.nan]) == "50.00"
    assert percent_mean_std([math.nan]) == "–"


def test_accuracy_cells_mean_over_seeds():
    cells = accuracy_cells([run(0.80, 0.70), run(0.84, 0.72)])
    assert cells[0] == "82.00 ± 2.00"
    assert cells[1] == "71.00 ± 1.00"
    assert cells[2] == "72.00 / 82.00 / 92.00"
    assert cells[3] == "90.00 ± 0.00"


MATCHED = {"FFGG (input)": "FedAvg + FT (input)", "FFGG (adapter)": "FedAvg + FT (adapter)"}


def test_versus_baselines_checks_the_claims_against_fedavg_and_the_matched_rows():
    results = {"FedAvg": [run(0.80, 0.80)],
               "FedAvg + FT (input)": [run(0.82, 0.80)],
               "FedAvg + FT (adapter)": [run(0.83, 0.80)],
               "FFGG (input)": [run(0.81, 0.0)],
               "FFGG (adapter)": [run(0.845, 0.0)]}
    lines = versus_baselines(results, MATCHED, claim_margin=0.01)
    text = "\n".join(lines)
    assert "FedAvg (no fine-tuning): 80.00%." in text
    assert ("FFGG (input): 81.00% (+1.00 points vs FedAvg; -1.00 vs FedAvg + FT (input), "
            "82.00%: joint training vs fine-tuning the same part)") in text
    # point estimates: every split > 80, but FFGG (input) is below its matched baseline
    assert "every FFGG split above FedAvg: holds; above its matched baseline" in text
    assert "(the same part fine-tuned after FedAvg): does NOT hold (point estimates)" in text
    assert "FFGG (adapter) > FFGG (input)" in text
    # best 84.5: +4.5 over FedAvg (≥ 1 holds), +1.5 over its matched 83.0 (holds)
    assert lines[-1].endswith("by ≥ 1 point(s): holds; its matched baseline by ≥ 1: holds "
                              "(point estimates).")
    assert not any("≥" in line for line in versus_baselines(results, MATCHED))


def test_claims_hold_only_where_the_paired_interval_excludes_the_threshold():
    import numpy as np

    ids = [f"c{i}" for i in range(30)]
    tot = np.full((1, 30), 20.0)

    def c(k, noise=0.0):
        rng = np.random.default_rng(int(k * 10))
        return (np.clip(np.full((1, 30), k) + noise * rng.integers(-3, 4, (1, 30)), 0, 20),
                tot, ids)

    counts = {"FedAvg": c(10), "FedAvg + FT (input)": c(12), "FedAvg + FT (adapter)": c(12),
              "FFGG (input)": c(16), "FFGG (adapter)": c(12, noise=1.0)}
    results = {k: [{"test_acc": float(v[0].sum() / v[1].sum())}] for k, v in counts.items()}
    text = "\n".join(versus_baselines(results, MATCHED, claim_margin=0.05, counts=counts))
    # both splits clearly above FedAvg; FFGG (adapter) vs its matched row: noise around 0
    assert "every FFGG split above FedAvg: holds; above its matched baseline" in text
    assert ("not shown at this size (the interval of FFGG (adapter) reaches 0) (paired 95% "
            "intervals)") in text
    # best = FFGG (input), +30 points over FedAvg (≥ 5: holds), +20 over its matched (holds)
    assert "beats FedAvg by ≥ 5 point(s): holds; its matched baseline by ≥ 5: holds" in text


def test_markdown_table_and_docstring_bullets():
    assert markdown_table(["a", "b"], [[1, 2]]).splitlines() == ["| a | b |", "| --- | --- |",
                                                                 "| 1 | 2 |"]
    doc = "Intro.\n\nDeviations:\n\n* first line\n  continues\n* second\n"
    assert docstring_bullets(doc, "Deviations:") == ["- first line continues", "- second"]


def _table_results(labels):
    return {lab: [{**run(0.7 + 0.01 * i, 0.6), "new_test_acc": 0.5,
                   "split_counts": {"personal_params": 10, "global_params": 90},
                   "per_client_test_acc": [0.6, 0.8]}]
            for i, lab in enumerate(labels)}


def _run(results, size, info, quick):
    from partialfl.reproductions.tables import TableRun

    return TableRun(size, results, {}, 60.0, quick, info)


def test_femnist_summary_describes_its_own_run_and_stands_alone():
    from _summaries import check_standalone_summary

    from partialfl.reproductions import femnist

    res = _table_results([lab for lab, _ in femnist.FEMNIST.rows])
    info = {"train_writers": list("abcdefghijkl"), "new_writers": ["m", "n"]}
    quick = femnist.FEMNIST.summary(_run(res, femnist.QUICK, info, True))
    check_standalone_summary(quick, quick=True)
    assert "300 rounds" not in quick and "10 of the 84 writers" not in quick
    assert "stage 1 6 rounds, stage 2 3 rounds on 12 training writers" in quick
    full = femnist.FEMNIST.summary(_run(res, femnist.FULL, info, False))
    check_standalone_summary(full, quick=False)
    assert "stage 1 300 rounds" in full and "Paper's claim, every FFGG split" in full


def test_shakespeare_summary_describes_its_own_run_and_stands_alone():
    from _summaries import check_standalone_summary

    from partialfl.reproductions import shakespeare

    res = _table_results([lab for lab, _ in shakespeare.SHAKESPEARE.rows])
    info = {"stats": {"clients": 8, "train_sequences": 700, "test_sequences": 90,
                      "vocab_words": 300, "test_coverage": 0.8, "seq_len": 20}}
    table = shakespeare.SHAKESPEARE
    quick = table.summary(_run(res, shakespeare.QUICK, info, True))
    check_standalone_summary(quick, quick=True)
    assert "200 pre-training rounds" not in quick and "3 pre-training rounds" in quick
    full = table.summary(_run(res, shakespeare.FULL, info, False))
    check_standalone_summary(full, quick=False)
    assert "200 pre-training rounds" in full


def test_plain_markdown_turns_sphinx_roles_into_code():
    from partialfl.pipeline.report import plain_markdown

    assert plain_markdown("see :mod:`partialfl.split` and :data:`~a.b.FULL`, :func:`f`") == \
        "see `partialfl.split` and `FULL`, `f`"


def test_versus_baselines_without_verdict_reports_numbers_only():
    res = {"FedAvg": [run(0.8, 0.8)], "FFGG (input)": [run(0.6, 0.6)],
           "FedAvg + FT (input)": [run(0.7, 0.8)]}
    lines = versus_baselines(res, {"FFGG (input)": "FedAvg + FT (input)"}, claim_margin=0.01,
                             verdict=False)
    text = "\n".join(lines)
    assert "FFGG (input): 60.00%" in text and "-10.00 vs FedAvg + FT (input)" in text
    assert "holds" not in text and "not judged" in text and "too small" in text


def test_matched_section_compares_each_row_with_its_own_baseline():
    import numpy as np

    from partialfl.pipeline.report import matched_section

    ids = [f"c{i}" for i in range(40)]
    tot = np.full((2, 40), 20.0)
    base = np.full((2, 40), 14.0)
    counts = {"FedAvg + FT (input)": (base, tot, ids), "FedAvg + FT (output)": (base + 3, tot,
                                                                                ids),
              "FFGG (input)": (base + 3, tot, ids), "FFGG (output)": (base + 3, tot, ids),
              "FFGG (adapter)": (base, tot, ids)}
    matched = {"FFGG (input)": "FedAvg + FT (input)", "FFGG (output)": "FedAvg + FT (output)",
               "FFGG (adapter)": "FedAvg + FT (adapter)"}
    lines = matched_section(counts, matched, unit="images", clients="writers")
    text = "\n".join(lines)
    row = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| FFGG")}
    # +3 of 20 on every client and seed against its own baseline: better; against the same
    # counts: no difference (compared with one common baseline both would be "better")
    assert "| FedAvg + FT (input) |" in row["FFGG (input)"]
    assert "| better |" in row["FFGG (input)"]
    assert "+15.00 [+15.00, +15.00]" in row["FFGG (input)"]
    assert "no detectable difference" in row["FFGG (output)"]
    assert ("- FFGG (input) vs FedAvg + FT (input) (joint training vs fine-tuning the same "
            "part): +15.00 [+15.00, +15.00] points: better.") in text
    assert "No per-client counts for FFGG (adapter)" in text  # its baseline is missing
    quick = "\n".join(matched_section(counts, matched, unit="images", clients="writers",
                                       verdict=False))
    assert "better" not in quick and "no verdict at this size" in quick


def test_counts_from_runs_and_paired_section():
    import numpy as np
    import pytest

    from partialfl.pipeline.report import counts_from_runs, paired_section

    ids = [f"c{i}" for i in range(30)]
    rng = np.random.default_rng(0)
    tot = rng.integers(10, 20, 30)
    base = np.round(tot * 0.7)

    def runs(correct_by_seed):
        return [{"seed": s, "client_ids": ids, "per_client_test_correct": list(c),
                 "per_client_test_total": list(tot)} for s, c in enumerate(correct_by_seed)]

    fed = runs([base, base])
    same = runs([base, base])
    up = runs([np.minimum(base + 2, tot), np.minimum(base + 2, tot)])
    c, t, got_ids = counts_from_runs(list(reversed(up)))  # rows come back in seed order
    assert c.shape == (2, 30) and got_ids == ids
    assert counts_from_runs([{"seed": 0}]) is None
    lines = paired_section({"FedAvg": counts_from_runs(fed), "Same": counts_from_runs(same),
                            "Up": counts_from_runs(up), "Old": None},
                           unit="images", clients="writers")
    text = "\n".join(lines)
    row = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ")}
    assert "no detectable difference at this size" in row["Same"]
    assert "| better |" in row["Up"]
    assert f"{tot.sum():,} test images of 30 writers per seed, 2 seeds" in text
    assert "No per-client counts for Old" in text
    other = runs([base, base])
    other[0]["client_ids"] = other[1]["client_ids"] = ids[::-1]
    with pytest.raises(ValueError, match="other clients"):
        paired_section({"FedAvg": counts_from_runs(fed), "X": counts_from_runs(other)},
                       unit="images", clients="writers")


def test_error_ratio_section_states_intervals_and_verdicts_over_seeds():
    """Three seeds: a method 3 orders below the reference is 'better', one at the reference
    'no detectable difference', a diverged one 'worse'; one seed gives no interval, a quick
    run no verdict."""
    import numpy as np

    from partialfl.pipeline.report import error_ratio_section

    ref = np.array([1e-6, 1e-4, 1e-8])
    pairs = {"lower": (ref * np.array([1e-3, 2e-3, 5e-4]), ref),
             "same": (ref * np.array([1.5, 0.6, 1.1]), ref),
             "diverged": (np.array([np.inf, np.nan, 1e9]), ref),
             "cells": (np.stack([ref * 1e-2, ref], 1), np.stack([ref, ref], 1))}
    text = "\n".join(error_ratio_section(pairs, reference="R", error="e", cells="attacks"))
    row = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ")}
    assert "| better |" in row["lower"] and "+3.0" in row["lower"]
    assert "no detectable difference at this size" in row["same"]
    assert "| worse |" in row["diverged"]
    assert "+1.00 [+1.00, +1.00]" in row["cells"]  # 2 orders on one of 2 attacks, every seed
    assert "orders of magnitude below R [95% CI]" in text and "over the 3 seeds" in text
    quick = "\n".join(error_ratio_section(pairs, reference="R", error="e", verdict=False))
    assert "– (quick run)" in quick and "| better |" not in quick
    one = "\n".join(error_ratio_section({"x": (ref[:1] * 1e-2, ref[:1])}, reference="R",
                                        error="e"))
    assert "+2.00 (one seed: no interval)" in one and "**One seed**" in one


def test_har_summary_set_up_describes_the_settings_it_ran():
    """The quick summary's set-up said "10 subjects per round" and "5 epochs" (the full
    table's) although the quick run used 3 and 1 (issue 23 item 10)."""
    from _summaries import check_standalone_summary

    from partialfl.reproductions import har

    res = _table_results([lab for lab, _ in har.HAR.rows])
    info = {"train_subjects": [f"s{i}" for i in range(6)], "new_subjects": ["a", "b"],
            "summary": "6 clients"}
    quick = har.HAR.summary(_run(res, har.QUICK, info, True))
    check_standalone_summary(quick, quick=True)
    setup = quick.split("## Set-up")[1]
    assert "3 subjects per round" in setup and "10 subjects per round" not in setup
    assert "Stage 3: 1 epoch(s) (lr 0.02)" in setup and "5 epochs" not in setup
    assert "Ditto (λ = 0.1)" in setup and "{" not in setup
    full = har.HAR.summary(_run(res, har.FULL, info, False)).split("## Set-up")[1]
    assert "10 subjects per round" in full and "Stage 3: 5 epoch(s)" in full
    plateau = "\n".join(har.HAR.closing(_run(res, har.PLATEAU, info, False)))
    assert "Stage 3: the epochs and lr chosen on validation data" in plateau


@pytest.mark.parametrize("curves,outside", [(2, False), (4, False), (6, True), (16, True)])
def test_a_legend_never_covers_many_curves(curves, outside):
    """With more than a few curves (a table's stage 2 has up to 16) the legend goes beside
    the axes; it covered the curves' ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from partialfl.pipeline.report import legend_beside

    fig, ax = plt.subplots()
    for i in range(curves):
        ax.plot([0, 1, 2], [i, i + 1, i + 2], label=f"method {i}")
    legend_beside(ax)
    fig.canvas.draw()
    leg = ax.get_legend().get_window_extent()
    box = ax.get_window_extent()
    assert (leg.x0 >= box.x1) == outside
    if not outside:
        assert box.x0 <= leg.x0 and leg.x1 <= box.x1
    plt.close(fig)


def test_a_curve_of_one_round_gets_integer_round_ticks(tmp_path, monkeypatch):
    """A stage of 0 rounds has one evaluation (round 0): its panel's round axis showed ticks
    −0.04 … 0.04; it now spans [−0.5, 1] with integer ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from partialfl.pipeline import report

    seen = []
    monkeypatch.setattr(report.pio, "savefig",
                        lambda fig, path, **kw: seen.extend(fig.axes) or path)
    report.plot_curves(tmp_path / "c.png", [{"a": [{"round": 0, "acc": 0.3}]},
                                            {"a": [{"round": r, "acc": 0.3} for r in (0, 20)]}],
                       ["one", "two"], x="round", y="acc", ylabel="acc", logy=False)
    ticks = [t for t in seen[0].get_xticks() if seen[0].get_xlim()[0] <= t
             <= seen[0].get_xlim()[1]]
    assert ticks == [0.0, 1.0]
    assert all(float(t).is_integer() for t in seen[1].get_xticks())
    plt.close("all")


def test_the_divergence_sentence_names_every_stages_learning_rates():
    """A run that diverged only in stage 3 (fine-tuning) was told to lower stage 2's rates."""
    from partialfl.pipeline.train_report import divergence_line

    line = divergence_line({"test_loss": float("nan"), "train_loss": 0.3})
    assert line.startswith("the run diverged: test_loss not finite")
    assert "personalize.server.lr" in line and "finetune.lr" in line
    assert divergence_line({"test_loss": 0.3, "train_loss": 0.2}) == ""
