"""SecAgg+ of θ (issue 27 item 3) in one process (the loopback grid: Flower's SecAgg+ workflow
on the ServerApp, Flower's secaggplus_mod on every ClientApp, no Ray): θ is the plain run's
within the stated quantisation error, the server applies one row per round — the mean — and
no individual update reaches it; specs and algorithms that need individual updates are
refused with one line. The live run (3 SuperNodes, TLS) is in test_flower_live.py."""

from __future__ import annotations

import numpy as np
import pytest
from _flower_sims import in_process, ls_run

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from partialfl.flower.config import ConfigError, parse_run_config  # noqa: E402
from partialfl.flower.secagg import check_algorithm, quantisation_bound  # noqa: E402

FEDAVG = {"method": {"algorithm": "fedavg", "weighting": "examples"},
          "personalize": {"client": {"name": "gd", "tau": 5}}}


def _recording_factory(rows: list):
    """The spec's algorithm, its server step recording the number of update rows it was
    given and how many distinct ones."""
    def factory(cfg, problem):
        from partialfl.build import build

        alg = build(cfg.run).algorithm
        step = alg.server_update

        def server_update(state, updates, ctx):
            v = np.concatenate([np.asarray(x).reshape(len(updates.cohort), -1)
                                for x in updates.vectors.values()], 1)
            rows.append((len(updates.cohort), len(np.unique(v, axis=0))))
            return step(state, updates, ctx)

        alg.server_update = server_update
        return alg

    return factory


def _wire(m) -> bytes:
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return b"".join(o.deflate() for o in get_all_nested_objects(m).values())


@pytest.mark.parametrize("spec", [{}, FEDAVG], ids=["ffgg", "fedavg-examples"])
def test_secagg_is_the_plain_run_within_the_quantisation_error(loopback, spec):
    from partialfl.flower.server import run_server

    run = ls_run(1, 5, spec=spec, secagg=True, secagg_clip=64.0)
    rows: list = []
    received: list = []
    rep = run_server(loopback(3), run, message_hook=received.append,
                     algorithm_factory=_recording_factory(rows))
    built, ref = in_process(run)
    assert rep.server_steps == 1 and not rep.failures
    cfg = parse_run_config(run)
    lr = built.algorithm.server_opt.lr
    # one round: θ¹ − θ¹_plain = −γ (aggregate − mean), below γ N·2c/2^bits per coordinate
    diff = {n: float(np.abs(rep.theta[n] - ref.state.theta[n]).max()) for n in rep.theta}
    assert 0 < max(diff.values()) <= lr * quantisation_bound(cfg, 3), diff
    assert rows == [(5, 1)]  # the server step saw the unmasked mean for each of the 5
    # more rounds: still the plain run up to the quantisation's effect
    longer = ls_run(3, 5, spec=spec, secagg=True, secagg_clip=64.0)
    rep3 = run_server(loopback(3), longer)
    _, ref3 = in_process(longer)
    assert max(float(np.abs(rep3.theta[n] - ref3.state.theta[n]).max())
               for n in rep3.theta) < 1e-3
    # no client's update, nor a node's plain partial sum, is in anything the server received
    from partialfl.algorithms.base import RoundContext
    from partialfl.runtime.sync import sample_cohort

    problem, alg = built.problem, built.algorithm
    state = alg.init(problem, problem.init_theta())
    cohort = sample_cohort(3, 0, 8, 5)
    up = alg.client_update(state, problem, cohort, RoundContext(3, 0)).updates
    values = [np.asarray(v) for t in up.vectors.values() for v in t]
    blobs = b"".join(_wire(m) for m in received if m.metadata.message_type == "train")
    assert blobs and not any(row[:4].tobytes() in blobs for row in values)
    plain: list = []
    run_server(loopback(3), {**run, "secagg": False}, message_hook=plain.append)
    blobs = b"".join(_wire(m) for m in plain if m.metadata.message_type == "train")
    assert any(row[:4].tobytes() in blobs for row in values)  # the check has teeth


def test_a_round_whose_clients_sit_on_one_node_still_needs_every_node(loopback):
    """One client per round: the other nodes take part with weight 0, so the protocol
    always has every node (a round of one node would give its update away)."""
    from partialfl.flower.server import run_server

    run = ls_run(4, 1, secagg=True, secagg_clip=64.0)
    received: list = []
    rep = run_server(loopback(3), run, message_hook=received.append)
    _, ref = in_process(run)
    assert rep.server_steps == 4 and not rep.failures
    assert np.abs(rep.theta["theta"] - ref.state.theta["theta"]).max() < 1e-3
    nodes = {m.metadata.src_node_id for m in received if m.metadata.message_type == "train"}
    assert len(nodes) == 3


@pytest.mark.parametrize("spec, match", [
    ({"asynchronous": {"rule": "fedasync"}}, r"\[asynchronous\] block needs each client"),
    ({"aggregation": {"name": "cm"}}, r"\[aggregation\] block needs each client"),
])
def test_specs_that_need_individual_updates_are_refused(spec, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_run_config(ls_run(2, spec=spec, secagg=True))
    assert "\n" not in str(e.value)


def test_algorithms_whose_server_step_needs_more_than_the_mean_are_refused():
    from partialfl.aggregation import CoordinateMedian
    from partialfl.build import build

    ok = build(parse_run_config(ls_run(2)).run).algorithm
    check_algorithm(ok)
    scaffold = build(parse_run_config(ls_run(2, spec={"method": {"algorithm": "scaffold"},
                                                      "personalize": {"client": {
                                                          "name": "gd", "tau": 3}}})).run
                     ).algorithm
    with pytest.raises(ConfigError, match="keeps client state"):
        check_algorithm(scaffold)
    ok.aggregator = CoordinateMedian()
    with pytest.raises(ConfigError, match="aggregates with CoordinateMedian"):
        check_algorithm(ok)


def test_secagg_needs_two_supernodes(loopback):
    from partialfl.flower.server import run_server

    with pytest.raises(ConfigError, match="at least 2 SuperNodes"):
        run_server(loopback(1), ls_run(1, secagg=True))
