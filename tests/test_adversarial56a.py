"""Adversarial round 56a (issue 21, areas 2, 5 and 6 on Flower, tried again from scratch by
someone who did not write the fixes, against a3ac3f9), entered through a researcher's OWN
algorithm (``plugins`` on the ServerApp with ``PARTIALFL_ALLOW_CODE=1``, on the SuperNodes
with ``allow-imports``), a hostile server's messages to an honest SuperNode and SecAgg+ over
many SuperNodes. Each test failed on the code it was written against because of the defect
it names, and passes since the fix: :func:`partialfl.flower.node.screened` keeps
client-side metrics on the node (as ``server_view`` in process); the ``shared_extra``
numbers travel with SecAgg+'s FitIns too, an int as an int
(:func:`partialfl.flower.rounds.shared_entries`, :func:`partialfl.flower.node.
shared_values`); :func:`partialfl.flower.secagg.check_nodes` refuses ``N·2^bits ≥ 2^32``
(57a: not ``N·(2^bits − 1)``) in one line, naming the bits the node count allows.

* Area 2/5, a plugin algorithm declaring a client-side metric never trains on Flower:
  :class:`partialfl.algorithms.base.Algorithm` documents ``client_metrics`` as "per-client
  scalar metrics beyond ``train_loss`` (kept on the client side)", and in process they are
  (:func:`partialfl.privacy.server_view` drops them; the run trains, exit 0). On Flower the
  node's :func:`partialfl.flower.codec.encode_updates` (and, under SecAgg+,
  :func:`partialfl.flower.secagg.node_contribution`) hands them to ``aggregate_metrics``
  with only ``ALLOWED_METRICS`` + ``server_metrics`` allowed, which raises ``PrivacyError:
  refusing to send metric 'w_norm'``: every SuperNode fails every update (3 loopback nodes,
  least squares, the toy FFGG of ``tests/toy_plugin.py`` logging ‖w_m‖): ``RunAborted: 12
  of 12 requested client updates failed``, plain and SecAgg+ alike. The privacy-safe
  behaviour is the in-process one: keep (drop) the metric on the node, send the rest.
  Suspected root cause: :func:`partialfl.flower.client.train` /
  :func:`~partialfl.flower.secagg.node_contribution` (no ``values_only``/``server_view``-like
  drop of client-side metrics before ``aggregate_metrics``).
* Area 2, a plugin algorithm's ``shared_extra`` (documented: "numbers of the server state
  the clients' update reads besides θ: a transport that sends the clients θ sends these
  too") is not what the clients read on Flower:

  - under SecAgg+ it is never sent: ``node_contribution`` builds ``ServerState(theta=θ,
    round=r)`` without ``extra`` (and ``secagg_round``'s FitIns config carries only round
    and clients), so a toy whose clients scale their update by ``state.extra["scale"]``
    (set in ``init``; the server step is the base one, so ``secagg.check_algorithm``
    accepts it) fails on every node with ``KeyError: 'scale'``: ``RunAborted: 24 of 24
    requested client updates failed``. Plain Flower matches the in-process θ exactly.
    Expected: sent (or the algorithm refused up front by ``check_algorithm``).
  - an integer arrives as a float: :func:`partialfl.flower.rounds.train_content` and
    :func:`partialfl.flower.client.train` both apply ``float(v)`` (a ConfigRecord carries
    ints), so a toy whose clients take ``range(state.extra["steps_now"])`` GD steps (a
    server counter) fails on every node with ``TypeError: 'float' object cannot be
    interpreted as an integer``; in process it trains.
* Area 2 (SecAgg+ stages), the masked sum wraps around Flower's modulus over many
  SuperNodes: ``secagg-bits`` is accepted in [8, 24] whatever the node count, and
  :func:`~partialfl.flower.secagg.secagg_round` runs Flower's ``SecAggPlusWorkflow`` with
  its default ``modulus_range`` 2^32. Each node's vector is quantised to [0, 2^bits) — a
  node without sampled clients sends 0, i.e. about 2^(bits-1) — and the server adds N of
  them modulo 2^32, which wraps once N·2^(bits-1) >= 2^32: from 512 nodes at 24 bits (1024
  at 23, 2048 at the default 22; derived, run at 24 bits only). Seen with 520 loopback
  SuperNodes (least squares, 2 clients per round, ``secagg-clip`` 1e4 so that nothing is
  clipped): θ after the round [16051.58, 16051.58] instead of plain Flower's [0.5085,
  0.5055] — ``server_steps = 1``, no failure, no warning (the same run at 22 bits agrees to
  1e-5; 600 nodes at 24 bits with d_θ = 10: θ ≈ 4057). The module docstring's bound "a
  round's aggregate is off by less than N·2c/2^bits" does not hold. Flower's own warning
  compares ``num_shares`` (not the node count) with ``modulus_range / quantization_range``.
  Suspected root cause: :func:`partialfl.flower.server.run_server` / ``secagg_round`` (no
  check of ``len(fed.order) · 2^secagg-bits`` against the modulus, nor a modulus or bits
  chosen from the node count).

Tried and held (run unless marked "read"): a hostile server's train messages to honest
local-DP nodes (floor ``dp-min-noise``): a cohort naming one client twice (identical rows:
per-client batches and noise are keyed by client id; a round asked again draws fresh
noise), an empty cohort, round −1 and 10^17 (refused on the node, the text kept there);
plugin algorithms on Flower with θ-shaped ``extra_names`` and with ``server_metrics`` (θ
equals the in-process one, sync; async FedAsync finishes), a float ``shared_extra`` under
plain Flower and FedAsync (θ equal to in process), a plugin's state extra across a Flower
checkpoint/resume (stop after round 1, resumed: θ equal to the uninterrupted run); SecAgg+
over 20–520 honest nodes at 16–23 bits (differences from plain Flower only where
``secagg-clip`` clips, documented); weighting ``examples`` with DP under SecAgg+ (refused
by the DP wrapper in one line); (read) ``code_refs`` and the inner ``allow_code`` gate
(a spec given as a dict or naming code through ``set`` still refused on a node; the
registry imports providers and entry points only; ``data.partition`` names fixed Flower
classes); (read) node-side writes: only the node's own ledger (``out-dir``, ``audit-dir``
are the server's); (read) ``eval-min-clients`` 1 in the server's run config with the node's
default floor 1 (a node without DP sends per-client updates anyway; the floor is the
operator's); (read) ``write_node_stores`` keeps other partitions' clients as empty arrays
of the right trailing shape (a transformer's ``seq_len`` from client 0 holds on every
node); (read) the evaluation decoder's bounds (counts, units, correct <= total).
"""

from __future__ import annotations

import textwrap

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import importable, in_process, ls_run, quiet  # noqa: E402

# -- a plugin algorithm declaring a client-side metric ---------------------------------------

PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass

    import numpy as np

    from partialfl.algorithms.base import ClientResult
    from partialfl.registry import option, register
    from partialfl.types import ClientUpdates
    from toy_plugin import Toy


    class ToyMetric(Toy):
        """The toy FFGG, logging each client's ||w_m|| on the client side."""

        name = "toymetric56a"
        client_metrics = ("w_norm",)  # "per-client scalar metrics ... (kept on the client side)"

        def client_update(self, state, problem, cohort, ctx, client_state=None):
            w = self._w(problem, cohort, state.theta, ctx.seed)
            g = problem.grad_theta(cohort, state.theta, w)
            norms = np.sqrt(sum((np.asarray(v, np.float64).reshape(len(cohort), -1) ** 2).sum(1)
                                for v in w.values()))
            return ClientResult(ClientUpdates(g, np.ones(len(cohort)), np.asarray(cohort),
                                              self.steps + 1, {"w_norm": norms}))


    @dataclass(frozen=True)
    class Opts:
        steps: int = option(3, "GD steps on w")
        lr: float = option(0.05, "their stepsize")


    @register("algorithm", "toymetric56a", options=Opts, split="personal", sends="gradient")
    def _toymetric(opts, ctx):
        return ToyMetric(opts.steps, opts.lr, ctx.server_opt, ctx.aggregator)
''')


SHARED = textwrap.dedent('''
    from dataclasses import dataclass

    import numpy as np

    from partialfl.algorithms.base import ClientResult
    from partialfl.registry import option, register
    from partialfl.types import ClientUpdates
    from toy_plugin import Toy


    class ToyScaled(Toy):
        """The toy whose clients scale their gradient by a number of the server state
        (``shared_extra``: "numbers of the server state the clients' update reads besides
        θ: a transport that sends the clients θ sends these too")."""

        name = "toyscaled56a"
        shared_extra = ("scale",)

        def init(self, problem, theta0):
            s = super().init(problem, theta0)
            s.extra["scale"] = 0.5
            return s

        def client_update(self, state, problem, cohort, ctx, client_state=None):
            up = super().client_update(state, problem, cohort, ctx, client_state).updates
            c = state.extra["scale"]
            return ClientResult(ClientUpdates({n: v * c for n, v in up.vectors.items()},
                                              up.weights, up.cohort, up.grad_evals))


    class ToyCounted(Toy):
        """The toy whose clients take as many w steps as the server's round counter says
        (an integer of the server state the clients read)."""

        name = "toycounted56a"
        shared_extra = ("steps_now",)

        def init(self, problem, theta0):
            s = super().init(problem, theta0)
            s.extra["steps_now"] = 1
            return s

        def client_update(self, state, problem, cohort, ctx, client_state=None):
            k = state.extra["steps_now"]
            w = problem.init_w(cohort, "zero", ctx.seed, -1)
            for _ in range(k):
                g = problem.grad_w(cohort, state.theta, w)
                w = {n: (v - self.lr * g[n]) if n in g else v for n, v in w.items()}
            g = problem.grad_theta(cohort, state.theta, w)
            return ClientResult(ClientUpdates(g, np.ones(len(cohort)), np.asarray(cohort),
                                              k + 1))

        def server_update(self, state, updates, ctx):
            s = super().server_update(state, updates, ctx)
            s.extra["steps_now"] = state.extra["steps_now"] + 1
            return s


    @dataclass(frozen=True)
    class Opts:
        steps: int = option(3, "GD steps on w")
        lr: float = option(0.05, "their stepsize")


    @register("algorithm", "toyscaled56a", options=Opts, split="personal", sends="gradient")
    def _scaled(opts, ctx):
        return ToyScaled(opts.steps, opts.lr, ctx.server_opt, ctx.aggregator)


    @register("algorithm", "toycounted56a", options=Opts, split="personal", sends="gradient")
    def _counted(opts, ctx):
        return ToyCounted(opts.steps, opts.lr, ctx.server_opt, ctx.aggregator)
''')


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    with importable(tmp_path_factory.mktemp("plugin56a"), advplugin56a=PLUGIN,
                    advshared56a=SHARED):
        yield "advplugin56a"


def _plugin_run(secagg: bool, algorithm: str = "toymetric56a", k: int | None = 4) -> dict:
    flower = {"secagg": True, "secagg_clip": 64.0, "secagg_bits": 24} if secagg else {}
    run = ls_run(3, k, spec={"plugins": ["advplugin56a", "advshared56a"],
                             "method": {"algorithm": algorithm}}, **flower)
    run["spec"]["method"].pop("w_init")  # the toy has no w_init option
    return run


def test_control_the_plugin_trains_in_process(plugin, monkeypatch):
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")
    _, res = in_process(_plugin_run(False))
    assert res.state.round == 3


@pytest.mark.parametrize("secagg", [False, True], ids=["plain", "secagg"])
def test_a_plugin_with_a_client_side_metric_trains_on_flower(plugin, loopback,  # noqa: F811
                                                             monkeypatch, secagg):
    """Found: ``RunAborted: 12 of 12 requested client updates failed ...``; every node logs
    "refusing to send metric 'w_norm': only the metrics ['loss', 'train_loss'] may leave a
    client". Expected: the 3 rounds, the metric kept on the node (as in process)."""
    from partialfl.flower.server import run_server

    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")  # the server's user's own opt-in
    grid = loopback(3, node_config={"allow-imports": True})
    rep = quiet(run_server, grid, _plugin_run(secagg))
    assert rep.server_steps == 3 and not rep.failures, [
        (f.partition, f.kind, f.reason) for f in rep.failures][:3]


# -- a plugin algorithm whose clients read numbers of the server state (shared_extra) --------


@pytest.mark.parametrize("algorithm", ["toyscaled56a", "toycounted56a"])
def test_control_shared_extra_plugins_train_in_process(plugin, monkeypatch, algorithm):
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")
    _, res = in_process(_plugin_run(False, algorithm, None))
    assert res.state.round == 3


def test_control_a_shared_float_reaches_plain_flower_nodes(plugin, loopback,  # noqa: F811
                                                           monkeypatch):
    """Without SecAgg+ the float ``scale`` is sent with θ: θ after 3 rounds is the
    in-process one."""
    import numpy as np

    from partialfl.flower.server import run_server

    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")
    run = _plugin_run(False, "toyscaled56a", None)
    _, ref = in_process(run)
    rep = quiet(run_server, loopback(3, node_config={"allow-imports": True}), run)
    assert rep.server_steps == 3 and not rep.failures
    np.testing.assert_allclose(np.asarray(rep.theta["theta"]),
                               np.asarray(ref.state.theta["theta"]), rtol=1e-6)


def _shared_run(loopback, monkeypatch, secagg, algorithm):  # noqa: F811
    from partialfl.flower.server import run_server

    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")
    grid = loopback(3, node_config={"allow-imports": True})
    return quiet(run_server, grid, _plugin_run(secagg, algorithm, None))


def test_a_shared_extra_reaches_secagg_nodes(plugin, loopback, monkeypatch):  # noqa: F811
    """Found: ``RunAborted: 24 of 24 requested client updates failed``; every node logs
    "client_update failed: KeyError: 'scale'". Expected: the 3 rounds (or the algorithm
    refused by ``secagg.check_algorithm`` in one line, as for its other declarations)."""
    from partialfl.flower.config import ConfigError

    try:
        rep = _shared_run(loopback, monkeypatch, True, "toyscaled56a")
    except ConfigError:
        return  # refused up front: acceptable
    assert rep.server_steps == 3 and not rep.failures, [
        (f.partition, f.kind, f.reason) for f in rep.failures][:3]


def test_an_integer_shared_extra_stays_an_integer_on_flower(plugin, loopback,  # noqa: F811
                                                            monkeypatch):
    """Found: ``RunAborted: 24 of 24 requested client updates failed``; every node logs
    "TypeError: 'float' object cannot be interpreted as an integer". Expected: the 3 rounds,
    as in process (a ConfigRecord carries ints)."""
    rep = _shared_run(loopback, monkeypatch, False, "toycounted56a")
    assert rep.server_steps == 3 and not rep.failures, [
        (f.partition, f.kind, f.reason) for f in rep.failures][:3]


# -- SecAgg+ over many SuperNodes: the masked sum wraps around Flower's 2^32 modulus ---------


def _many_nodes(loopback, nodes: int, **flower):  # noqa: F811
    from partialfl.flower.server import run_server

    spec = {"problem": {"num_clients": nodes, "n": 2 * nodes, "d_theta": 2, "d_w": 1}}
    return quiet(run_server, loopback(nodes), ls_run(1, 2, spec=spec, **flower))


def test_control_secagg_over_520_nodes_at_22_bits_is_the_mean(loopback):  # noqa: F811
    import numpy as np

    plain = _many_nodes(loopback, 520)
    sec = _many_nodes(loopback, 520, secagg=True, secagg_bits=22, secagg_clip=1e4)
    assert sec.server_steps == 1 and not sec.failures
    np.testing.assert_allclose(np.asarray(sec.theta["theta"]),
                               np.asarray(plain.theta["theta"]), atol=1e-3)


def test_secagg_over_many_nodes_never_wraps_the_modulus(loopback):  # noqa: F811
    """Found: 520 loopback SuperNodes, least squares, 2 clients per round, ``secagg-bits =
    24``, ``secagg-clip = 1e4``: θ after the round is [16051.58, 16051.58] (plain Flower:
    [0.5085, 0.5055]); ``server_steps = 1``, no failure. Each node's vector is quantised to
    [0, 2^bits) — a node without sampled clients sends 0, i.e. 2^(bits-1) — and the server
    adds N of them modulo 2^32 (Flower's default ``modulus_range``): N·2^(bits-1) >= 2^32 from
    N = 512 nodes at 24 bits (1024 at 23, 2048 at the default 22). Expected: the
    configuration refused in one line (``ConfigError``) once the node count is known, or
    the bits lowered — never a silently wrong θ."""
    import numpy as np

    from partialfl.flower.config import ConfigError

    try:
        sec = _many_nodes(loopback, 520, secagg=True, secagg_bits=24, secagg_clip=1e4)
    except ConfigError:
        return  # refused up front: acceptable
    plain = _many_nodes(loopback, 520)
    assert np.abs(np.asarray(sec.theta["theta"]) - np.asarray(plain.theta["theta"])).max() < 0.05
