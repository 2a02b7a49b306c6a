"""The quickstart config (issue 23 item 1): a run repeats exactly at its thread count, records
that count and refuses to continue at another one; the config's comment states measured
numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from partialfl.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "train" / "quickstart.toml"
#: the quickstart at a reduced size (the full one takes 14.2 s on a quiet 2-core machine)
SMALL = ["data.num_clients=6", "data.holdout=2", "pretrain.rounds=3", "personalize.rounds=2",
         "pretrain.clients_per_round=3", "personalize.clients_per_round=3",
         "pretrain.eval_every=0", "personalize.eval_every=0", "finetune.epochs=1"]


def _train(out: Path, threads: int, data_dir) -> int:
    sets = [a for s in [*SMALL, f"data.path={data_dir}"] for a in ("--set", s)]
    return main(["train", str(QUICKSTART), "--out", str(out), "--no-progress",
                 "--threads", str(threads), *sets])


def _results(path: Path) -> dict:
    """A metrics file without its wall-clock timings."""
    return {k: v for k, v in json.loads(path.read_text()).items() if "seconds" not in k}


@pytest.mark.slow  # three reduced quickstart runs: 11 s on a loaded 2-core machine
@pytest.mark.data
def test_quickstart_repeats_at_its_thread_count_records_it_and_refuses_another(
        tmp_path, data_dir, capsys):
    old = torch.get_num_threads()
    try:
        for name, threads in (("one", 1), ("again", 1), ("two", 2)):
            assert _train(tmp_path / name, threads, data_dir) == 0
            assert torch.get_num_threads() == threads  # the run ran at its count
            for f in ("spec.json", "config.json"):
                assert json.loads((tmp_path / name / f).read_text())["threads"] == threads
        plan = capsys.readouterr().out
        assert "1 torch thread(s): results repeat at this count" in plan
        assert "2 torch thread(s)" in plan
        # the same thread count: bit-identical models and metrics
        one, again, two = (tmp_path / n for n in ("one", "again", "two"))
        assert (one / "deploy.safetensors").read_bytes() == \
            (again / "deploy.safetensors").read_bytes()
        for f in ("metrics.json", "new_clients.json"):
            assert _results(one / f) == _results(again / f)
        # another count: continuing a run folder is refused, naming the key (one line, exit 2)
        assert _train(one, 2, data_dir) == 2
        err = capsys.readouterr().err.strip()
        assert "threads: 1 there, 2 now" in err and "\n" not in err
        # both counts train the same model up to float rounding (measured on the full
        # quickstart: 76.5% at 1 and 2 threads; it is not bit-identical across counts)
        m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
        assert abs(m1["test_acc"] - m2["test_acc"]) <= 0.05
    finally:
        torch.set_num_threads(old)


def test_quickstart_comment_states_measured_time_and_accuracy():
    """The comment gives a measured wall-clock under a minute and the accuracies (the README
    repeats them)."""
    text = QUICKSTART.read_text()
    secs = float(re.search(r"([\d.]+) s wall-clock", text).group(1))
    assert secs < 60 and f"took {secs} s" in (ROOT / "README.md").read_text()
    acc = re.search(r"test accuracy ([\d.]+)%.*?([\d.]+)% on the 4 new writers", text, re.S)
    assert acc is not None
    readme = (ROOT / "README.md").read_text()
    assert f"{acc.group(1)}%" in readme and f"{acc.group(2)}%" in readme
