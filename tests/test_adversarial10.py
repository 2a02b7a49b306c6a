"""Adversarial round 10 (issue 21): regression tests for what the tenth independent round found
(a reviewer who did not write the fixes) — a client's negative weight ending a robust run,
and ``partialfl advise --table`` reading a received measurement unchecked."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

from partialfl.algorithms import FedAlt
from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.local import GDConfig
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.runtime import run_rounds


class Weighted(AlgorithmWrapper):
    """Client ``target`` reports the weight ``w`` (a hostile or buggy client)."""

    def __init__(self, base, w: float, target: int) -> None:
        super().__init__(base)
        self.w, self.target, self.name = w, target, base.name

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        wts = np.array(res.updates.weights, dtype=np.float64, copy=True)
        wts[np.asarray(cohort) == self.target] = self.w
        return ClientResult(replace(res.updates, weights=wts), res.client_state)


def _problem():
    return LeastSquaresProblem(LeastSquaresSpec(num_clients=8, n=40, d_theta=3, d_w=2, seed=0))


def _run(agg, w=None, target=3):
    from partialfl.runtime.faults import FaultInjector

    base = FedAlt(GDConfig(2, 0.05), w_init="zero", aggregator=agg)
    alg = (FaultInjector(base, at={(r, target): "raise" for r in range(3)}) if w is None
           else Weighted(base, w, target))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_rounds(_problem(), alg, 3, clients_per_round=8, seed=0)


@pytest.mark.parametrize("rule", ["tm", "krum", "gm-weighted", "mean-weighted"])
@pytest.mark.parametrize("w", [-1.0, -1e-300])
def test_a_negative_client_weight_is_one_counted_refusal(rule, w):
    """A client's weight was checked to be finite only: one client sending −1 (or −1e-300)
    ended the run with the robust rule's ValueError ('weights must be finite, non-negative')
    — also under trimmed mean or Krum, which ignore weights — and the weighted mean skipped
    it with a warning about NaN/inf, uncounted. A weight counts examples: now a negative one
    is that client's refused message (``updates_refused``), and the run equals the one in
    which that client raises."""
    from partialfl.aggregation import Mean
    from partialfl.build import make_aggregator

    agg = {"tm": lambda: make_aggregator("tm", delta=0.125),
           "krum": lambda: make_aggregator("krum", delta=0.125),
           "gm-weighted": lambda: make_aggregator("gm", weighted=True),
           "mean-weighted": lambda: Mean(weighted=True)}[rule]()
    res = _run(agg, w)
    ref = _run(agg)
    assert (res.faults.refused, res.faults.lost) == (3, 3)
    np.testing.assert_array_equal(res.state.theta["theta"], ref.state.theta["theta"])


_TABLES = {
    "not-results": '{"a": NaN}',
    "a-list": "[1, 2]",
    "rows-not-lists": '{"results": {"FFGG (input)": 3}}',
    "acc-nan": '{"results": {"FFGG (input)": [{"test_acc": NaN}]}}',
    "acc-text": '{"results": {"FFGG (input)": [{"test_acc": "0.5"}]}}',
    "acc-huge": '{"results": {"FFGG (input)": [{"test_acc": 1e308}]}}',
    "seed-text": '{"results": {"FFGG (input)": [{"test_acc": 0.5, "seed": "a"}], '
                 '"FedAvg": [{"test_acc": 0.5, "seed": 1}]}}',
    "run-not-table": '{"results": {"FFGG (input)": [0.5]}}',
}


@pytest.mark.parametrize("kind", [*_TABLES, "fifo-json", "fifo-md", "binary-md"])
def test_advise_reads_a_received_measured_table_as_one_line_before_any_work(
        tmp_path, capsys, kind):
    """``partialfl advise TASK --table FILE`` read the measured table only after the advisor
    (and its stage-1 pre-training) had run, with ``json.loads(path.read_text())["results"]``
    unchecked: a results.json without ``results``, a list, rows that are not lists or runs
    without a numeric ``test_acc`` ended in a KeyError/TypeError traceback, a NaN accuracy
    went into the Spearman correlation, and a FIFO under the table's name hung the command
    for good. Now the table is read first (a received file: regular files only) and checked:
    one line naming the file, exit 2, before any data is loaded or anything is written."""
    import os

    from partialfl.cli import main

    if kind == "fifo-json" or kind == "fifo-md":
        table = tmp_path / ("t.json" if kind == "fifo-json" else "t.md")
        os.mkfifo(table)
    elif kind == "binary-md":
        table = tmp_path / "t.md"
        table.write_bytes(b"\xff\xfe| FFGG (input) | 1 |")
    else:
        table = tmp_path / "results.json"
        table.write_text(_TABLES[kind])
    out = tmp_path / "out"
    rc = main(["advise", "har", "--pretrain-rounds", "0", "--table", str(table), "--out",
               str(out), "--data-dir", str(tmp_path / "no-data"), "--no-progress"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and str(table) in err[0], err
    assert not out.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes", ["-1", "0", "100000000000"])
def test_flower_credentials_refuses_a_bad_node_count(tmp_path, capsys, nodes):
    """``partialfl flower credentials OUT --nodes -1`` (or 0) wrote the CA and the server
    certificate, no SuperNode key, and exited 0 saying it wrote '-1 SuperNode key pairs';
    ``--nodes 100000000000`` generated key pairs for days (32599 in 40 s, each a file).
    Now one line naming --nodes and its range, exit 2, nothing written."""
    from partialfl.cli import main

    pytest.importorskip("cryptography")
    out = tmp_path / "creds"
    rc = main(["flower", "credentials", str(out), "--nodes", nodes])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "--nodes" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("nodes", [-1, 0, 10 ** 11])
def test_node_stores_refuse_a_bad_node_count(tmp_path, nodes):
    """``partialfl flower node-data CONFIG OUT --nodes 0`` wrote no store and exited 0 (the
    loop over the nodes was empty). Now the node count is checked as for ``flower local``."""
    from types import SimpleNamespace

    from partialfl.config import ConfigError
    from partialfl.flower.local import write_node_stores

    with pytest.raises(ConfigError, match="--nodes must be an integer in"):
        write_node_stores(SimpleNamespace(num_clients=4), nodes, tmp_path / "nodes")
    assert not (tmp_path / "nodes").exists()


def test_byzantine_clients_under_the_plain_mean_warn(tmp_path):
    """An ``[attack]`` block without ``[aggregation]`` (or ``ByzantineRobust`` with
    ``Mean()``): the mean states no δ, so the fraction check passed it and the run trained
    with 20% sign-flipping clients averaged in, without a word (exit 0), while the README
    says robust training never runs silently unprotected. The mean stays a baseline under
    attack (``partialfl reproduce byzantine`` compares it), now with an
    :class:`~partialfl.aggregation.UnprotectedWarning` naming it; a robust rule gets none."""
    from partialfl.aggregation import UnprotectedWarning
    from partialfl.cli import main

    spec = tmp_path / "attack.toml"
    spec.write_text('seed = 0\n[problem]\nname = "least-squares"\nnum_clients = 10\nn = 40\n'
                    'd_theta = 3\nd_w = 2\nseed = 0\n[method]\nalgorithm = "ffgg"\n'
                    'w_init = "zero"\n[personalize]\nrounds = 2\nclients_per_round = 10\n'
                    'client = { name = "cg", tau = 2 }\nserver = { optimizer = "sgd", '
                    'lr = 0.05 }\n[attack]\nname = "byzantine"\nfraction = 0.2\n'
                    'attack = { name = "sign-flip" }\n')
    with pytest.warns(UnprotectedWarning, match="plain mean"):
        assert main(["run", str(spec), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    spec.write_text(spec.read_text() + '[aggregation]\nname = "cm"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnprotectedWarning)
        assert main(["run", str(spec), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
