"""Wire format between the ServerApp and the ClientApps (Flower's Message API records).

Server → SuperNode (``train``): ``content["theta"]`` an :class:`ArrayRecord` of θ (the server
model) and ``content["task"]`` a :class:`ConfigRecord` ``{"round", "clients"}``.

SuperNode → server: exactly one :class:`~partialfl.types.ClientUpdates` — the only thing that
leaves a client — as ``content["vectors"]`` (stacked ``[k, *θ-shape]``), ``content["update"]``
(``cohort``, ``weights``, ``grad-evals``), ``content["metrics"]`` (per-client scalars) and one
``content["extra.<name>"]`` per algorithm extra. :func:`encode_updates` refuses any tree whose
leaf names are not names of θ, so a personal parameter (whose name is never a θ name: the
split is a partition) cannot be put on the wire even by a buggy algorithm.

Arrays travel as numpy; torch leaves are converted on both ends (``torch=True``) in their own
dtype, so a round trip is bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from partialfl.types import ClientUpdates, Params


class PrivacyError(RuntimeError):
    """Something that is not a θ-tree was about to leave a client."""


class WireFormatError(ValueError):
    """A reply that does not decode into the expected updates."""


def _to_numpy(v) -> np.ndarray:
    if hasattr(v, "detach"):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def params_to_record(params: Params) -> ArrayRecord:
    """θ (numpy or torch leaves) → ArrayRecord (one named Array per leaf)."""
    return ArrayRecord({n: Array(np.ascontiguousarray(_to_numpy(v))) for n, v in params.items()})


def decode_params(record: ArrayRecord, torch: bool = False) -> Params:
    """ArrayRecord → θ tree (numpy, or torch tensors when ``torch``)."""
    out = {n: a.numpy() for n, a in record.items()}
    if torch:
        import torch as _torch

        out = {n: _torch.from_numpy(np.array(v, copy=True)) for n, v in out.items()}
    return out


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
        "metrics": MetricRecord({
            n: [float(x) for x in np.asarray(_to_numpy(v), dtype=np.float64).reshape(-1)]
            for n, v in updates.metrics.items()
        }),
    })
    for name, tree in updates.extra.items():
        _check_names(tree, theta_names, f"extra {name!r}")
        content[f"extra.{name}"] = params_to_record(tree)
    return content


def decode_updates(content: RecordDict, theta: Params, cohort: np.ndarray,
                   torch: bool = False) -> ClientUpdates:
    """Reply content → :class:`ClientUpdates`, checked against the θ the server sent and the
    clients it asked for (names, shapes, cohort): a malformed reply raises
    :class:`WireFormatError` and the server counts it as a failed update."""
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
    extra = {}
    for key in content.array_records:
        if key.startswith("extra."):
            extra[key[len("extra."):]] = decode_params(content[key], torch)
    metrics = {}
    if "metrics" in content:
        metrics = {n: np.asarray(v, dtype=np.float64) for n, v in content["metrics"].items()}
    return ClientUpdates(vectors, np.asarray(upd["weights"], dtype=np.float64), got,
                         int(upd["grad-evals"]), metrics, extra)
