"""Wire format between the ServerApp and the ClientApps (Flower's Message API records).

Server → SuperNode (``train``): ``content["theta"]`` an :class:`ArrayRecord` of θ (the server
model) and ``content["task"]`` a :class:`ConfigRecord` ``{"round", "clients"}``.

SuperNode → server: exactly one :class:`~partialfl.types.ClientUpdates` — the only thing that
leaves a client — as ``content["vectors"]`` (stacked ``[k, *θ-shape]``), ``content["update"]``
(``cohort``, ``weights``, ``grad-evals``), ``content["metrics"]`` and one
``content["extra.<name>"]`` per algorithm extra. :func:`encode_updates` refuses any tree whose
leaf names are not names of θ, so a personal parameter (whose name is never a θ name: the
split is a partition) cannot be put on the wire even by a buggy algorithm.

Metrics are aggregated on the SuperNode: for each metric allowed by name
(:data:`ALLOWED_METRICS`) only its sum over the node's clients (``"<name>.sum"``) and the
number of clients (``"<name>.count"``) travel, as two scalars — never a per-client list, never
an unlisted name (e.g. a personal parameter smuggled as a "metric"). :func:`decode_updates`
checks the same on the server (a reply that breaks it is refused and counted), and refuses
non-finite vectors and weights that are not finite numbers ≥ 0.

Arrays travel as numpy; torch leaves are converted on both ends (``torch=True``) in their own
dtype, so a round trip is bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from partialfl import arrays
from partialfl.types import ClientUpdates, Params


class PrivacyError(RuntimeError):
    """Something that is not a θ-tree was about to leave a client."""


class WireFormatError(ValueError):
    """A reply that does not decode into the expected updates."""


#: metric names a SuperNode may report (aggregated: sum and count over its clients)
ALLOWED_METRICS: tuple[str, ...] = ("loss", "train_loss")


def aggregate_metrics(metrics, allowed=ALLOWED_METRICS) -> dict[str, float]:
    """``{"<name>.sum": Σ, "<name>.count": k}`` per metric; refuses unlisted names and
    anything that is not one finite scalar per client."""
    out: dict[str, float] = {}
    for n, v in metrics.items():
        if n not in allowed:
            raise PrivacyError(f"refusing to send metric {n!r}: only the metrics "
                               f"{sorted(allowed)} may leave a client (aggregated)")
        arr = np.asarray(_to_numpy(v), dtype=np.float64)
        if arr.ndim > 1:
            raise PrivacyError(f"refusing to send metric {n!r} of shape {arr.shape}: metrics "
                               "are one scalar per client")
        arr = arr.reshape(-1)
        out[f"{n}.sum"] = float(arr.sum())
        out[f"{n}.count"] = float(arr.size)
    return out


def decode_metrics(record, allowed=ALLOWED_METRICS) -> dict[str, tuple[float, float]]:
    """``{name: (sum, count)}`` from a reply's metric record; refuses lists, unlisted names,
    a sum without its count and non-finite values (:class:`WireFormatError`)."""
    sums: dict[str, dict[str, float]] = {}
    for key, v in record.items():
        name, _, part = key.rpartition(".")
        if name not in allowed or part not in ("sum", "count"):
            raise WireFormatError(f"reply metric {key!r} is not allowed: only "
                                  f"'<name>.sum' / '<name>.count' for {sorted(allowed)}")
        if isinstance(v, list | tuple) or not np.isfinite(float(v)):
            raise WireFormatError(f"reply metric {key!r} must be one finite scalar, got "
                                  f"{type(v).__name__}")
        sums.setdefault(name, {})[part] = float(v)
    out = {}
    for name, parts in sums.items():
        if set(parts) != {"sum", "count"} or parts["count"] < 0:
            raise WireFormatError(f"reply metric {name!r} needs one sum and one count >= 0")
        out[name] = (parts["sum"], parts["count"])
    return out


_to_numpy = arrays.to_numpy


def params_to_record(params: Params) -> ArrayRecord:
    """θ (numpy or torch leaves) → ArrayRecord (one named Array per leaf)."""
    return ArrayRecord({n: Array(np.ascontiguousarray(_to_numpy(v))) for n, v in params.items()})


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


def encode_updates(updates: ClientUpdates, theta_names: Iterable[str]) -> RecordDict:
    """The reply content for one cohort's :class:`ClientUpdates` (see module docstring)."""
    theta_names = list(theta_names)
    _check_names(updates.vectors, theta_names, "update vectors")
    content = RecordDict({
        "vectors": params_to_record(updates.vectors),
        "update": ConfigRecord({
            "cohort": [int(c) for c in np.asarray(updates.cohort)],
            "weights": [float(w) for w in np.asarray(updates.weights, dtype=np.float64)],
            "grad-evals": int(updates.grad_evals),
        }),
        "metrics": MetricRecord(aggregate_metrics(updates.metrics)),
    })
    for name, tree in updates.extra.items():
        _check_names(tree, theta_names, f"extra {name!r}")
        content[f"extra.{name}"] = params_to_record(tree)
    return content


def decode_updates(content: RecordDict, theta: Params, cohort: np.ndarray,
                   torch: bool = False) -> tuple[ClientUpdates, dict[str, tuple[float, float]]]:
    """Reply content → ``(updates, metric sums)``, checked against the θ the server sent and
    the clients it asked for (names, shapes, cohort, finite vectors, finite weights ≥ 0,
    aggregated metrics): a malformed reply raises :class:`WireFormatError` and the server
    counts it as a failed update. The updates carry no metrics (only the node's sums do)."""
    try:
        vec_rec, upd = content["vectors"], content["update"]
    except KeyError as e:
        raise WireFormatError(f"reply lacks record {e.args[0]!r}") from None
    vectors = decode_params(vec_rec, torch)
    if set(vectors) != set(theta):
        raise WireFormatError(f"reply vectors {sorted(vectors)} != θ leaves {sorted(theta)}")
    got = np.asarray(upd["cohort"], dtype=np.int64)
    if not np.array_equal(got, np.asarray(cohort, dtype=np.int64)):
        raise WireFormatError(f"reply is for clients {got.tolist()}, asked for "
                              f"{np.asarray(cohort).tolist()}")
    k = len(got)
    for n, v in vectors.items():
        if tuple(v.shape) != (k, *tuple(theta[n].shape)):
            raise WireFormatError(f"reply vector {n!r} has shape {tuple(v.shape)}, expected "
                                  f"{(k, *tuple(theta[n].shape))}")
        if not bool(np.isfinite(_to_numpy(v)).all()):
            raise WireFormatError(f"reply vector {n!r} is not finite")
    weights = np.asarray(upd["weights"], dtype=np.float64).reshape(-1)
    if len(weights) != k or not (np.isfinite(weights).all() and (weights >= 0).all()):
        raise WireFormatError(f"reply weights {weights.tolist()} must be {k} finite numbers "
                              ">= 0")
    extra = {}
    for key in content.array_records:
        if key.startswith("extra."):
            tree = decode_params(content[key], torch)
            if set(tree) - set(theta):
                raise WireFormatError(f"reply extra {key!r} has leaves "
                                      f"{sorted(set(tree) - set(theta))} that are not θ leaves")
            if not all(bool(np.isfinite(_to_numpy(v)).all()) for v in tree.values()):
                raise WireFormatError(f"reply extra {key!r} is not finite")
            extra[key[len("extra."):]] = tree
    metrics = decode_metrics(content["metrics"]) if "metrics" in content else {}
    return ClientUpdates(vectors, weights, got, int(upd["grad-evals"]), {}, extra), metrics
