"""Summary helpers shared by the reproductions: the numbers in the tables and verdicts."""

import math

from partialfl.experiments.report import (
    accuracy_cells,
    docstring_bullets,
    markdown_table,
    percent_mean_std,
    versus_fedavg,
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


def test_versus_fedavg_checks_both_claims_against_both_fedavg_numbers():
    results = {"FedAvg": [run(0.82, 0.80)],
               "FFGG (input)": [run(0.81, 0.0)],
               "FFGG (adapter)": [run(0.835, 0.0)]}
    lines = versus_fedavg(results, "head", claim_margin=0.01)
    text = "\n".join(lines)
    assert "FedAvg (no fine-tuning): 80.00%; FedAvg + fine-tuned head: 82.00%" in text
    assert "FFGG (input): 81.00% (+1.00 points vs FedAvg, -1.00 vs FedAvg + FT)" in text
    # every split > 80 but not every split > 82
    assert "every FFGG split above FedAvg: holds here vs FedAvg, does NOT hold vs FedAvg + FT" \
        in text
    assert "FFGG (adapter) > FFGG (input)" in text
    # best is 83.5: +3.5 over FedAvg (≥ 1 holds), +1.5 over FedAvg + FT (holds)
    assert lines[-1].endswith("holds here vs FedAvg, holds vs FedAvg + FT.")
    assert not any("≥" in line for line in versus_fedavg(results, "head"))


def test_markdown_table_and_docstring_bullets():
    assert markdown_table(["a", "b"], [[1, 2]]).splitlines() == ["| a | b |", "| --- | --- |",
                                                                 "| 1 | 2 |"]
    doc = "Intro.\n\nDeviations:\n\n* first line\n  continues\n* second\n"
    assert docstring_bullets(doc, "Deviations:") == ["- first line continues", "- second"]
