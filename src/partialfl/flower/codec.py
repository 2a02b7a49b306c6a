"""Wire format between the ServerApp and the ClientApps (Flower's Message API records), and
the one place where the server checks what a SuperNode sends.

Server → SuperNode (``train``): ``content["theta"]`` an :class:`ArrayRecord` of θ (the server
model) and ``content["task"]`` a :class:`ConfigRecord` ``{"round", "clients"}`` plus
``"extra.<name>"`` for each number of the server state the algorithm's clients read
(``shared_extra``: DP's adaptive clip norm).

SuperNode → server: exactly one :class:`~partialfl.types.ClientUpdates` — the only thing that
leaves a client — as ``content["vectors"]`` (stacked ``[k, *θ-shape]``), ``content["update"]``
(``cohort``, ``weights``, ``grad-evals``), ``content["metrics"]`` and one
``content["extra.<name>"]`` per extra the algorithm declares (:func:`declared_extras`).
:func:`encode_updates` refuses any tree whose leaf names are not names of θ, so a personal
parameter (whose name is never a θ name: the split is a partition) cannot be put on the wire
even by a buggy algorithm.

Metrics are aggregated on the SuperNode: for each metric allowed by name
(:data:`ALLOWED_METRICS`, and the ``server_metrics`` the algorithm's server step reads) only
its sum over the node's clients (``"<name>.sum"``) and the number of clients
(``"<name>.count"``) travel, as two scalars — never a per-client list, never an unlisted name
(e.g. a personal parameter smuggled as a "metric"). A server metric reaches the server step
as the node's mean on each of the node's rows (the step only sums it: DP's adaptive clipping
reads the count of unclipped updates).

Every reply is untrusted. The decoders (:func:`decode_updates`, :func:`decode_eval`,
:func:`decode_describe`, :func:`decode_theta0`) check it against what the server sent and what
the node declared, and raise :class:`WireFormatError` (one line) for anything else — never
another exception: the server counts that reply as a failure of its node. A train reply must
have exactly the records above; the θ leaves, shapes ``[k, *θ-shape]`` and dtypes of θ in
``vectors`` and in every declared extra; the asked clients in order; per client a weight
``0 ≤ w_m ≤ max(1, n_m)`` (``n_m`` the example count its node declared) and finite values
(:func:`partialfl.runtime.faults.finite_mask`); names that pass the simulator's privacy check
(:func:`partialfl.privacy.check_updates`); metrics as above with counts ≤ k.

SecAgg+ replies (Flower's protocol records) are checked against their request by
:func:`partialfl.flower.secagg.check_reply`, with this module's helpers.

Evaluation replies (``content["eval"]``) are sums and counts over at least ``eval-min-clients``
of the node's clients (:data:`EVAL_KEYS`), or nothing at all (an empty record: the node has
fewer clients and withholds its evaluation). No per-client value, no histogram.

Arrays travel as numpy; torch leaves are converted on both ends (``torch=True``) in their own
dtype, so a round trip is bit-exact.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from partialfl import arrays
from partialfl.flower.text import bounded, one_line
from partialfl.types import ClientUpdates, Params


class PrivacyError(RuntimeError):
    """Something that is not a θ-tree was about to leave a client."""


class WireFormatError(ValueError):
    """A reply that does not decode into what the server expects: the reason (it may quote
    what the node sent) on one printable line of bounded length (:func:`bounded`)."""

    def __init__(self, reason: object = "") -> None:
        super().__init__(bounded(str(reason)))


#: metric names a SuperNode may report (aggregated: sum and count over its clients)
ALLOWED_METRICS: tuple[str, ...] = ("loss", "train_loss")
#: the largest example count a node may declare for one client (weights are bounded by it)
MAX_EXAMPLES = 1e12
#: the largest number of clients a node may declare (the server allocates per-client arrays)
MAX_CLIENTS = 10 ** 7
#: the entries of an evaluation reply: least squares, and model problems
#: (:meth:`~partialfl.problems.model.ModelProblem.metric_counts` summed, and the number of
#: clients with test data). Linear sums only: a sum of per-client accuracies c_m/t_m next to
#: Σ c_m and Σ t_m let the server solve for each client of a two-client node exactly
EVAL_KEYS: dict[str, frozenset[str]] = {
    "least-squares": frozenset({"clients", "loss.sum", "loss-gap.sum"}),
    "model": frozenset({"clients", "correct.sum", "total.sum", "loss_sum.sum",
                        "loss_weight.sum", "acc.count"}),
}
#: evaluation entries that count something (integers >= 0)
_EVAL_COUNTS = frozenset({"clients", "correct.sum", "total.sum", "acc.count"})
#: evaluation entries that sum non-negative values (a least-squares loss is a sum of squares;
#: a model's per-example loss weights are >= 0; a model's loss may be any registered loss)
_EVAL_NONNEGATIVE = {"least-squares": ("loss.sum",), "model": ("loss_weight.sum",)}


def aggregate_metrics(metrics, allowed=ALLOWED_METRICS) -> dict[str, float]:
    """``{"<name>.sum": Σ, "<name>.count": k}`` per metric over the clients that computed it
    (NaN: not computed, left out); refuses unlisted names and anything that is not one
    scalar per client."""
    out: dict[str, float] = {}
    for n, v in metrics.items():
        if n not in allowed:
            raise PrivacyError(f"refusing to send metric {n!r}: only the metrics "
                               f"{sorted(allowed)} may leave a client (aggregated)")
        arr = np.asarray(arrays.to_numpy(v), dtype=np.float64)
        if arr.ndim > 1:
            raise PrivacyError(f"refusing to send metric {n!r} of shape {arr.shape}: metrics "
                               "are one scalar per client")
        arr = arr.reshape(-1)
        arr = arr[~np.isnan(arr)]  # NaN: not computed (a client that took no step)
        out[f"{n}.sum"] = float(arr.sum())
        out[f"{n}.count"] = float(arr.size)
    return out


def params_to_record(params: Params) -> ArrayRecord:
    """θ (numpy or torch leaves) → ArrayRecord (one named Array per leaf)."""
    return ArrayRecord({n: Array(np.asarray(arrays.to_numpy(v), order="C"))  # (0-d: 0-d)
                        for n, v in params.items()})


def decode_params(record: ArrayRecord, torch: bool = False) -> Params:
    """ArrayRecord → θ tree (numpy, or torch tensors when ``torch``)."""
    out = {n: a.numpy() for n, a in record.items()}
    return {n: arrays.to_torch(v) for n, v in out.items()} if torch else out


def _check_names(tree: Params, allowed: Iterable[str], what: str) -> None:
    bad = sorted(set(tree) - set(allowed))
    if bad:
        raise PrivacyError(
            f"refusing to send {what} with leaves {bad}: only θ leaves "
            f"({sorted(allowed)}) may leave a client"
        )


def metric_names(algorithm) -> tuple[str, ...]:
    """The metrics a node may send for ``algorithm``: :data:`ALLOWED_METRICS` and the
    ``server_metrics`` its server step reads."""
    return (*ALLOWED_METRICS, *getattr(algorithm, "server_metrics", ()))


def encode_updates(updates: ClientUpdates, theta_names: Iterable[str],
                   metrics: Iterable[str] = ALLOWED_METRICS) -> RecordDict:
    """The reply content for one cohort's :class:`ClientUpdates` (see module docstring);
    ``metrics``: the names allowed (:func:`metric_names`)."""
    theta_names = list(theta_names)
    _check_names(updates.vectors, theta_names, "update vectors")
    content = RecordDict({
        "vectors": params_to_record(updates.vectors),
        "update": ConfigRecord({
            "cohort": [int(c) for c in np.asarray(updates.cohort)],
            "weights": [float(w) for w in np.asarray(updates.weights, dtype=np.float64)],
            "grad-evals": int(updates.grad_evals),
        }),
        "metrics": MetricRecord(aggregate_metrics(updates.metrics, tuple(metrics))),
    })
    for name, tree in updates.extra.items():
        _check_names(tree, theta_names, f"extra {name!r}")
        content[f"extra.{name}"] = params_to_record(tree)
    return content


def declared_extras(algorithm) -> frozenset[str]:
    """The ``extra`` payload names ``algorithm`` declares (``extra_names``; a wrapper's own
    declaration, else its base's); none when it declares nothing."""
    while algorithm is not None:
        names = getattr(algorithm, "extra_names", None)
        if names is not None:
            return frozenset(names)
        algorithm = getattr(algorithm, "base", None)
    return frozenset()


# -- decoding untrusted replies ---------------------------------------------------------------
def _guard(what: str, fn, *args, **kw):
    """``fn(*args, **kw)``; any error but :class:`WireFormatError` becomes one (a safety net:
    the checks below name every case they know)."""
    try:
        return fn(*args, **kw)
    except WireFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - untrusted input: every failure is the reply's
        raise WireFormatError(one_line(f"malformed {what} ({type(e).__name__}: {e})")) from None


def _record(content, key: str, kind: type, what: str):
    rec = content[key]
    if not isinstance(rec, kind):
        raise WireFormatError(f"{what} record {key!r} must be a {kind.__name__}, got "
                              f"{type(rec).__name__}")
    return rec


def _keys(content) -> set[str]:
    if not isinstance(content, RecordDict):
        raise WireFormatError(f"reply content must be a RecordDict, got {type(content).__name__}")
    return {str(k) for k in content.keys()}


def _int(v, what: str, lo: int = 0, hi: float = 2 ** 53) -> int:
    ok = not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float)
                                                             and v.is_integer()))
    if not ok or not lo <= v <= hi:
        raise WireFormatError(f"{what} must be an integer in [{lo}, {hi:g}], got "
                              f"{one_line(repr(v), 60)}")
    return int(v)


def _float(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise WireFormatError(f"{what} must be one number, got {type(v).__name__}")
    try:
        x = float(v)
    except OverflowError:
        x = float("inf")
    if not np.isfinite(x):
        raise WireFormatError(f"{what} must be finite, got {one_line(repr(v), 60)}")
    return x


def _list(v, what: str, n: int) -> list:
    if not isinstance(v, list) or len(v) != n:
        got = f"{len(v)} values" if isinstance(v, list) else type(v).__name__
        raise WireFormatError(f"{what} must be a list of {n} values, got {got}")
    return v


def _array(a, what: str) -> np.ndarray:
    if not isinstance(a, Array):
        raise WireFormatError(f"{what} is not an Array")
    try:
        x = a.numpy()  # np.load(allow_pickle=False): object arrays are refused there
    except Exception as e:  # noqa: BLE001 - any undecodable payload
        raise WireFormatError(one_line(f"{what} does not decode ({type(e).__name__}: {e})")
                              ) from None
    if x.dtype.kind != "f":
        raise WireFormatError(f"{what} has dtype {x.dtype}, not a float dtype")
    return x


def _tree(content, key: str, theta: Mapping[str, Any], k: int) -> dict[str, np.ndarray]:
    """A stacked θ-tree: exactly θ's leaves, each ``[k, *θ-shape]`` in θ's dtype."""
    rec = _record(content, key, ArrayRecord, "reply")
    names = set(rec.keys())
    if names != set(theta):
        extra, missing = sorted(names - set(theta)), sorted(set(theta) - names)
        raise WireFormatError(f"reply {key!r} leaves differ from θ's: unexpected {extra[:5]}, "
                              f"missing {missing[:5]}")
    out = {}
    for n in theta:
        x = _array(rec[n], f"reply {key!r} leaf {n!r}")
        ref = arrays.to_numpy(theta[n])
        want = (k, *ref.shape)
        if tuple(x.shape) != want:
            raise WireFormatError(f"reply {key!r} leaf {n!r} has shape {tuple(x.shape)}, "
                                  f"expected {want}")
        if x.dtype != ref.dtype:
            raise WireFormatError(f"reply {key!r} leaf {n!r} has dtype {x.dtype}, θ is "
                                  f"{ref.dtype}")
        out[n] = x
    return out


def decode_metrics(record, k: float = np.inf,
                   allowed=ALLOWED_METRICS) -> dict[str, tuple[float, float]]:
    """``{name: (sum, count)}`` from a reply's metric record; refuses lists, unlisted names,
    a sum without its count, non-finite values and counts that are not integers in
    ``[0, k]`` (:class:`WireFormatError`)."""
    if not isinstance(record, MetricRecord):
        raise WireFormatError(f"reply metrics must be a MetricRecord, got "
                              f"{type(record).__name__}")
    sums: dict[str, dict[str, float]] = {}
    for key, v in record.items():
        name, _, part = str(key).rpartition(".")
        if name not in allowed or part not in ("sum", "count"):
            raise WireFormatError(f"reply metric {one_line(repr(key), 60)} is not allowed: "
                                  f"only '<name>.sum' / '<name>.count' for {sorted(allowed)}")
        if isinstance(v, list | tuple):
            raise WireFormatError(f"reply metric {key!r} must be one finite scalar, got a list")
        sums.setdefault(name, {})[part] = _float(v, f"reply metric {key!r}")
    out = {}
    for name, parts in sums.items():
        if set(parts) != {"sum", "count"}:
            raise WireFormatError(f"reply metric {name!r} needs one sum and one count >= 0")
        count = float(_int(parts["count"], f"reply metric '{name}.count'", 0, k))
        if count == 0 and parts["sum"] != 0:
            raise WireFormatError(f"reply metric {name!r}: a sum of {parts['sum']!r} over 0 "
                                  "clients")
        out[name] = (parts["sum"], count)
    return out


def _decode_updates(content, theta: Params, cohort: np.ndarray, max_weights, extras,
                    algorithm) -> tuple[ClientUpdates, dict[str, tuple[float, float]]]:
    from partialfl.privacy import check_updates
    from partialfl.runtime.faults import finite_mask

    keys = _keys(content)
    allowed = {"vectors", "update", "metrics"} | {f"extra.{e}" for e in extras}
    if keys - allowed or not {"vectors", "update"} <= keys:
        raise WireFormatError(
            f"reply records {sorted(keys)[:8]}: expected 'vectors', 'update', optional "
            f"'metrics' and the declared extras {sorted(extras)} "
            f"(unexpected {sorted(keys - allowed)[:5]})")
    missing = sorted(allowed - keys - {"metrics"})
    if missing:
        raise WireFormatError(f"reply lacks record(s) {missing}")
    upd = _record(content, "update", ConfigRecord, "reply")
    if set(upd.keys()) != {"cohort", "weights", "grad-evals"}:
        raise WireFormatError(f"reply 'update' has entries {sorted(upd.keys())[:8]}, expected "
                              "['cohort', 'grad-evals', 'weights']")
    asked = np.asarray(cohort, dtype=np.int64)
    k = len(asked)
    got = [_int(c, "reply cohort id") for c in _list(upd["cohort"], "reply cohort", k)]
    if got != asked.tolist():
        raise WireFormatError(one_line(f"reply is for clients {got}, asked for "
                                        f"{asked.tolist()}"))
    weights = np.asarray([_float(w, "reply weight")
                          for w in _list(upd["weights"], "reply weights", k)])
    bound = np.ones(k) if max_weights is None else np.asarray(max_weights, dtype=np.float64)
    bad = np.flatnonzero(~((weights >= 0) & (weights <= bound)))
    if bad.size:
        i = int(bad[0])
        raise WireFormatError(f"reply weights must be {k} finite numbers >= 0 and at most "
                              f"max(1, examples): client {int(asked[i])} sent {weights[i]:g}, "
                              f"bound {bound[i]:g}")
    grads = _int(upd["grad-evals"], "reply grad-evals")
    vectors = _tree(content, "vectors", theta, k)
    extra = {e: _tree(content, f"extra.{e}", theta, k) for e in sorted(extras)}
    updates = ClientUpdates(vectors, weights, asked.copy(), grads, {}, extra)
    try:
        check_updates(updates, theta.keys(), algorithm)
    except ValueError as e:
        raise WireFormatError(one_line(str(e))) from None
    ok = finite_mask(updates)
    if not ok.all():
        raise WireFormatError(f"reply is not finite for clients "
                              f"{asked[~ok].tolist()[:8]} (vectors, weights or extras)")
    metrics = (decode_metrics(content["metrics"], k, metric_names(algorithm))
               if "metrics" in keys else {})
    for name in getattr(algorithm, "server_metrics", ()):  # read by the server step
        if name not in metrics or metrics[name][1] != k:
            raise WireFormatError(f"reply lacks the metric {name!r} over its {k} clients, "
                                  "which the server step reads")
        updates.metrics[name] = np.full(k, metrics[name][0] / k)
    return updates, metrics


def decode_updates(content, theta: Params, cohort, torch: bool = False, *,
                   max_weights=None, algorithm=None
                   ) -> tuple[ClientUpdates, dict[str, tuple[float, float]]]:
    """Train reply content → ``(updates, metric sums)``, checked against the θ the server
    sent (leaves, shapes, dtypes), the clients it asked for, ``max_weights`` (per client, the
    bound ``max(1, n_m)``; default 1) and ``algorithm``'s declared extras, server metrics
    and privacy rules (see the module docstring). Raises :class:`WireFormatError` only; the
    updates carry only the server metrics (the node's mean per row), the metric sums come
    apart."""
    extras = declared_extras(algorithm)
    updates, metrics = _guard("train reply", _decode_updates, content, theta, cohort,
                              max_weights, extras, algorithm)
    if torch:
        updates = ClientUpdates({n: arrays.to_torch(v) for n, v in updates.vectors.items()},
                                updates.weights, updates.cohort, updates.grad_evals,
                                updates.metrics,
                                {e: {n: arrays.to_torch(v) for n, v in t.items()}
                                 for e, t in updates.extra.items()})
    return updates, metrics


def _decode_eval(content, kind: str, min_clients: int, max_clients: int,
                 max_units: tuple[float, float] | None) -> dict[str, float] | None:
    keys = _keys(content)
    if keys != {"eval"}:
        raise WireFormatError(f"evaluation reply records {sorted(keys)[:8]}, expected ['eval']")
    rec = _record(content, "eval", MetricRecord, "evaluation")
    if len(rec) == 0:
        return None  # withheld: the node has fewer than eval-min-clients clients
    want = EVAL_KEYS[kind]
    got = {str(k) for k in rec.keys()}
    if got != want:
        raise WireFormatError(
            f"evaluation entries {sorted(got)[:8]} are not allowed: expected exactly "
            f"{sorted(want)} (sums and counts only, no per-client list)")
    out: dict[str, float] = {}
    for k in sorted(want):
        v = rec[k]
        if isinstance(v, list | tuple):
            raise WireFormatError(f"evaluation entry {k!r} must be one finite scalar (no "
                                  "per-client list reaches the server)")
        out[k] = float(_int(v, f"evaluation entry {k!r}")) if k in _EVAL_COUNTS \
            else _float(v, f"evaluation entry {k!r}")
    n = out["clients"]
    evaluated = out.get("acc.count", n)  # model problems: clients with test data
    if not (evaluated <= n <= max_clients):
        raise WireFormatError(f"evaluation reply counts {n:g} clients ({evaluated:g} "
                              f"evaluated); the node holds {max_clients}")
    if evaluated < min_clients:
        raise WireFormatError(f"evaluation reply sums over {evaluated:g} clients, fewer than "
                              f"eval-min-clients = {min_clients}")
    if kind == "model" and not out["correct.sum"] <= out["total.sum"]:
        raise WireFormatError("evaluation reply has correct > total")
    if kind == "model" and out["loss_weight.sum"] == 0 and out["loss_sum.sum"] != 0:
        raise WireFormatError("evaluation reply has a loss sum with zero loss weight (a sum "
                              "of losses weighted by zero weights is 0)")
    if kind == "model" and max_units is not None:
        # what the node declared when it described itself (its test data's counts), up to
        # the rounding of sums accumulated in another order
        for key, bound in zip(("total.sum", "loss_weight.sum"), max_units):
            if not out[key] <= bound * (1 + 1e-6) + 1e-6:
                raise WireFormatError(f"evaluation entry {key!r} = {out[key]:g} exceeds the "
                                      f"{bound:g} the node declared (describe eval-units)")
    for k in _EVAL_NONNEGATIVE[kind]:  # sums of squares / of weights
        if out[k] < 0:
            raise WireFormatError(f"evaluation entry {k!r} = {out[k]:g} is negative: it sums "
                                  "values that are >= 0")
    if kind == "least-squares":
        # 0 <= f_m - min f_m <= f_m for every client, up to the rounding of the difference
        tol = 1e-9 * (1.0 + out["loss.sum"])
        if not -tol <= out["loss-gap.sum"] <= out["loss.sum"] + tol:
            raise WireFormatError(f"evaluation entry 'loss-gap.sum' = {out['loss-gap.sum']:g} "
                                  f"is outside [0, loss.sum = {out['loss.sum']:g}]")
    return out


def decode_eval(content, *, kind: str, min_clients: int, max_clients: int,
                max_units: tuple[float, float] | None = None) -> dict[str, float] | None:
    """Evaluation reply → its sums (:data:`EVAL_KEYS` of ``kind``), or None when the node
    withheld its evaluation (an empty record). The sums must be over at least
    ``min_clients`` and at most ``max_clients`` (the node's) clients; a model problem's
    ``total.sum`` and ``loss_weight.sum`` at most the node's declared ``max_units``. Raises
    :class:`WireFormatError` only."""
    return _guard("evaluation reply", _decode_eval, content, kind, min_clients, max_clients,
                  max_units)


def _decode_describe(content) -> dict[str, Any]:
    from partialfl.flower.config import partition_clients

    keys = _keys(content)
    if "info" not in keys or keys - {"info", "theta0"}:
        raise WireFormatError(f"describe reply records {sorted(keys)[:8]}, expected 'info' "
                              "and optionally 'theta0'")
    info = _record(content, "info", ConfigRecord, "describe")
    want = {"partition-id", "num-partitions", "num-clients", "clients", "num-examples",
            "eval-units", "torch"}
    if set(info.keys()) != want:
        raise WireFormatError(f"describe info entries {sorted(info.keys())[:8]}, expected "
                              f"{sorted(want)}")
    nparts = _int(info["num-partitions"], "describe num-partitions", 1, MAX_CLIENTS)
    part = _int(info["partition-id"], "describe partition-id", 0, nparts - 1)
    M = _int(info["num-clients"], "describe num-clients", nparts, MAX_CLIENTS)
    clients = partition_clients(M, nparts, part)
    got = [_int(c, "describe client id", 0, M - 1)
           for c in _list(info["clients"], "describe clients", len(clients))]
    if got != clients.tolist():
        raise WireFormatError(f"describe clients of partition {part} must be "
                              f"{clients[0]}..{clients[-1]}")
    examples = [_float(x, "describe num-examples")
                for x in _list(info["num-examples"], "describe num-examples", len(clients))]
    if not all(0 <= x <= MAX_EXAMPLES for x in examples):
        raise WireFormatError(f"describe num-examples must be in [0, {MAX_EXAMPLES:g}]")
    units = [_float(x, "describe eval-units") for x in _list(info["eval-units"],
                                                                 "describe eval-units", 2)]
    if not all(0 <= x <= MAX_EXAMPLES for x in units):
        raise WireFormatError(f"describe eval-units must be in [0, {MAX_EXAMPLES:g}]")
    torch = _int(info["torch"], "describe torch", 0, 1)
    return {"partition-id": part, "num-partitions": nparts, "num-clients": M,
            "clients": got, "num-examples": examples, "eval-units": units, "torch": torch}


def decode_describe(content) -> dict[str, Any]:
    """A ``query.describe`` reply's ``info`` → a checked dict (partition in range, the
    partition's clients exactly, example counts and the evaluation's declared
    ``eval-units`` = [Σ total, Σ loss weight] in ``[0, MAX_EXAMPLES]``). Raises
    :class:`WireFormatError` only."""
    return _guard("describe reply", _decode_describe, content)


_LEAF_NAME = re.compile(r"[^.]+(?:\.[^.]+)*")  # torch's: a.0.w, d.enc-1.w, d.enc 1.w


def _decode_theta0(record, torch: bool) -> Params:
    if not isinstance(record, ArrayRecord) or len(record) == 0:
        raise WireFormatError("initial model 'theta0' must be a non-empty ArrayRecord")
    out = {}
    for n in record.keys():
        if not (isinstance(n, str) and len(n) <= 200 and n.isprintable()
                and _LEAF_NAME.fullmatch(n)):
            raise WireFormatError(f"θ⁰ leaf name {one_line(repr(n), 60)} is not a parameter name")
        x = _array(record[n], f"initial model leaf {n!r}")
        if not np.isfinite(x).all():
            raise WireFormatError(f"initial model leaf {n!r} is not finite")
        out[str(n)] = arrays.to_torch(x) if torch else x
    return out


def decode_theta0(record, torch: bool = False) -> Params:
    """The initial model partition 0 sends: float leaves, finite, under parameter names. Raises
    :class:`WireFormatError` only."""
    return _guard("initial model", _decode_theta0, record, torch)
