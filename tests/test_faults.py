"""Faults: a failing, NaN-sending or dying client is skipped and counted, never averaged; the
run aborts only past the failure fraction (sync, async, worker processes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SMALL

from partialfl.algorithms import FFGG
from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.local import GradientDescent
from partialfl.metrics import closed_form_metrics
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime import JsonlLogger, read_jsonl, run_rounds
from partialfl.runtime.asynchronous import run_async
from partialfl.runtime.faults import (
    ClientFaultError,
    DropClients,
    FaultInjector,
    finite_mask,
)
from partialfl.runtime.processes import run_processes
from partialfl.server import SGD
from partialfl.types import ClientUpdates


def _problem():
    return LeastSquaresProblem(SMALL, basis="eigen")


def _ffgg(p):
    return FFGG(GradientDescent(3), SGD(0.5 / p.L))


def _eval(*a):
    return closed_form_metrics(*a, with_loss=False)


def test_sync_failing_and_nan_clients_are_skipped_and_counted(tmp_path):
    p = _problem()
    at = {(1, 2): "raise", (3, 0): "nan", (3, 4): "nan", (5, 1): "raise"}
    with JsonlLogger(tmp_path / "m.jsonl") as lg:
        res = run_rounds(p, FaultInjector(_ffgg(p), at=at), 8, seed=3, evaluate=_eval,
                         logger=lg)
    ref = run_rounds(p, DropClients(_ffgg(p), at), 8, seed=3, evaluate=_eval)
    theta, want = res.state.theta["theta"], ref.state.theta["theta"]
    assert np.isfinite(theta).all()
    np.testing.assert_allclose(theta, want, rtol=1e-10, atol=1e-12)
    last = read_jsonl(tmp_path / "m.jsonl")[-1]
    assert last["clients_failed"] == 2 and last["updates_nonfinite"] == 2
    assert res.history[-1]["rel_dist2"] < res.history[0]["rel_dist2"]


def test_sync_a_round_where_every_client_is_lost_keeps_theta():
    p = _problem()
    at = {(2, None): "nan"}
    res = run_rounds(p, FaultInjector(_ffgg(p), at=at), 3, seed=0, max_failure_fraction=0.6)
    ref = run_rounds(p, _ffgg(p), 2, seed=0)
    np.testing.assert_array_equal(res.state.theta["theta"], ref.state.theta["theta"])
    assert res.state.round == 3 and res.faults.nonfinite == p.num_clients


def test_sync_aborts_past_the_failure_fraction():
    p = _problem()
    alg = FaultInjector(_ffgg(p), rate=0.7, kinds=("raise",), seed=1)
    with pytest.raises(ClientFaultError, match="max_failure_fraction=0.5"):
        run_rounds(p, alg, 20, seed=0)
    # the same faults are tolerated when the user allows them
    res = run_rounds(p, alg, 4, seed=0, max_failure_fraction=0.9)
    assert res.faults.failed > 0 and np.isfinite(res.state.theta["theta"]).all()


def test_a_bug_in_every_client_is_not_hidden():
    p = _problem()

    class Broken(FFGG):
        def client_update(self, *a, **k):
            raise TypeError("a bug")

    with pytest.raises(TypeError, match="a bug"):
        run_rounds(p, Broken(GradientDescent(1)), 5)


def test_finite_mask_checks_vectors_weights_and_extra():
    from partialfl.types import ClientUpdates

    v = np.ones((3, 2))
    v[1, 0] = np.inf
    up = ClientUpdates({"theta": v}, np.array([1.0, 1.0, np.nan]), np.arange(3),
                       extra={"dc": {"theta": np.array([[0.0], [0.0], [0.0]])}})
    assert finite_mask(up).tolist() == [True, False, False]


def test_async_skips_raising_and_nan_clients():
    p = _problem()
    at = {(2, None): "nan", (4, None): "raise", (7, None): "nan"}
    res = run_async(p, FaultInjector(_ffgg(p), at=at), steps=20, concurrency=3, seed=1,
                    evaluate=_eval, eval_every=5)
    assert np.isfinite(res.state.theta["theta"]).all()
    last = res.history[-1]
    assert last["updates_nonfinite"] == 2 and last["clients_failed"] == 1
    assert res.state.round == 20 and len(res.staleness) == 20
    lost = [e for e in res.event_dicts() if e["event"] == "lost"]
    assert sorted(e["job"] for e in lost) == [2, 4, 7]
    assert res.history[-1]["rel_dist2"] < res.history[0]["rel_dist2"]


@pytest.mark.timeout(60)
def test_processes_detect_a_dead_worker_and_go_on():
    p = _problem()
    at = {(1, None): "die", (3, None): "raise"}
    # jobs take 20 ms, so the surviving worker cannot finish the run before the death of
    # the other is noticed (it is noticed within milliseconds of the exit)
    res = run_processes(p, FaultInjector(_ffgg(p), at=at), steps=16, concurrency=2,
                        time_unit=0.02, seed=0, evaluate=_eval, eval_every=8,
                        poll_seconds=0.2)
    last = res.history[-1]
    assert res.state.round == 16
    assert last["worker_deaths"] == 1 and last["clients_failed"] == 1
    assert np.isfinite(res.state.theta["theta"]).all()


@pytest.mark.slow
def test_reproduce_faults_quick(tmp_path):
    from partialfl.cli import main

    assert main(["reproduce", "faults", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert "| least squares | sync | 30% |" in text and "| least squares | processes |" in text
    assert ": yes" in text and ": NO" not in text
    assert "orders of magnitude below the fault-free run [95% CI]" in text
    assert "| synchronous, 30% faults |" in text and "(one seed: no interval)" in text
    assert (tmp_path / "faults.png").stat().st_size > 0
    # issue 21's fault kinds, each with its outcome (a closed pool, a kill between
    # checkpoint files; with Flower, a SuperNode sending another dtype / an extra record)
    kinds = json.loads((tmp_path / "results.json").read_text())["kinds"]
    assert all(k["ok"] for k in kinds) and "expected outcome: yes." in text
    names = {k["kind"].split(" (")[0] for k in kinds}
    assert {"closed worker pool", "kill between checkpoint files"} <= names
    import importlib.util

    if importlib.util.find_spec("flwr") and importlib.util.find_spec("ray"):
        # a SuperNode lost in Flower's simulation: counted, and θ equals the in-process run
        # with exactly its clients' updates dropped
        rows = json.loads((tmp_path / "results.json").read_text())["rows"]
        fl = [r for r in rows if r["runtime"] == "flower-sim" and r["rate"] > 0]
        assert fl and fl[0]["lost"] == fl[0]["injected"]["node loss"] > 0
        assert fl[0]["lost_partitions"] == [1] and fl[0]["ref_diff"] < 1e-9
        assert {"hostile SuperNode (dtype)", "hostile SuperNode (extra)"} <= {
            k["kind"] for k in kinds}


def test_faults_comparison_pairs_each_rate_with_the_fault_free_run():
    """Synthetic rows, 3 seeds: 30% faults end 2 orders above the fault-free run on every
    seed ('worse'); 10% faults within the seed spread ('no detectable difference')."""
    from partialfl.reproductions.faults import comparison

    rng = np.random.default_rng(1)
    rows = []
    for seed in (0, 1, 2):
        base = 10.0 ** rng.normal(-6, 1)
        for rate, factor in ((0.0, 1.0), (0.1, 10.0 ** rng.normal(0, 0.3)), (0.3, 100.0)):
            rows.append({"part": "least squares", "runtime": "sync", "rate": rate,
                         "seed": seed, "final": base * factor})
    text = "\n".join(comparison(rows, quick=False))
    row = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ")}
    assert "| worse |" in row["synchronous, 30% faults"]
    assert "-2.00 [-2.00, -2.00]" in row["synchronous, 30% faults"]
    assert "no detectable difference" in row["synchronous, 10% faults"]
    assert comparison([], quick=False) == []


class _BlowsUp(AlgorithmWrapper):
    """Client 2 sends a finite 1e30·update in round 3; like a network whose loss overflows,
    every client's update is non-finite once θ is huge."""

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u = res.updates
        v = u.vectors["theta"].copy()
        if np.abs(state.theta["theta"]).max() > 1e20:
            v[:] = np.inf
        v[(np.asarray(cohort) == 2) & (ctx.round == 3)] *= 1e30
        return ClientResult(ClientUpdates({"theta": v}, u.weights, u.cohort, u.grad_evals,
                                          u.metrics, u.extra), res.client_state)


def test_the_fault_abort_names_its_cause_and_the_client_that_blew_up_theta():
    """The abort used to end in an empty 'first: ' (non-finite updates set no cause)."""
    p = _problem()
    with pytest.raises(ClientFaultError) as e, np.errstate(all="ignore"):
        run_rounds(p, _BlowsUp(_ffgg(p)), 30, seed=0)
    msg = str(e.value)
    assert "first: round 4: non-finite update of client(s) [0, 1, 2, 3, 4, 5]" in msg
    assert "at round 3, whose largest update came from client 2 (norm" in msg


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_divergence_stops_the_run_with_a_named_warning(tmp_path, loop):
    """θ not finite after a server step: a RuntimeWarning naming where, the run stops there
    (a last record shows it), and no checkpoint of the diverged state is written."""
    from partialfl.runtime.checkpoint import Checkpoint

    p = _problem()
    alg = FFGG(GradientDescent(2), SGD(1e300))
    ck = tmp_path / "c.ckpt"
    with pytest.warns(RuntimeWarning, match="the run diverged: θ is not finite after the "
                      "server step of (round|client .* \\(job) [0-9]+.*‖θ‖ grew ×.* whose "
                      "largest update came from client"), np.errstate(all="ignore"):
        if loop == "sync":
            res = run_rounds(p, alg, 10, seed=0, checkpoint=ck, checkpoint_every=1,
                             evaluate=_eval)
        else:
            res = run_async(p, alg, steps=10, concurrency=2, seed=0, checkpoint=ck,
                            checkpoint_every=1, evaluate=_eval, eval_every=5)
    assert res.diverged and res.stopped if loop == "sync" else res.diverged
    assert res.history[-1]["round"] == res.state.round <= 3
    assert not np.isfinite(res.history[-1]["rel_dist2"])
    saved = Checkpoint(ck, kind=loop).load()  # the last finite state, not the diverged one
    state = saved.server["state"] if loop == "sync" else saved.server["server"]["state"]
    assert state.round < res.state.round and np.isfinite(state.theta["theta"]).all()


def test_cli_run_that_diverges_warns_instead_of_aborting(tmp_path, capsys):
    from partialfl.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text('[problem]\nname = "least-squares"\nnum_clients = 4\nn = 30\nd_theta = 5\n'
                   'd_w = 2\n[personalize]\nrounds = 60\nclient = { name = "gd", tau = 2 }\n')
    with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
        code = main(["run", str(cfg), "--out", str(tmp_path / "o"), "--no-progress",
                     "--set", "personalize.server.lr=1e30"])
    err = capsys.readouterr().err
    assert code == 1 and "warning: the run diverged" in err and "error" not in err


# ------------------------------------------------------------------ data errors
def _corrupt_client_store(tmp_path):
    """A model problem on an on-disk store whose client 1 has a label outside 0..4 written
    after the store was opened (a store read refuses it: StoreError)."""
    from _nn_toy import toy_data, toy_model

    from partialfl.batching import Loop
    from partialfl.data.store import open_store, write_store
    from partialfl.problems.model import ModelProblem
    from partialfl.split import make_split

    path = write_store(tmp_path / "store", toy_data(num_clients=4, seed=1))
    ds = open_store(path)
    header = json.loads((path / "header.json").read_text())
    dt = np.dtype(header["fields"]["train_y"]["dtype"])
    with open(path / "train_y.bin", "r+b") as f:  # client 1's first label (same size)
        f.seek(int(ds.train_sizes()[0]) * dt.itemsize)
        f.write(np.asarray([99], dtype=dt).tobytes())
    return ModelProblem(make_split(toy_model(0), "none"), ds, mode=Loop())


@pytest.mark.parametrize("backend", ["sequential", "processes"])
def test_a_store_error_in_a_round_is_a_data_error_not_a_client_fault(tmp_path, backend):
    """Clients 0, 2, 3 succeed; client 1's data are corrupt: the run stops with the store's
    error (it used to skip client 1 with a warning, round after round)."""
    from partialfl.algorithms.model import FedAvg
    from partialfl.data.store import StoreError
    from partialfl.local.sgd import SGDConfig
    from partialfl.runtime import SequentialBackend
    from partialfl.runtime.cohort_pool import ProcessBackend

    pb = _corrupt_client_store(tmp_path)
    be = SequentialBackend() if backend == "sequential" else ProcessBackend(workers=2)
    try:
        with pytest.raises(StoreError, match=r"train_y.bin: row \d+ holds a value outside"):
            run_rounds(pb, FedAvg(SGDConfig(lr=0.1, batch_size=4)), 2, seed=0, backend=be)
    finally:
        if backend == "processes":
            be.close()


def test_a_store_error_stops_an_asynchronous_run(tmp_path):
    from partialfl.algorithms.model import FedAvg
    from partialfl.data.store import StoreError
    from partialfl.local.sgd import SGDConfig

    pb = _corrupt_client_store(tmp_path)
    with pytest.raises(StoreError, match="train_y.bin"):  # (it used to be skipped)
        run_async(pb, FedAvg(SGDConfig(lr=0.1, batch_size=4)), steps=12, concurrency=2)


def test_row_norms_of_tensors_match_the_scaled_float64_reference():
    """The server's per-row norms (θ growth diagnostics): torch's float32 reduction for fp32
    and fp16 tensors (float32 rounding), redone in float64 for the rows that overflow or
    underflow there; the scaled numpy path otherwise; non-finite rows are inf, no finite row
    overflows, a tiny row is not 0."""
    import torch

    from partialfl.runtime.faults import _row_norms

    x = torch.tensor([[3.0, 4.0, 0.0], [float("nan"), 1.0, 0.0], [float("inf"), 0.0, 0.0],
                      [3e38, 3e38, -3e38], [0.0, 0.0, 0.0], [1e-30, 1e-30, 0.0]])
    ref = _row_norms(x.numpy())  # the numpy path
    np.testing.assert_allclose(_row_norms(x.double()), ref, rtol=1e-12)
    for got in (_row_norms(x), _row_norms(x[:1].half())):
        np.testing.assert_allclose(got, ref[:len(got)], rtol=1e-6)
    assert np.isinf(ref[1:3]).all() and np.isfinite(ref[3]) and ref[4] == 0.0
    assert _row_norms(x)[3] == pytest.approx(3e38 * 3 ** 0.5) and _row_norms(x)[5] > 0
    r = torch.randn(7, 5, 3, generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(_row_norms(r), np.sqrt((r.double() ** 2).sum((1, 2))).numpy(),
                               rtol=1e-6)
    assert _row_norms(torch.zeros(2, 0)).tolist() == [0.0, 0.0]
