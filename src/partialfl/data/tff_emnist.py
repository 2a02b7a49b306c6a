"""TensorFlow Federated's EMNIST h5 files as a FederatedDataset.

API note::

    ds = load_tff_emnist_h5(data_dir, normalize="emnist", clients=None, max_clients=None)
    ds = load_tff_emnist_h5(data_dir, only_digits=True)   # fed_emnist_digitsonly_{train,test}.h5

Format (TFF's ``HDF5ClientData``, the ``fed_emnist.tar.bz2`` archive of
``tff.simulation.datasets.emnist`` before TFF moved to sqlite; also redistributed by FedML):
two files ``fed_emnist_train.h5`` and ``fed_emnist_test.h5`` (``fed_emnist_digitsonly_*`` for
the 10-class version), each with a top-level group ``examples`` holding one group per client id
(LEAF writer id), with datasets ``pixels`` float32 ``[n, 28, 28]`` in [0, 1] (1.0 = white
background, as in LEAF) and ``label`` int ``[n]`` (0-9 digits, 10-35 upper case, 36-61 lower
case). TFF lists clients in sorted id order; every client has train and test examples.

Clients are those of the train file, in sorted order (TFF's order); a client absent from the
test file gets no test examples and test-only clients are ignored. ``clients`` picks ids
explicitly; ``max_clients`` keeps the first ones (the full file has 3,400 clients and 671,585
training images, about 2 GB as float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from partialfl.data.federated import DataFormatError, FederatedDataset
from partialfl.data.femnist import DEFAULT_MIN_STD, Normalization, images_to_dataset
from partialfl.data.hdf5 import h5py_module, member
from partialfl.data.paths import resolve_data_file

EXAMPLES_GROUP = "examples"
PIXELS, LABEL = "pixels", "label"


def _read_clients(
    path: Path, wanted: Sequence[str] | None, num_classes: int, limit: int | None = None
):
    """``{client: (pixels [n, 28, 28] float32, labels [n] int64)}`` for ``wanted``.

    With ``wanted=None``: the first ``limit`` clients in sorted order (all if ``limit`` is None).
    """
    h5py = h5py_module("TFF EMNIST")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataFormatError(f"{path} is not a readable HDF5 file (corrupt?): {e}") from e
    with f:
        if EXAMPLES_GROUP not in f:
            raise DataFormatError(
                f"{path} has no top-level group {EXAMPLES_GROUP!r} (found {sorted(f.keys())}); "
                "TFF's EMNIST h5 stores examples/<client_id>/{pixels,label}"
            )
        group = member(f, EXAMPLES_GROUP, path, EXAMPLES_GROUP)
        if wanted is None:
            ids = sorted(group.keys())[:limit]
        else:
            ids = [c for c in wanted if c in group]
        out = {}
        for cid in ids:
            g = member(group, cid, path, f"{EXAMPLES_GROUP}/{cid}")
            if not isinstance(g, h5py.Group):
                raise DataFormatError(f"{path}: {EXAMPLES_GROUP}/{cid} must be a group")
            missing = [k for k in (PIXELS, LABEL) if k not in g]
            if missing:
                raise DataFormatError(
                    f"{path}: client {cid!r} is missing dataset(s) {missing} "
                    f"(needs {PIXELS!r} and {LABEL!r})"
                )
            dsets = [member(g, k, path, f"{EXAMPLES_GROUP}/{cid}/{k}") for k in (PIXELS, LABEL)]
            for k, d in zip((PIXELS, LABEL), dsets):
                if not isinstance(d, h5py.Dataset) or d.dtype.kind not in "fiub":
                    raise DataFormatError(f"{path}: {EXAMPLES_GROUP}/{cid}/{k} must be a dataset "
                                          f"of real numbers, got {getattr(d, 'dtype', 'a group')}")
            try:
                x = np.asarray(dsets[0][()], dtype=np.float32)
                y = np.asarray(dsets[1][()])
            except OSError as e:
                raise DataFormatError(f"{path}: cannot read client {cid!r} (corrupt?): {e}") from e
            if x.ndim != 3 or x.shape[1:] != (28, 28):
                raise DataFormatError(f"{path}: client {cid!r} pixels must be [n, 28, 28], got "
                                      f"{x.shape}")
            if not np.issubdtype(y.dtype, np.integer):
                raise DataFormatError(f"{path}: client {cid!r} labels must be integers, got "
                                      f"{y.dtype}")
            y = y.reshape(-1).astype(np.int64)
            if y.shape[0] != x.shape[0]:
                raise DataFormatError(
                    f"{path}: client {cid!r} has {x.shape[0]} images but {y.shape[0]} labels"
                )
            if y.size and (y.min() < 0 or y.max() >= num_classes):
                raise DataFormatError(f"{path}: client {cid!r} labels in [{y.min()}, "
                                      f"{y.max()}], outside 0..{num_classes - 1}")
            if not np.isfinite(x).all():  # NaN slips through min/max comparisons
                raise DataFormatError(f"{path}: client {cid!r} has "
                                      f"{int((~np.isfinite(x)).sum())} non-finite pixel "
                                      "value(s) (NaN or inf); pixels must be finite in [0, 1]")
            if x.size and (x.min() < 0 or x.max() > 1):
                raise DataFormatError(f"{path}: client {cid!r} pixels outside [0, 1]")
            out[cid] = (x, y)
    return out


def load_tff_emnist_h5(
    data_dir: str | Path | None = None,
    normalize: Normalization = "emnist",
    *,
    only_digits: bool = False,
    clients: Sequence[str] | None = None,
    max_clients: int | None = None,
    pixel_stats: tuple[np.ndarray, np.ndarray] | None = None,
    min_std: float = DEFAULT_MIN_STD,
) -> FederatedDataset:
    """Load TFF's federated EMNIST (``fed_emnist[_digitsonly]_{train,test}.h5`` in ``data_dir``).

    ``data_dir`` is resolved like every data folder (:mod:`partialfl.data.paths`). Raises
    :class:`~partialfl.data.paths.DataNotFoundError` for a missing file, KeyError for a client
    id not in the train file and :class:`~partialfl.data.federated.DataFormatError` for a
    corrupt file or wrong schema.
    """
    prefix = "fed_emnist_digitsonly" if only_digits else "fed_emnist"
    num_classes = 10 if only_digits else 62
    train_path = resolve_data_file(f"{prefix}_train.h5", data_dir)
    test_path = resolve_data_file(f"{prefix}_test.h5", data_dir)
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients}")
    if clients is not None:
        clients = [str(c) for c in clients]
        train = _read_clients(train_path, clients, num_classes)
        unknown = [c for c in clients if c not in train]
        if unknown:
            raise KeyError(f"client id(s) {unknown[:5]} not in {train_path}")
        ids = clients
    else:
        train = _read_clients(train_path, None, num_classes, limit=max_clients)
        ids = list(train)
    if not ids:
        raise DataFormatError(f"{train_path}: no clients under {EXAMPLES_GROUP!r}")
    test = _read_clients(test_path, ids, num_classes)
    empty = (np.zeros((0, 28, 28), np.float32), np.zeros(0, np.int64))
    arrays = {}
    for split, d in (("train", train), ("test", test)):
        parts = [d.get(c, empty) for c in ids]
        arrays[split] = (
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts]),
            np.repeat(np.arange(len(ids)), [len(p[1]) for p in parts]),
        )
    return images_to_dataset(
        *arrays["train"], *arrays["test"], ids, num_classes, normalize,
        description=f"EMNIST{' digits' if only_digits else ''} (TFF h5, by writer) from "
                    f"{train_path.parent}",
        pixel_stats=pixel_stats, min_std=min_std,
    )
