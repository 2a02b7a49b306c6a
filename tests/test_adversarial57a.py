"""Adversarial round 57a (issue 21, areas 2, 5 and 6 on Flower, tried again from scratch by
someone who did not write the fixes, against 497a5b3: the code of round 56a's fixes —
:func:`partialfl.flower.node.screened` and ``shared_values``,
:func:`partialfl.flower.rounds.shared_entries`, :func:`partialfl.flower.secagg.check_nodes`
and the shared numbers in SecAgg+'s FitIns config —, plugin algorithms and aggregators, DP
and SecAgg+ on Flower, a hostile server's messages to an honest SuperNode). Each test failed
on that code because of the defect it names, and passes since the fix: ``check_nodes``
refuses ``N·2^bits ≥ 2^32``; evaluate messages carry the ``shared_extra`` numbers and the
node deploys at that state (:func:`partialfl.flower.evaluate.eval_items`,
:func:`partialfl.flower.client.evaluate_clients`); a SecAgg+ round's ``grad_evals`` is the
most any node reports (per client, as ``concat_results``), not their sum.

* Area 2 (SecAgg+ stages), round 56a's modulus check is one quantisation level short: the
  masked sum still wraps around Flower's 2^32 modulus at exactly ``N = 2^(32 − bits)``
  SuperNodes. :func:`partialfl.flower.secagg.check_nodes` refuses ``N·(2^bits − 1) ≥ 2^32``,
  i.e. it takes a node's quantised value to lie in ``[0, 2^bits − 1]``; but Flower's
  ``quantize`` maps ``[-c, c]`` onto ``[0, 2^bits]`` — ``(clip(x) + c)·2^bits/(2c)``, a
  coordinate at ``+c`` (clipped, or exactly ``c``) is ``2^bits``, 2^bits + 1 levels — so
  ``N`` nodes sum to at most ``N·2^bits``, which equals the modulus at ``N = 256`` for
  ``secagg-bits = 24`` (1024 at the default 22). Seen with 256 loopback SuperNodes, one
  client each, all sampled, a plugin algorithm (FFGG-like toy of ``tests/toy_plugin.py``
  whose clients send the update 1 on every coordinate: mean-only, accepted by
  ``secagg.check_algorithm``), ``secagg-clip = 1e-3`` so that every node's scaled update
  ``1/256`` is clipped to ``+c``: the 256 values ``2^24`` sum to ``2^32 ≡ 0`` and θ after
  the round is ``[+0.001628, +0.001628]`` — the clipped aggregate with its sign flipped
  (255 nodes: ``[-0.001607, …]``; plain Flower over the 256: ``[-0.00636, …]``, i.e. the
  clipped aggregate ``256·c`` gives ``−0.001628``). ``server_steps = 1``, no failure, no
  warning — the silent wrong θ round 56a's fix was meant to rule out. Suspected root
  cause: ``check_nodes`` (the bound should be ``N·2^bits ≥ 2^32``, or Flower's
  ``quantization_range`` passed as ``2^bits − 1``).

* Area 2, the numbers of the server state the clients read (``shared_extra``) are sent with
  θ in a train message (round 56a's fix, plain and SecAgg+) but not in an ``evaluate``
  message, which sends the nodes θ too: :func:`partialfl.flower.evaluate.eval_items` sends
  only θ and the round, and the node's :func:`partialfl.flower.client.evaluate_clients`
  (and ``models.evaluate_model_clients``) deploys at ``ServerState(theta=θ, round=r)``
  without ``extra``. A plugin algorithm whose clients take as many w steps as a server
  counter says (``shared_extra = ("steps_now",)``, read by ``client_update`` AND by
  ``deploy``: the model it deploys is the one its clients train) trains on 3 loopback
  SuperNodes (least squares, ``eval_every = 1``, ``eval-min-clients = 1``), but every
  evaluation of every node fails: ``eval-error`` "evaluation failed on the node
  (KeyError)", 12 of 12, and no ``eval_loss`` / ``eval_loss_gap`` is ever recorded; in
  process ``deploy`` gets the whole state and the run records ``loss_gap`` 29.85, 2.19,
  0.83, 0.68. ``Algorithm.shared_extra`` says "a transport that sends the clients θ sends
  these too". Suspected root cause: ``eval_items`` (no
  :func:`~partialfl.flower.rounds.shared_entries` in its task record) and
  ``client.evaluate`` (no :func:`~partialfl.flower.node.shared_values` into the deployed
  state).

* Area 2 (SecAgg+ stages), a SecAgg+ round counts the local gradient evaluations once per
  SuperNode: ``grad_evals`` is "local gradient computations per client spent on this
  update" (:class:`partialfl.types.ClientUpdates`), merged over a round's replies by
  ``concat_results`` as the max (in process and on plain Flower), but
  :func:`partialfl.flower.secagg.secagg_round` adds the nodes' ``grad-evals`` up. The
  paper's Example 1 (FFGG, CG with τ = 5: 6 per client and round; 3 loopback SuperNodes, 3
  rounds): the history's ``grad_evals`` is ``[0, 6, 12, 18]`` on plain Flower (18 in
  process) but ``[0, 18, 36, 54]`` under SecAgg+; with 2 clients per round ``[0, 6, 18,
  30]`` — the number of nodes that happened to hold a sampled client. Every curve against
  local gradient evaluations of a SecAgg+ run is stretched by a factor that changes from
  round to round. Suspected root cause: ``secagg_round``'s ``grads = int(sum(...))`` (the
  max, as ``concat_results``).

Tried and held (run unless marked "read"): plugin algorithms on plain Flower with the toy's
``drop-largest`` aggregation rule (θ equal to in process) and refused under SecAgg+ in one
line; DP over the plugin toy on Flower — central (θ equal to in process), local with the
node key ``seed`` (equal), central under SecAgg+ (equal to ~1e-6), adaptive clipping
(central, the clip norm sent as a shared number: equal); SecAgg+ at 24 bits over 255 nodes
(no wrap: the clipped aggregate); DP central, adaptive and central under SecAgg+ with
``eval_every = 1`` (the nodes' ``eval_loss_gap`` equals the in-process ``loss_gap``);
``weighting = "examples"`` under SecAgg+ with unequal client sizes (θ equal to plain Flower
to ~1e-5); SecAgg+ against plain Flower record by record (only ``grad_evals`` differs, see
above); the asynchronous ServerApp (FedAsync) against in process: ``grad_evals`` and the
evaluations equal; (read) the node-side DP noise streams (``rng.seed_sequence`` with a round
path cannot alias another client's or round's noise; a negative round is refused by
``_purpose_int`` after the ledger counted it: conservative); (read) the reply faults a
hostile server's ``fault-injection`` can ask of a node (``nan``, ``dtype``, ``extra``:
copies or casts of what is sent anyway); (read) Flower's ``quantize`` / ``dequantize`` and
the weight factor (Σ of the nodes' quantised weights stays ≈ ``2^bits``); a shared number's
name with spaces, slashes or non-ASCII letters (a ConfigRecord key as any other).
"""

from __future__ import annotations

import textwrap

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import importable, in_process, ls_run, quiet  # noqa: E402

CONST = textwrap.dedent('''
    from dataclasses import dataclass

    import numpy as np

    from partialfl.algorithms.base import ClientResult
    from partialfl.registry import option, register
    from partialfl.types import ClientUpdates
    from toy_plugin import Toy


    class ToyConst(Toy):
        """The toy whose every client sends the update 1 on every coordinate of θ."""

        name = "toyconst57a"

        def client_update(self, state, problem, cohort, ctx, client_state=None):
            g = {n: np.ones((len(cohort), *np.shape(v)), np.asarray(v).dtype)
                 for n, v in state.theta.items()}
            return ClientResult(ClientUpdates(g, np.ones(len(cohort)), np.asarray(cohort), 1))


    @dataclass(frozen=True)
    class Opts:
        steps: int = option(3, "GD steps on w")
        lr: float = option(0.05, "their stepsize")


    @register("algorithm", "toyconst57a", options=Opts, split="personal", sends="gradient")
    def _const(opts, ctx):
        return ToyConst(opts.steps, opts.lr, ctx.server_opt, ctx.aggregator)
''')


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    with importable(tmp_path_factory.mktemp("plugin57a"), advconst57a=CONST):
        yield "advconst57a"


def _const_run(loopback, monkeypatch, nodes: int, **flower):  # noqa: F811
    from partialfl.flower.server import run_server

    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")  # the server's user's own opt-in
    spec = {"problem": {"num_clients": nodes, "n": 2 * nodes, "d_theta": 2, "d_w": 1},
            "plugins": ["advconst57a"], "method": {"algorithm": "toyconst57a"}}
    run = ls_run(1, None, spec=spec, **flower)
    run["spec"]["method"].pop("w_init")  # the toy has no w_init option
    return quiet(run_server, loopback(nodes, node_config={"allow-imports": True}), run)


SECAGG = {"secagg": True, "secagg_bits": 24, "secagg_clip": 1e-3}


def test_control_secagg_at_24_bits_over_255_nodes_is_the_clipped_mean(plugin, loopback,  # noqa: F811
                                                                      monkeypatch):
    import numpy as np

    plain = _const_run(loopback, monkeypatch, 255)
    sec = _const_run(loopback, monkeypatch, 255, **SECAGG)
    assert sec.server_steps == 1 and not sec.failures
    # every node's update 1/255 clipped to c: the aggregate is 255·c instead of 1
    np.testing.assert_allclose(np.asarray(sec.theta["theta"]),
                               255 * 1e-3 * np.asarray(plain.theta["theta"]), rtol=1e-3)


def test_secagg_at_24_bits_over_256_nodes_never_wraps(plugin, loopback,  # noqa: F811
                                                      monkeypatch):
    """Found: θ after the round ``[+0.001628, +0.001628]``, the clipped aggregate
    (``−0.001628``) with its sign flipped; ``server_steps = 1``, no failure. Expected: the
    configuration refused in one line (``ConfigError``: at most 23 bits for 256 nodes), or
    the clipped aggregate."""
    import numpy as np

    from partialfl.flower.config import ConfigError

    plain = _const_run(loopback, monkeypatch, 256)
    try:
        sec = _const_run(loopback, monkeypatch, 256, **SECAGG)
    except ConfigError:
        return  # refused up front: acceptable
    assert sec.server_steps == 1 and not sec.failures
    np.testing.assert_allclose(np.asarray(sec.theta["theta"]),
                               256 * 1e-3 * np.asarray(plain.theta["theta"]), rtol=1e-3)


# -- a plugin whose deployed model reads a shared number of the server state -----------------

DEPLOY = textwrap.dedent('''
    from dataclasses import dataclass

    import numpy as np

    from partialfl.algorithms.base import ClientResult, Deployed
    from partialfl.registry import option, register
    from partialfl.types import ClientUpdates
    from toy_plugin import Toy


    class ToyCounted(Toy):
        """The toy whose clients take as many w steps as the server's counter says, in
        training and in the model it deploys."""

        name = "toydeploy57a"
        shared_extra = ("steps_now",)

        def init(self, problem, theta0):
            s = super().init(problem, theta0)
            s.extra["steps_now"] = 1
            return s

        def _wk(self, problem, cohort, theta, seed, k):
            w = problem.init_w(cohort, "zero", seed, -1)
            for _ in range(k):
                g = problem.grad_w(cohort, theta, w)
                w = {n: (v - self.lr * g[n]) if n in g else v for n, v in w.items()}
            return w

        def client_update(self, state, problem, cohort, ctx, client_state=None):
            k = state.extra["steps_now"]
            w = self._wk(problem, cohort, state.theta, ctx.seed, k)
            g = problem.grad_theta(cohort, state.theta, w)
            return ClientResult(ClientUpdates(g, np.ones(len(cohort)), np.asarray(cohort),
                                              k + 1))

        def server_update(self, state, updates, ctx):
            s = super().server_update(state, updates, ctx)
            s.extra["steps_now"] = state.extra["steps_now"] + 1
            return s

        def deploy(self, state, problem, cohort, client_state, ctx):
            return Deployed(state.theta, self._wk(problem, cohort, state.theta, ctx.seed,
                                                  state.extra["steps_now"]))


    @dataclass(frozen=True)
    class Opts:
        steps: int = option(3, "GD steps on w")
        lr: float = option(0.05, "their stepsize")


    @register("algorithm", "toydeploy57a", options=Opts, split="personal", sends="gradient")
    def _counted(opts, ctx):
        return ToyCounted(opts.steps, opts.lr, ctx.server_opt, ctx.aggregator)
''')


@pytest.fixture(scope="module")
def deploy_plugin(tmp_path_factory):
    with importable(tmp_path_factory.mktemp("deploy57a"), advdeploy57a=DEPLOY):
        yield "advdeploy57a"


def _deploy_run() -> dict:
    run = ls_run(3, None, eval_every=1, spec={"plugins": ["advdeploy57a"],
                                              "method": {"algorithm": "toydeploy57a"}},
                 eval_min_clients=1)
    run["spec"]["method"].pop("w_init")  # the toy has no w_init option
    return run


def test_control_the_deploy_plugin_evaluates_in_process(deploy_plugin, monkeypatch):
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")
    _, res = in_process(_deploy_run())
    assert res.state.round == 3 and all("loss_gap" in h for h in res.history)


def test_a_shared_extra_reaches_the_nodes_evaluation(deploy_plugin, loopback,  # noqa: F811
                                                     monkeypatch):
    """Found: 3 server steps, but 12 of 12 evaluations ``eval-error`` "partition P: evaluation
    failed on the node (KeyError)", no ``eval_loss_gap`` recorded. Expected: the nodes'
    evaluation at the state the in-process run deploys (its ``loss_gap``)."""
    import numpy as np

    from partialfl.flower.server import run_server

    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")
    run = _deploy_run()
    _, ref = in_process(run)
    rep = quiet(run_server, loopback(3, node_config={"allow-imports": True}), run)
    assert rep.server_steps == 3
    assert not rep.failures, [(f.round, f.partition, f.kind, f.reason)
                              for f in rep.failures][:3]
    np.testing.assert_allclose([h["eval_loss_gap"] for h in rep.history],
                               [h["loss_gap"] for h in ref.history], rtol=1e-6)


# -- SecAgg+ and the count of local gradient evaluations -------------------------------------


@pytest.mark.parametrize("k", [None, 2], ids=["all", "k2"])
def test_secagg_counts_gradient_evaluations_as_plain_flower(loopback, k):  # noqa: F811
    """Found: ``grad_evals`` ``[0, 18, 36, 54]`` under SecAgg+ (all clients; ``[0, 6, 18, 30]``
    with 2 per round) where plain Flower records ``[0, 6, 12, 18]`` (in process: 18 after 3
    rounds). Expected: the same count as plain Flower."""
    from partialfl.flower.server import run_server

    plain = quiet(run_server, loopback(3), ls_run(3, k))
    sec = quiet(run_server, loopback(3), ls_run(3, k, secagg=True, secagg_clip=64.0,
                                                 secagg_bits=22))
    assert not plain.failures and not sec.failures
    assert [h["grad_evals"] for h in sec.history] == [h["grad_evals"] for h in plain.history]
