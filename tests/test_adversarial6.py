"""Regressions from the sixth adversarial battery (issue 21, tried again from scratch by
someone who did not write the fixes): each case once crashed a run or let one client's
result change what the server or the other clients' state received."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from _flower_loopback import loopback  # noqa: F401 - fixture

from partialfl.algorithms import FedAlt
from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.local import GDConfig
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.runtime import run_rounds


def _reshape(res: ClientResult, how: str) -> ClientResult:
    """``res`` with its structure changed as ``how`` says (values untouched)."""
    u, cs = res.updates, res.client_state
    if how == "state-missing":  # a leaf of the client state left out
        return ClientResult(u, {})
    if how == "state-none":
        return ClientResult(u, None)
    if how == "state-more":  # a leaf the runtime's state does not have
        return ClientResult(u, {**cs, "zz": np.ones((1, 5))})
    if how == "state-complex":  # cast silently into the float state before
        return ClientResult(u, {n: v.astype(np.complex128) for n, v in cs.items()})
    if how == "metric-text":  # a metric the others do not send, as text
        return ClientResult(replace(u, metrics={**u.metrics, "train_loss": np.array(["w"])}),
                            cs)
    if how == "extra-more":  # an extra the others do not send
        return ClientResult(replace(u, extra={"aux": {"theta": u.vectors["theta"]}}), cs)
    raise AssertionError(how)


class Reshaped(AlgorithmWrapper):
    """Client ``target``'s result comes back with another structure."""

    def __init__(self, base, how: str, target: int) -> None:
        super().__init__(base)
        self.how, self.target, self.name = how, target, base.name

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        if list(np.asarray(cohort)) != [self.target]:
            return res
        return _reshape(res, self.how)


def _problem():
    return LeastSquaresProblem(LeastSquaresSpec(num_clients=4, n=40, d_theta=3, d_w=2, seed=0))


def _alg():
    return FedAlt(GDConfig(2, 0.05), w_init="zero")  # w_m kept by the clients


def _backend(name):
    from partialfl.runtime.backends import SequentialBackend
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.runtime.threads import ThreadBackend

    return {"loop": SequentialBackend, "threads": lambda: ThreadBackend(2),
            "processes": lambda: ProcessBackend(workers=2)}[name]()


def _run(alg, backend):
    be = _backend(backend)
    try:
        # every round samples all 4 clients, in the order 0..3 (cohort position = id)
        return run_rounds(_problem(), alg, 3, seed=1, backend=be, clients_per_round=4,
                          max_failure_fraction=0.9)
    finally:
        getattr(be, "close", lambda: None)()


_HOWS = ["state-missing", "state-none", "state-more", "state-complex", "metric-text",
         "extra-more"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["loop", "threads", "processes"])
def test_a_client_result_of_another_structure_is_one_counted_failure(backend):
    """The results of a cohort's clients were stacked by the FIRST result's field names
    (``concat_results``), so one client whose result had another structure either crashed
    the round (KeyError: 'w', TypeError: a client state of None, KeyError: 'train_loss' /
    'aux' for a metric or an extra only it sent) or, placed first, silently dropped that
    field for every client — without a client-state leaf, no client's w_m was ever
    updated; a complex or object client-state row was cast into the runtime's float state.
    Now the result's client state must have the structure of the rows it was given, the
    results of a cohort must agree (the odd one out is the failure), and that client is
    skipped and counted: the others' result equals the run in which it raises."""
    from partialfl.runtime.faults import FaultInjector

    for target in (0, 2):
        ref = _run(FaultInjector(_alg(), at={(r, target): "raise" for r in range(3)}),
                   backend)
        for how in _HOWS:
            res = _run(Reshaped(_alg(), how, target), backend)
            assert (res.faults.failed, res.faults.lost) == (3, 3), (how, target)
            np.testing.assert_array_equal(res.state.theta["theta"], ref.state.theta["theta"])
            np.testing.assert_array_equal(res.client_state["w"], ref.client_state["w"])
            assert set(res.client_state) == {"w"}
            assert res.client_state["w"].dtype == np.float64


@pytest.mark.parametrize("how", ["state-missing", "state-none", "state-more",
                                 "state-complex"])
def test_a_client_state_of_another_structure_is_refused_in_the_asynchronous_runtime(how):
    """The simulated asynchronous runtime wrote a result's client state leaf by leaf: a leaf
    the runtime does not hold crashed the run (KeyError: 'zz'), a complex row was cast into
    it; a missing leaf or None left the client's w_m unchanged while its update was applied.
    Now that job is lost and counted."""
    from partialfl.runtime.asynchronous import run_async

    res = run_async(_problem(), Reshaped(_alg(), how, 1), steps=12, concurrency=2, seed=0,
                    max_failure_fraction=0.95)
    lost = [e for e in res.event_dicts() if e["event"] == "lost"]
    assert res.state.round == 12 and lost and res.faults.failed == len(lost)
    assert set(res.client_state) == {"w"} and res.client_state["w"].dtype == np.float64


@pytest.mark.timeout(30)
@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_like_a_store_sidecar_does_not_hang_the_open(tmp_path):
    """A received client store whose ``.verified.json`` (the remembered CRC checks) is a
    FIFO: opening the store blocked for good in ``open()`` (the symlink check let it
    through). Now the sidecar is read only when it is a regular file; the CRCs are checked."""
    import os

    from _nn_toy import toy_data

    from partialfl.data.store import ClientStore, write_store
    from partialfl.data.store import verify as sv

    path = write_store(tmp_path / "s", toy_data(num_clients=3, seed=1))
    side = path / sv.SIDECAR
    side.unlink(missing_ok=True)
    os.mkfifo(side)
    sv.forget()
    store = ClientStore(path)
    assert sorted(store.crc_read) == sorted(store._h.files)  # nothing trusted: all read


@pytest.mark.timeout(30)
@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_like_a_run_log_is_one_line_for_report(tmp_path, capsys):
    """``partialfl report`` on a received run folder whose ``stage2.jsonl`` is a FIFO hung
    for good (read_jsonl opened it, waiting for a writer). Now: one line, exit 2."""
    import os

    from partialfl.cli import main

    os.mkfifo(tmp_path / "stage2.jsonl")
    assert main(["report", str(tmp_path)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "not a regular file" in err[0], err


@pytest.mark.parametrize("mode", ["local", "central"])
def test_a_local_dp_reply_carries_no_exact_training_loss(mode):
    """Local DP noised a client's update, but its message kept the base's ``train_loss``, the
    client's exact (un-noised) training loss, which a SuperNode sends as ``train_loss.sum``
    over its sampled clients: with one client of a node in the cohort, a server — even
    against a node's ``dp-min-noise`` floor — read that client's exact loss at any θ it
    sent (a loss oracle outside the mechanism: the same value under two noise keys). Now
    only the noised update leaves a local-DP client; central mode (the server is trusted)
    keeps the metric."""
    from _nn_toy import toy_data, toy_model

    from partialfl.algorithms import FedAvg
    from partialfl.algorithms.base import RoundContext
    from partialfl.algorithms.dp import DifferentiallyPrivate, DPOptions
    from partialfl.flower.codec import encode_updates, metric_names
    from partialfl.local import SGDConfig
    from partialfl.problems.model import ModelProblem
    from partialfl.split import make_split

    pb = ModelProblem(make_split(toy_model(0), "none"), toy_data(), vectorize=False)
    alg = DifferentiallyPrivate(FedAvg(SGDConfig(steps=2, lr=0.1, batch_size=4)),
                                DPOptions(clip_norm=1.0, noise_multiplier=5.0, mode=mode,
                                          sampling="fixed", clients_per_round=2))
    st = alg.init(pb, pb.init_theta())
    one = alg.sample_cohort(0, 0, pb.num_clients, None)[:1]
    res = alg.client_update(st, pb, one, RoundContext(0, 0, noise_key=12345))
    sent = dict(encode_updates(res.updates, st.theta.keys(), metric_names(alg))["metrics"])
    if mode == "local":
        assert not res.updates.metrics and not sent
    else:
        assert "train_loss" in res.updates.metrics and "train_loss.sum" in sent


def test_a_replay_after_another_run_config_still_gets_fresh_local_dp_noise(loopback):  # noqa: F811
    """A SuperNode drew a repeated round's noise from a fresh secret, but remembered which
    rounds it had answered in its cached runtime only. A server with a node whose
    ``dp-noise-key`` is the operator's integer sent round r at θ_a, then one message under
    another run config (the cache holds one run: the runtime was rebuilt, its memory
    empty), then round r again under the first config at θ_b: both replies carried the same
    noise, and their difference was the exact difference of the clipped updates. Now the
    node remembers the rounds answered per noise key for as long as the process lives."""
    from test_adversarial5 import _ask, _local_dp, _train_message

    z = 2.0
    grid = loopback(1, node_config={"dp-noise-key": "7"})
    sent = _train_message(grid, _local_dp(z))
    theta_a = {n: a.numpy() for n, a in sent.content["theta"].items()}
    theta_b = {n: v + 0.5 for n, v in theta_a.items()}
    other = _train_message(loopback(1), _local_dp(3.0)).content["run-config"]
    reply_a = _ask(grid, sent, theta_a)
    _ask(grid, sent, theta_a, other)  # evicts the node's cached runtime
    reply_b = _ask(grid, sent, theta_b, sent.content["run-config"])
    clean = loopback(1)
    no_noise = _train_message(clean, _local_dp(0.0)).content["run-config"]
    clip_a, clip_b = (_ask(clean, sent, t, no_noise) for t in (theta_a, theta_b))
    leak = np.abs((reply_a - reply_b) - (clip_a - clip_b)).max()
    assert leak > 0.5 * z  # the server learns the difference only under noise


# ------------------------------------------------------------------ specs: one line, exit 2
_SPEC = """seed = 0
[problem]
name = "least-squares"
num_clients = 8
n = 60
d_theta = 3
d_w = 2
seed = 0
[method]
algorithm = "ffgg"
w_init = "zero"
[personalize]
rounds = 4  # >= the FedBuff buffer below (a larger buffer never steps)
clients_per_round = 4
client = { name = "cg", tau = 2 }
server = { optimizer = "sgd", lr = 0.05 }
"""
_MONNA = '[aggregation]\nname = "monna"\ndelta = 0.25\ntrusted = 0\n'
_DP = '[privacy]\nname = "dp"\nclip_norm = 1.0\nnoise_multiplier = 0.5\nsampling = "fixed"\n'


def _dry_run(tmp_path, capsys, extra: str):
    from partialfl.cli import main

    p = tmp_path / "spec.toml"
    p.write_text(_SPEC + extra)
    rc = main(["run", str(p), "--dry-run"])
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


@pytest.mark.parametrize("extra", [_MONNA, '[faults]\nrate = 0.1\n',
                                   '[attack]\nname = "byzantine"\nfraction = 0.125\n'
                                   '[aggregation]\nname = "tm"\ndelta = 0.25\n'],
                         ids=["monna-trusted", "faults", "attack"])
def test_privacy_beside_a_wrapper_is_one_line(tmp_path, capsys, extra):
    """``aggregation = {name = "monna", trusted = 0}`` (which now brings the robust server
    without an ``[attack]`` block), ``[faults]`` or ``[attack]``, with ``[privacy]``: DP's
    refusal to wrap another wrapper was a TypeError, so ``partialfl run`` (even
    ``--dry-run``) ended in a traceback. Now one line naming the combination, exit 2."""
    rc, err = _dry_run(tmp_path, capsys, extra + _DP)
    assert rc == 2 and len(err) == 1, err
    assert "cannot be combined" in err[0]


@pytest.mark.parametrize("extra", [_MONNA, '[attack]\nname = "byzantine"\nfraction = 0.125\n'
                                           '[aggregation]\nname = "tm"\ndelta = 0.25\n'],
                         ids=["monna-trusted", "attack"])
def test_a_robust_rule_under_fedasync_is_refused_before_running(tmp_path, capsys, extra):
    """A robust rule under ``[asynchronous]`` (FedAsync: one arriving update per server
    step) was checked at the synchronous cohort size: the dry run said yes, and the run
    aggregated every update alone, 'unprotected' (one warning; a MoNNA with a trusted client
    then applied the trusted client's updates only and dropped every other one). Now the
    rule is checked at the updates one step aggregates: refused at k = 1, accepted under
    FedBuff with a buffer it protects."""
    rc, err = _dry_run(tmp_path, capsys, extra + '[asynchronous]\nrule = "fedasync"\n')
    assert rc == 2 and len(err) == 1 and "k = 1 inputs" in err[0], err
    rc, err = _dry_run(tmp_path, capsys,
                       extra + '[asynchronous]\nrule = {name = "fedbuff", buffer = 4}\n')
    assert rc == 0, err
