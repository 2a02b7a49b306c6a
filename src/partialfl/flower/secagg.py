"""Secure aggregation of θ with Flower's SecAgg+ (run-config ``secagg = true``).

Every synchronous round runs Flower's SecAgg+ protocol
(:class:`flwr.server.workflow.SecAggPlusWorkflow` on the ServerApp, Flower's ``secaggplus_mod``
on the ClientApp) over all SuperNodes: node i computes its sampled clients' updates (as
without SecAgg+), combines them into ``p_i = Σ_m a_m v_m / A_i`` with ``A_i = Σ_m a_m`` (``a_m``
the aggregator's weight: 1, or the client's example count under ``weighting = "examples"``) —
a node without sampled clients sends ``p_i = 0`` with weight 0 — and the mod sends ``p_i`` and
``A_i`` quantised and masked. The server unmasks only the sum and gets
``Σ_i A_i p_i / Σ_i A_i = Σ_m a_m v_m / Σ_m a_m``: the round's (weighted) mean of the updates,
which is all the server step of a mean-aggregating algorithm uses. It applies it with the
algorithm's own ``server_update`` as the row of every client whose update is in it (views of
one array: the server knows who took part, not what each sent); no individual update, and no
node's partial sum, is ever decoded on the server.

What the server still learns: the round's aggregate (hence θ), the cohort (it samples it) and
which nodes took part, each node's total weight ``A_i`` (the count of its sampled clients, or
their declared example counts) and its summed training loss and gradient count (sums over
its sampled clients, as without SecAgg+). With 2 SuperNodes a node that colludes with the
server learns the other's partial sum; SecAgg+ needs more, honest-majority nodes to mean more.

Cost and error: coordinates of ``A_i/A · p_i`` are clipped to ``[-c, c]`` (``secagg-clip``)
and stochastically rounded to ``2^bits`` levels (``secagg-bits``), so each node adds an error
below one step ``2c/2^bits`` per coordinate and a round's aggregate is off by less than
``N·2c/2^bits`` (N nodes; :func:`quantisation_bound`), θ after the round by less than the
server stepsize times that; later rounds carry the difference through the training
dynamics. The weights are quantised to the same resolution. A round costs four message
exchanges instead of one (setup, key sharing, masked vectors, unmasking) plus the key
agreement and masking on the nodes (docs/flower.md gives the measured per-round cost).

Only algorithms whose server step depends on the updates through the mean (and their number)
alone qualify (:func:`check_algorithm`: the base ``server_update`` with a mean aggregator, no
extra payload, no per-client metric read by the server, stateless clients — FFGG, FedAvg,
Local FFGG, FedProx, …; or a wrapper declaring ``mean_only`` around one: differential privacy
with a fixed clip norm, the clients clipping — and in local mode noising — before their node
combines them, the server adding the central noise to the unmasked sum). Robust aggregation,
the Byzantine attack and asynchronous rules need individual updates and are refused when the
run config is parsed (:mod:`partialfl.flower.config`), DP's adaptive clipping (it reads each
client's clipping bit) by :func:`check_algorithm`.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np

from partialfl.flower.config import ConfigError
from partialfl.flower.node import (
    ClientComputationError,
    kept_on_node,
    refuse_non_finite,
    screened,
    shared_values,
)


def check_algorithm(algorithm) -> None:
    """Refuse an algorithm whose server step needs more than the mean of the updates."""
    from partialfl.aggregation import Mean
    from partialfl.algorithms.base import Algorithm
    from partialfl.flower.codec import declared_extras

    name = getattr(algorithm, "name", type(algorithm).__name__)
    why = None
    if getattr(algorithm, "stateful_clients", False):
        why = "keeps client state"
    elif declared_extras(algorithm):
        why = f"sends extra payloads {sorted(declared_extras(algorithm))}"
    elif getattr(algorithm, "server_metrics", ()):
        why = (f"reads each client's {list(algorithm.server_metrics)} in its server step "
               "(DP's adaptive clipping: give a fixed clip_norm, or secagg = false)")
    elif getattr(algorithm, "mean_only", False) and hasattr(algorithm, "base"):
        return check_algorithm(algorithm.base)  # a wrapper whose step needs mean and count
    elif not isinstance(getattr(algorithm, "aggregator", None), Mean):
        why = f"aggregates with {type(getattr(algorithm, 'aggregator', None)).__name__}"
    elif type(algorithm).server_update is not Algorithm.server_update or \
            type(algorithm).aggregate is not Algorithm.aggregate:
        why = "has its own server step"
    if why:
        raise ConfigError(f"secagg: algorithm {name} {why}; SecAgg+ gives the server only the "
                          "mean of a round's updates (FFGG, FedAvg, Local FFGG, FedProx, and "
                          "DP with a fixed clip norm qualify)")


#: Flower's SecAgg+ masks and sums modulo this (its ``modulus_range``: the largest it allows)
MODULUS = 2 ** 32


def check_nodes(cfg, num_nodes: int) -> None:
    """Refuse a SecAgg+ configuration the federation's ``num_nodes`` SuperNodes cannot run
    exactly: fewer than 2 nodes, a threshold above the shares a node holds, or quantisation
    levels whose sum over the nodes reaches Flower's modulus (Flower quantises [-c, c] onto
    [0, 2^bits], so ``N·2^bits ≥ 2^32`` would wrap the unmasked sum into a wrong aggregate)."""
    if num_nodes < 2:
        raise ConfigError("secagg: SecAgg+ needs at least 2 SuperNodes (the sum of one "
                          "node's updates is that node's)")
    if cfg.secagg_threshold > min(cfg.secagg_shares, num_nodes):
        raise ConfigError(f"secagg-threshold {cfg.secagg_threshold}: more than the "
                          f"{min(cfg.secagg_shares, num_nodes)} shares each of the "
                          f"{num_nodes} SuperNodes can hold")
    if num_nodes * 2 ** cfg.secagg_bits >= MODULUS:
        most = int(np.log2((MODULUS - 1) / num_nodes))
        raise ConfigError(f"secagg-bits {cfg.secagg_bits}: the sum of {num_nodes} SuperNodes' "
                          f"values up to 2^{cfg.secagg_bits} reaches Flower's modulus 2^32 "
                          f"(the aggregate would wrap); allowed with {num_nodes} nodes: "
                          f"secagg-bits <= {most}")


def quantisation_bound(cfg, num_nodes: int) -> float:
    """Per coordinate and round, the largest difference between SecAgg+'s aggregate and the
    exact mean: N nodes' rounding (below one step 2c/2^bits each), ignoring the weights'
    rounding (relative 2^-bits)."""
    return num_nodes * 2 * cfg.secagg_clip / 2 ** cfg.secagg_bits


# ----------------------------------------------------------------------------- ClientApp
def secagg_mod(msg, ctx, call_next):
    """Flower's ``secaggplus_mod`` for the SecAgg+ rounds' messages (they carry its
    configuration record); every other message goes straight to the ClientApp."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if msg.metadata.message_type == "train" and RECORD_KEY_CONFIGS in msg.content:
        return secaggplus_mod(msg, ctx, call_next)
    return call_next(msg, ctx)


def is_secagg(msg) -> bool:
    """Whether a train message is the SecAgg+ round's (Flower's FitIns records)."""
    return "fitins.parameters" in msg.content


def node_contribution(rt, msg):
    """The node's reply in a SecAgg+ round: ``p_i`` and ``A_i`` (module docstring) as Flower's
    FitRes, which ``secaggplus_mod`` masks (and clears from the message) before it leaves."""
    import flwr.compat.common.recorddict_compat as compat
    from flwr.app import Message
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    from partialfl import arrays
    from partialfl.algorithms.base import ServerState
    from partialfl.flower.codec import aggregate_metrics

    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    values = parameters_to_ndarrays(ins.parameters)
    if len(values) != len(rt.theta_names):
        raise ValueError(f"SecAgg+ round sent {len(values)} θ leaves, the model has "
                         f"{len(rt.theta_names)}")
    theta = rt.check_theta({n: arrays.to_torch(v) if rt.torch else v
                            for n, v in zip(rt.theta_names, values)})
    r = int(ins.config["round"])
    cohort = rt.check_clients(np.asarray(json.loads(str(ins.config["clients"])),
                                         dtype=np.int64))
    metrics: dict[str, Any] = {"clients": len(cohort), "grad-evals": 0}
    p = [np.zeros(np.shape(v)) for v in values]
    weight = 0.0
    if len(cohort):
        from partialfl.flower.config import inject_faults

        inject_faults(rt.cfg.fault_injection, rt.partition, r)
        ctx = rt.context(r, cohort)  # the node's own release policy may refuse
        with kept_on_node(rt.partition, "client_update"):
            state = ServerState(theta=theta, round=r,
                                extra=shared_values(ins.config, rt.algorithm))
            up = screened(rt, rt.algorithm.client_update(state, rt.problem, cohort, ctx).updates,
                          theta, cohort)
            weighted = bool(rt.algorithm.aggregator.weighted)
            sums = aggregate_metrics(up.metrics)  # its refusal quotes a client-chosen name
        refuse_non_finite(rt.partition, up)  # the server cannot see rows
        a = (np.asarray(arrays.to_numpy(up.weights), dtype=np.float64)
             if weighted else np.ones(len(cohort)))
        bound = np.maximum(1.0, np.asarray(rt.problem.num_examples(cohort), np.float64))
        if not ((a >= 0) & (a <= bound)).all():  # what the server checks on a plain reply
            raise ClientComputationError(
                f"partition {rt.partition}: a client weight is outside [0, max(1, its "
                "examples)]; the node does not send its contribution")
        weight = float(a.sum())
        if weight > 0:
            p = [np.tensordot(a, np.asarray(arrays.to_numpy(up.vectors[n]), np.float64), 1)
                 / weight for n in rt.theta_names]
        metrics.update({"grad-evals": int(up.grad_evals), **sums})
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(p), int(round(weight)), metrics)
    return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)


# ----------------------------------------------------------------------------- ServerApp
class _Proxy:
    """What the workflow needs of a client proxy: its node id."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.cid = str(node_id)


class _Strategy:
    """The two Strategy calls the SecAgg+ workflow makes: which nodes train with what
    (every node, its part of the cohort), and the unmasked aggregate (kept here)."""

    def __init__(self, items: list[tuple[int, Any]]) -> None:
        self.items = items
        self.result: tuple[list[np.ndarray], dict[int, Any]] | None = None

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Proxy(n), fitins) for n, fitins in self.items]

    def aggregate_fit(self, server_round, results, failures):
        from flwr.common import parameters_to_ndarrays

        if results:
            agg = parameters_to_ndarrays(results[0][1].parameters)
            self.result = (agg, {p.node_id: fitres for p, fitres in results})
        return (results[0][1].parameters if results else None), {}


class _Manager:
    def __init__(self, n: int) -> None:
        self.n = n

    def num_available(self) -> int:
        return self.n


def check_reply(request, content, shapes: list[tuple[int, ...]], node: int | None = None
                ) -> None:
    """A SecAgg+ reply against the request it answers, before Flower's workflow reads it
    (which trusts every field: a missing record was a KeyError, an infinite ``grad-evals`` an
    OverflowError in the ServerApp): the stage's entries of the right types and lengths, public
    keys that load, destinations and share owners among the nodes the request named (a
    share-keys reply: to every neighbour but ``node`` itself, when given — a node that keeps
    its shares from some made the honest ones fail at unmask), masked
    vectors of θ's shapes (after the weight's) in an integer dtype and, with them, the node's
    counts (:data:`SECAGG_COUNTS`) and metric sums finite. Raises
    :class:`~partialfl.flower.codec.WireFormatError` only."""
    from flwr.common import bytes_to_ndarray
    from flwr.supercore.primitives.asymmetric import bytes_to_public_key

    from partialfl.flower.codec import _guard

    _guard("SecAgg+ reply", _check_reply, request, content, shapes, bytes_to_public_key,
           bytes_to_ndarray, node)


#: the integer counts of a node's SecAgg+ contribution (:func:`node_contribution`)
SECAGG_COUNTS = ("clients", "grad-evals")


def _check_reply(request, content, shapes, bytes_to_public_key, bytes_to_ndarray, node
                 ) -> None:
    from flwr.app import ConfigRecord
    from flwr.common.secure_aggregation.secaggplus_constants import (
        RECORD_KEY_CONFIGS,
        Key,
        Stage,
    )

    from partialfl.flower.codec import WireFormatError, _float, _int, _keys, _record

    asked = request[RECORD_KEY_CONFIGS]
    stage = asked[Key.STAGE]
    keys = _keys(content)
    got = _record(content, RECORD_KEY_CONFIGS, ConfigRecord, "SecAgg+")

    def entry(key: str, kind: type, n: int | None = None) -> list:
        v = got.get(key)
        if not isinstance(v, list) or not all(isinstance(x, kind) and not isinstance(x, bool)
                                              for x in v) or (n is not None and len(v) != n):
            raise WireFormatError(f"SecAgg+ {stage} reply entry {key!r} must be a list of "
                                  f"{'' if n is None else n} {kind.__name__}")
        return v

    def among(ids: list, allowed: set, what: str) -> None:
        if not set(ids) <= allowed or len(set(ids)) != len(ids):
            raise WireFormatError(f"SecAgg+ {stage} reply names {what} {sorted(ids)[:8]}, not "
                                  f"distinct ones of {sorted(allowed)[:8]}")

    if stage == Stage.SETUP:
        for key in (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2):
            if not isinstance(got.get(key), bytes):
                raise WireFormatError(f"SecAgg+ setup reply lacks its public key {key!r}")
            bytes_to_public_key(got[key])  # a key that does not load: refused here
        if got[Key.PUBLIC_KEY_1] == got[Key.PUBLIC_KEY_2]:  # every neighbour refuses them
            raise WireFormatError("SecAgg+ setup reply has two equal public keys")
    elif stage == Stage.SHARE_KEYS:
        dsts = entry(Key.DESTINATION_LIST, int)
        entry(Key.CIPHERTEXT_LIST, bytes, len(dsts))
        neighbours = {int(k) for k in asked.keys() if k != Key.STAGE}
        among(dsts, neighbours, "destinations")
        if node is not None and set(dsts) != neighbours - {node}:
            raise WireFormatError(f"SecAgg+ share_keys reply sends shares to {len(dsts)} of "
                                  f"its {len(neighbours - {node})} neighbours")
    elif stage == Stage.COLLECT_MASKED_VECTORS:
        masked = entry(Key.MASKED_PARAMETERS, bytes, len(shapes) + 1)
        for i, (b, want) in enumerate(zip(masked, [(1,), *shapes], strict=True)):
            x = bytes_to_ndarray(b)  # np.load(allow_pickle=False)
            if x.dtype.kind not in "iu" or tuple(x.shape) != tuple(want):
                raise WireFormatError(f"SecAgg+ masked vector {i} is {x.dtype} {x.shape}, "
                                      f"expected integers of shape {tuple(want)}")
        metrics = _record(content, "fitres.metrics", ConfigRecord, "SecAgg+")
        for k in SECAGG_COUNTS:
            _int(metrics.get(k), f"SecAgg+ reply {k!r}")
        for k, v in metrics.items():
            if k not in SECAGG_COUNTS:
                _float(v, f"SecAgg+ reply metric {k!r}")
        if keys - {RECORD_KEY_CONFIGS, "fitres.metrics", "fitres.num_examples",
                   "fitres.parameters", "fitres.status"}:
            raise WireFormatError(f"SecAgg+ reply records {sorted(keys)[:8]} are not a FitRes")
        # every FitRes record there and well-formed, as Flower's workflow reads them (else it
        # raises inside the workflow, and the round fails for every node)
        from flwr.compat.common.recorddict_compat import recorddict_to_fitres

        recorddict_to_fitres(content, keep_input=True)
    elif stage == Stage.UNMASK:
        nids = entry(Key.NODE_ID_LIST, int)
        entry(Key.SHARE_LIST, bytes, len(nids))
        among(nids, set(asked[Key.ACTIVE_NODE_ID_LIST]) | set(asked[Key.DEAD_NODE_ID_LIST]),
              "share owners")


class _LinkGrid:
    """``send_and_receive`` over the ServerApp's :class:`~partialfl.flower.federation.Link`
    (its polling, its message hook, the run config on every message); a reply that
    :func:`check_reply` refuses is kept from the workflow (to it, that node dropped out) and
    its reason kept in ``refused`` (node → reason), a node's error reply's in ``errors``."""

    def __init__(self, link, timeout: float, shapes: list[tuple[int, ...]]) -> None:
        self.link, self.timeout, self.shapes = link, timeout, shapes
        self.refused: dict[int, str] = {}
        self.errors: dict[int, str] = {}  # node → the reason of its error reply

    def send_and_receive(self, messages, *, timeout=None):
        from partialfl.flower.codec import WireFormatError

        # every message its own copy of the content (the workflow shares one record between
        # messages, and a node's mod consumes entries of it in place)
        items = [(m.metadata.dst_node_id, m.metadata.message_type, copy.deepcopy(m.content),
                  m.metadata.group_id) for m in messages]
        requests = [copy.deepcopy(m.content) for m in messages]
        ids, got = self.link.exchange(items, self.timeout if timeout is None else timeout)
        out = []
        for (node, *_), request, i in zip(items, requests, ids):
            reply = got.get(i)
            if reply is None:
                continue
            if reply.has_error():  # to the workflow a dropout; to the report the node's error
                self.errors[int(node)] = str(reply.error.reason)
            else:
                try:
                    check_reply(request, reply.content, self.shapes, int(node))
                except WireFormatError as e:
                    self.refused[int(node)] = str(e)
                    continue
            out.append(reply)
        return out


def _drop_unkeyed(state) -> None:
    """After SecAgg+'s setup and share-keys stages: a node that left before its key shares
    reached the others is no longer part of the round. Flower's workflow keeps it in
    ``sampled_node_ids`` (as dead), and at ``unmask`` asks the honest nodes for shares of it
    they never received: each fails (KeyError), and the whole round with them."""
    keep = set(state.active_node_ids)
    state.sampled_node_ids = keep
    for nid in list(state.nid_to_neighbours):
        if nid in keep:
            state.nid_to_neighbours[nid] &= keep
        else:
            del state.nid_to_neighbours[nid]


def _workflow(*args, **kw):
    """Flower's ``SecAggPlusWorkflow(*args, **kw)`` with :func:`_drop_unkeyed` after its two
    key stages."""
    from flwr.server.workflow import SecAggPlusWorkflow

    class Workflow(SecAggPlusWorkflow):
        def setup_stage(self, grid, context, state) -> bool:
            super().setup_stage(grid, context, state)
            _drop_unkeyed(state)
            return self._check_threshold(state)

        def share_keys_stage(self, grid, context, state) -> bool:
            super().share_keys_stage(grid, context, state)
            _drop_unkeyed(state)
            return self._check_threshold(state)

    return Workflow(*args, **kw)


def secagg_round(link, cfg, fed, state, cohort: np.ndarray, round_: int, algorithm, report,
                 faults, shared: dict[str, int | float] | None = None):
    """One SecAgg+ round over every SuperNode; returns ``(updates or None, clients whose
    updates are in the aggregate)``. Every one of those clients' rows is the round's mean
    (module docstring). Nodes that drop out are recorded as failures of their sampled
    clients. ``shared``: the ``extra.<name>`` numbers the clients read, sent with θ."""
    import flwr.compat.common.recorddict_compat as compat
    from flwr.app import ConfigRecord, Context, RecordDict
    from flwr.common import FitIns, ndarrays_to_parameters
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey

    from partialfl import arrays
    from partialfl.flower.report import record_failure
    from partialfl.types import ClientUpdates

    names = list(state.theta)
    values = [np.asarray(arrays.to_numpy(state.theta[n]), order="C") for n in names]  # (0-d too)
    params = ndarrays_to_parameters(values)
    pos = fed.owner[cohort]
    parts = {n: cohort[pos == i] for i, n in enumerate(fed.order)}
    items = [(n, FitIns(params, {"round": int(round_), **(shared or {}),
                                 "clients": json.dumps([int(c) for c in parts[n]])}))
             for n in fed.order]
    weighted = algorithm.aggregator.weighted
    total = float(fed.examples[cohort].sum()) if weighted else float(len(cohort))
    strategy = _Strategy(items)
    legacy = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(),
                                   run_config={}), strategy=strategy,
                           client_manager=_Manager(len(fed.order)))
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: int(round_)})
    legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        params, keep_input=True)
    grid = _LinkGrid(link, cfg.round_timeout, [np.shape(v) for v in values])
    try:
        # Flower forms odd neighbour groups when nodes outnumber the shares, but tells the
        # nodes the even count: every node then indexes past its shares (IndexError)
        shares = cfg.secagg_shares + (cfg.secagg_shares % 2 == 0
                                      and cfg.secagg_shares < len(fed.order))
        _workflow(shares, cfg.secagg_threshold, max_weight=max(total, 1.0),
                  clipping_range=cfg.secagg_clip, quantization_range=2 ** cfg.secagg_bits,
                  timeout=cfg.round_timeout)(grid, legacy)
    except Exception as e:  # noqa: BLE001 - what check_reply cannot see (a key share that
        # does not combine) fails inside Flower's workflow: the round, not the ServerApp
        for n in fed.order:
            if len(parts[n]):
                record_failure(report, round_, "invalid", fed.partition(n), parts[n],
                               f"the SecAgg+ round failed ({type(e).__name__}: {e})", faults)
        return None, np.zeros(0, np.int64)
    done = strategy.result[1] if strategy.result is not None else {}
    for n in fed.order:
        if n not in done and len(parts[n]):
            why, err = grid.refused.get(int(n)), grid.errors.get(int(n))
            kind = "invalid" if why else "error" if err else "timeout"
            record_failure(report, round_, kind, fed.partition(n), parts[n],
                           why or err or "dropped out of the SecAgg+ round", faults)
        elif int(n) in grid.refused:  # a refused key-share reply after its masked vector:
            # the node's update is in the aggregate, the refusal is counted without clients
            record_failure(report, round_, "invalid", fed.partition(n), [],
                           grid.refused[int(n)])
    alive = np.sort(np.concatenate([parts[n] for n in done] or [np.zeros(0, np.int64)]))
    if strategy.result is None or not len(alive):
        return None, alive
    agg, fitres = strategy.result
    k = len(alive)  # every surviving client's row is the mean (views of one array)
    # per client (as concat_results): the most any node's clients spent, not their sum
    grads = max((int(f.metrics.get("grad-evals", 0)) for f in fitres.values()), default=0)
    if weighted and not fed.examples[alive].sum() > 0:  # no example behind the round: no
        # mean to unmask (0/0), and no node's fault — zero weights skip the step (as plain)
        zeros = {n: np.zeros((k, *np.shape(v)), np.asarray(v).dtype) for n, v in
                 zip(names, values)}
        return ClientUpdates({n: arrays.to_torch(v) for n, v in zeros.items()} if fed.torch
                             else zeros, np.zeros(k), alive.copy(), grads), alive
    bad = (len(agg) != len(names) or any(np.shape(a) != np.shape(v) or not np.isfinite(a).all()
                                         for a, v in zip(agg, values)))
    if bad:
        for n in done:
            record_failure(report, round_, "invalid", fed.partition(n), parts[n],
                           "the SecAgg+ aggregate does not fit θ or is not finite", faults)
        return None, np.zeros(0, np.int64)
    mean = {n: a.astype(v.dtype) for n, a, v in zip(names, agg, values)}
    vectors = ({n: arrays.to_torch(v).unsqueeze(0).expand(k, *v.shape) for n, v in mean.items()}
               if fed.torch else {n: np.broadcast_to(v, (k, *v.shape)) for n, v in mean.items()})
    return ClientUpdates(vectors, np.ones(k), alive.copy(), grads), alive
