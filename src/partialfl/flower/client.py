"""The ClientApp: one SuperNode serves the clients of its partition.

A SuperNode started with ``--node-config 'partition-id=P num-partitions=N'`` (the simulation
engine sets both) holds the clients :func:`~partialfl.flower.config.partition_clients` gives
partition P. It answers three message types:

* ``query.describe`` — its partition, client ids and example counts (and, when asked, the
  initial server model ``algorithm.init(problem, problem.init_theta(...)).theta``, exactly as the
  in-process simulator builds it);
* ``train`` — θ and a list of its client ids → ``algorithm.client_update(state, problem,
  cohort, RoundContext(seed, round))``: each client's personal parameters are re-initialised
  and fine-tuned *here* (stateless clients), and only the resulting
  :class:`~partialfl.types.ClientUpdates` goes back
  (:func:`~partialfl.flower.codec.encode_updates`);
* ``evaluate`` — θ → the personalized loss of its clients after fine-tuning w locally, as
  sums and counts over the node's clients only (no per-client value leaves the node).

The problem and algorithm are the run spec's stage, built by :mod:`partialfl.build` as
in-process (:func:`partialfl.flower.stage.node_parts`), and cached per process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from partialfl.algorithms.base import RoundContext, ServerState
from partialfl.build import allow_code
from partialfl.flower.codec import (
    decode_params,
    encode_updates,
    metric_names,
    params_to_record,
)
from partialfl.flower.config import (
    REPLY_FAULTS,
    STATEFUL,
    ConfigError,
    FlowerConfig,
    decode_spec,
    inject_faults,
    parse_fault_injection,
    parse_run_config,
    partition_clients,
)
from partialfl.flower.node import (
    check_code,
    check_node_data,
    kept_on_node,
    load_node_data,
    node_options,
    refuse_non_finite,
    screened,
    shared_values,
)
from partialfl.flower.secagg import is_secagg, node_contribution, secagg_mod
from partialfl.flower.stage import node_parts

#: rounds a message may name are below this (what the node's release ledger records)
MAX_ROUND = 10 ** 18


@dataclass
class NodeRuntime:
    """What one SuperNode holds for a run: its problem, algorithm and client ids."""

    cfg: FlowerConfig
    partition: int
    num_partitions: int
    problem: Any
    algorithm: Any
    clients: np.ndarray
    torch: bool
    theta0: Any = None  # the stage's initial θ (before ``algorithm.init``)
    theta_names: tuple[str, ...] = ()  # θ's leaves in the server's order
    theta_like: dict[str, tuple[str, tuple[int, ...]]] | None = None  # leaf -> (dtype, shape)
    eval_min_clients: int = 2  # the run config's, raised by the node's own floor
    noise_key: int | None = None  # local DP's noise key (:mod:`partialfl.flower.node`)
    noise_secret: bool = False  # the key is the node's own (not the run seed the server holds)
    sends_updates_only: bool = False  # local DP or the node's DP floor: no evaluation sums
    ledger: Any = None  # the node's ReleaseLedger (:mod:`partialfl.flower.ledger`), or None

    def check_theta(self, theta):
        """``theta`` (the server's) if its leaves are this run's θ⁰'s — names, dtypes and
        shapes — else a :class:`~partialfl.privacy.PrivacyError` naming the first that
        differs: a client computes at the server's θ, and another dtype (float128) would
        carry its update's bits below the reach of local DP's float64 noise."""
        from partialfl.privacy import PrivacyError

        like = self.theta_like or {}
        if set(theta) != set(like):
            raise PrivacyError(f"the server's θ has the leaves {sorted(theta)[:8]}, not this "
                               f"run's θ {sorted(like)[:8]}")
        for n, v in theta.items():
            if (str(v.dtype), tuple(v.shape)) != like[n]:
                raise PrivacyError(f"the server's θ leaf {n!r} is {v.dtype} "
                                   f"{list(v.shape)[:8]}; this run's θ is {like[n][0]} "
                                   f"{list(like[n][1])[:8]}")
        return theta

    def context(self, round_: int, cohort: np.ndarray = ()) -> RoundContext:
        """What the node's client updates know of round ``round_``: the run seed and the
        node's own noise key (never sent). A round asked again (a resend, or a server
        replaying round r at another θ to subtract the two replies: the same noise would
        cancel, leaving the exact difference of the clipped updates) draws its noise from a
        fresh secret, so no noise is released twice; a key that is the run seed repeats the
        in-process run instead (the server could regenerate it anyway). What was answered is
        remembered per (key, round) for the process (:data:`_ANSWERED`), not per cached
        runtime: a message under another run config rebuilt the runtime and emptied it; with
        the node's ledger, on its disk, across processes — where the ``cohort``'s releases
        are also counted and capped (refused: ConfigError)."""
        import secrets

        if isinstance(round_, bool) or not isinstance(round_, int | np.integer) or \
                not -1 <= round_ < MAX_ROUND:  # the ledger records rounds of ≤ 18 digits
            raise ValueError(f"round {round_!r} is not an integer in [-1, {MAX_ROUND})")
        if not len(cohort):  # nothing is released: nothing to count or to draw afresh
            return RoundContext(self.cfg.seed, round_, noise_key=self.noise_key)
        from partialfl.flower.dp_policy import check_round

        with kept_on_node(self.partition, "client_update"):  # past the DP budget: refused,
            check_round(self.algorithm, round_)  # before the ledger records the request
        if self.ledger is not None:
            n = self.ledger.request(self.noise_key, round_, [int(c) for c in cohort])
        else:
            n = _ANSWERED.get((self.noise_key, round_), 0)
            _ANSWERED[(self.noise_key, round_)] = n + 1
        key = secrets.randbits(63) if n and self.noise_secret else self.noise_key
        return RoundContext(self.cfg.seed, round_, noise_key=key)

    def check_clients(self, cohort: np.ndarray) -> np.ndarray:
        """``cohort`` if this SuperNode holds every client in it, else a ValueError naming them."""
        foreign = np.setdiff1d(cohort, self.clients)
        if foreign.size:
            raise ValueError(
                f"partition {self.partition} holds clients {self.clients.min()}.."
                f"{self.clients.max()}, was asked for {foreign.tolist()}"
            )
        return cohort


_CACHE: dict[tuple, NodeRuntime] = {}
#: (noise key, round) → train requests this process answered with that key (see
#: :meth:`NodeRuntime.context`; kept when the cached runtime is replaced)
_ANSWERED: dict[tuple[int | None, int], int] = {}

#: ``(cfg, problem) -> Algorithm``: an algorithm built by code instead of by the spec
AlgorithmFactory = Callable[[FlowerConfig, Any], Any]


def _spec_dict(run_config: dict[str, Any]) -> dict[str, Any]:
    """The spec the run config names, as a plain dict (nothing imported); {} when it does
    not decode (parsing it then fails with its own message)."""
    try:
        return decode_spec(str(run_config.get("spec", "")), str(run_config.get("set", "")))
    except ConfigError:
        return {}


def node_runtime(context: Context, msg: Message | None = None,
                 algorithm_factory: AlgorithmFactory | None = None) -> NodeRuntime:
    """The (cached) runtime of this SuperNode: the run config is the one the server sent with
    the message (the server's validated copy of ``flwr run``'s config), else
    ``context.run_config``; the partition, whether code the spec names may be imported, the
    evaluation floor and the node's own data come from the SuperNode's node config and
    environment (:mod:`partialfl.flower.node`). The problem, algorithm and θ⁰ are the spec's
    stage (:func:`partialfl.flower.stage.node_parts`), or ``algorithm_factory(cfg, problem)``
    when given (programmatic use, e.g. an algorithm defined outside partialfl)."""
    if msg is not None and "run-config" in msg.content:
        raw = dict(msg.content["run-config"])
    else:
        raw = dict(context.run_config)
    opts = node_options(context.node_config)
    check_code(_spec_dict(raw), opts)  # before anything is imported or built from the spec
    with allow_code(opts.allow_imports):
        cfg = parse_run_config(raw)
        key = (tuple(sorted(cfg.to_run_config().items())), opts, algorithm_factory)
        rt = _CACHE.get(key)
        if rt is None:
            # a node store holds model data; a closed-form problem is generated from its seed
            if not cfg.closed_form and not opts.data and opts.guards_clients:
                raise ConfigError(
                    "SuperNode refuses the run: its own privacy settings (dp-ledger, "
                    "dp-min-noise, eval-min-clients) protect the clients of its own data "
                    "(node config 'data', a store written by `partialfl flower node-data`); "
                    "with the spec's [data] the server chooses which "
                    "clients the node holds and how they are numbered")
            data = load_node_data(opts.data) if opts.data and not cfg.closed_form else None
            with kept_on_node(opts.partition, "building the run's data and model",
                              passes=ConfigError):  # a loader's own check quotes data
                problem, algorithm, theta0 = node_parts(cfg, data)
            with kept_on_node(opts.partition, "the algorithm's set-up"):  # its code, its data
                if algorithm_factory is not None:
                    algorithm = algorithm_factory(cfg, problem)
                z = None
                if opts.min_noise is not None:
                    from partialfl.flower.dp_policy import local_noise_multiplier

                    z = float(local_noise_multiplier(algorithm, problem.num_clients))
                stateful = bool(getattr(algorithm, "stateful_clients", False))
                from partialfl.flower.dp_policy import local_dp

                updates_only = local_dp(algorithm) is not None or opts.min_noise is not None
            opts.check_noise(algorithm, problem.num_clients, z)  # before any client computes
            if stateful:
                raise ValueError(f"algorithm {cfg.run.method.algorithm!r} {STATEFUL}")
            clients = partition_clients(problem.num_clients, opts.num_partitions,
                                        opts.partition)
            if data is not None:
                check_node_data(data, clients)
            with kept_on_node(opts.partition, "algorithm.init"):
                init = algorithm.init(problem, theta0).theta
                names = tuple(init)
                like = {n: (str(v.dtype), tuple(v.shape)) for n, v in init.items()}
            rt = NodeRuntime(cfg, opts.partition, opts.num_partitions, problem, algorithm,
                             clients, torch=not cfg.closed_form, theta0=theta0,
                             theta_names=names, theta_like=like,
                             eval_min_clients=max(cfg.eval_min_clients, opts.eval_min_clients),
                             noise_key=opts.local_noise_key(cfg.seed),
                             noise_secret=opts.noise_key != "seed",
                             ledger=opts.release_ledger(), sends_updates_only=updates_only)
            _CACHE.clear()  # one run per process at a time
            _CACHE[key] = rt
    return rt


def _units(rt: NodeRuntime) -> list[float]:
    with kept_on_node(rt.partition, "counting the evaluation units"):
        return eval_units(rt)


def describe(rt: NodeRuntime, msg: Message) -> Message:
    """Partition facts; the node of partition ``init-partition`` also sends θ⁰."""
    info = ConfigRecord({
        "partition-id": rt.partition,
        "num-partitions": rt.num_partitions,
        "num-clients": int(rt.problem.num_clients),
        "clients": [int(c) for c in rt.clients],
        "num-examples": [float(x) for x in rt.problem.num_examples(rt.clients)],
        "eval-units": _units(rt),
        "torch": int(rt.torch),
    })
    content = RecordDict({"info": info})
    if int(msg.content["request"].get("init-partition", -1)) == rt.partition:
        with kept_on_node(rt.partition, "algorithm.init"):
            theta0 = rt.algorithm.init(rt.problem, rt.theta0).theta
        content["theta0"] = params_to_record(theta0)
    return Message(content, reply_to=msg)


def train(rt: NodeRuntime, msg: Message) -> Message:
    """One cohort's client updates at the θ the server sent (a SecAgg+ round: the node's
    combined contribution, :func:`partialfl.flower.secagg.node_contribution`)."""
    if is_secagg(msg):
        return node_contribution(rt, msg)
    task = msg.content["task"]
    r = int(task["round"])
    cohort = rt.check_clients(np.asarray(task["clients"], dtype=np.int64))
    inject_faults(rt.cfg.fault_injection, rt.partition, r)
    theta = rt.check_theta(decode_params(msg.content["theta"], rt.torch))
    ctx = rt.context(r, cohort)  # the node's own release policy may refuse (its message)
    with kept_on_node(rt.partition, "client_update"):
        state = ServerState(theta=theta, round=r, extra=shared_values(task, rt.algorithm))
        result = rt.algorithm.client_update(state, rt.problem, cohort, ctx)
        up = screened(rt, result.updates, theta, cohort)
    refuse_non_finite(rt.partition, up)  # a NaN's payload passes clipping and noise
    with kept_on_node(rt.partition, "client_update"):
        content = encode_updates(up, theta.keys(), metric_names(rt.algorithm))
    for f in parse_fault_injection(rt.cfg.fault_injection):
        if f.kind in REPLY_FAULTS and f.applies(rt.partition, r):
            hostile_reply(content, f.kind)
    return Message(content, reply_to=msg)


def hostile_reply(content: RecordDict, kind: str) -> None:
    """Testing (fault injection): make a train reply one the server must refuse — ``nan``
    weights, ``dtype``: the vectors in another float dtype than θ's, ``extra``: a record
    the algorithm does not declare (it crashed the ServerApp with a KeyError)."""
    vectors = {n: a.numpy() for n, a in content["vectors"].items()}
    if kind == "nan":
        content["update"]["weights"] = [float("nan")] * len(content["update"]["weights"])
    elif kind == "dtype":
        content["vectors"] = params_to_record({n: v.astype(
            np.float32 if v.dtype == np.float64 else np.float64) for n, v in vectors.items()})
    elif kind == "extra":
        content["extra.aux"] = params_to_record(vectors)


def evaluate(rt: NodeRuntime, msg: Message) -> Message:
    """Personalized loss of this node's clients at θ (w fine-tuned here, never sent): sums
    over at least ``rt.eval_min_clients`` clients, or an empty record (withheld)."""
    task = msg.content["task"]
    theta = rt.check_theta(decode_params(msg.content["theta"], rt.torch))
    with kept_on_node(rt.partition, "evaluation"):
        state = ServerState(theta=theta, round=int(task["round"]),
                            extra=shared_values(task, rt.algorithm))
        sums = evaluate_clients(rt, state)
    return Message(RecordDict({"eval": MetricRecord(sums)}), reply_to=msg)


def make_client_app(algorithm_factory: AlgorithmFactory | None = None) -> ClientApp:
    """The ClientApp answering ``query.describe``, ``train`` and ``evaluate`` (see the module
    docstring); ``algorithm_factory(cfg, problem)`` replaces the run config's algorithm."""
    app = ClientApp(mods=[secagg_mod])

    @app.query("describe")
    def _describe(msg: Message, context: Context) -> Message:
        return describe(node_runtime(context, msg, algorithm_factory), msg)

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        return train(node_runtime(context, msg, algorithm_factory), msg)

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        return evaluate(node_runtime(context, msg, algorithm_factory), msg)

    return app


app = make_client_app()


def eval_units(rt: NodeRuntime) -> list[float]:
    """What this node's evaluations will weigh, declared once when it describes itself:
    ``[Σ total, Σ loss weight]`` over its clients' test data (examples or tokens; counted by
    one forward pass at θ⁰ — losses and metrics weigh by data, not by parameters). The server
    refuses an evaluation reply whose ``total.sum`` or ``loss_weight.sum`` exceeds them, so
    one node cannot outweigh the others' evaluations by claiming a huge weight. ``[0, 0]``
    for least squares (unweighted) and when the node withholds its evaluation (fewer than
    ``rt.eval_min_clients`` clients with test data, or a node that sends only local-DP
    updates): nothing about fewer clients is sent."""
    if not rt.torch or rt.sends_updates_only:
        return [0.0, 0.0]
    from partialfl.flower.models import count_sums

    own = rt.clients
    theta = rt.algorithm.init(rt.problem, rt.theta0).theta
    w = rt.problem.init_w(own, "pretrained", rt.cfg.seed, 0)
    sums = count_sums(rt.problem.metric_counts(own, theta, w, "test"), rt.eval_min_clients)
    return [float(sums.get("total.sum", 0.0)), float(sums.get("loss_weight.sum", 0.0))]


def evaluate_clients(rt: NodeRuntime, state: ServerState) -> dict[str, Any]:
    """Sums over this node's clients at the server's state (θ, the round and the numbers its
    clients read; the server adds all nodes' sums): least squares
    ``clients``, ``loss.sum`` = Σ_m f_m(θ, w_m) and ``loss-gap.sum`` = Σ_m (f_m − min f_m);
    model problems see :func:`~partialfl.flower.models.evaluate_model_clients`. w_m is what
    the algorithm deploys, computed here and never sent; no per-client value is sent, and
    nothing at all (``{}``) when the node holds fewer than ``rt.eval_min_clients`` clients,
    or its clients send only noised updates (local DP, or the node's ``dp-min-noise``
    floor: the DP guarantee counts no other release)."""
    if rt.sends_updates_only:  # exact sums at any θ, as often as asked: past the DP budget
        return {}
    if rt.torch:
        from partialfl.flower.models import evaluate_model_clients

        return evaluate_model_clients(rt, state)
    own = rt.clients
    if len(own) < rt.eval_min_clients:
        return {}
    dep = rt.algorithm.deploy(state, rt.problem, own, None, RoundContext(rt.cfg.seed, -1))
    th, w = dep.theta, dep.w
    loss = np.asarray(rt.problem.loss(own, th, w), dtype=np.float64)
    out = {"clients": float(len(own)), "loss.sum": float(loss.sum())}
    if hasattr(rt.problem, "f_star"):
        out["loss-gap.sum"] = float((loss - rt.problem.f_star()[own]).sum())
    return out


__all__ = ["AlgorithmFactory", "NodeRuntime", "app", "eval_units", "evaluate_clients",
           "make_client_app", "node_runtime"]
