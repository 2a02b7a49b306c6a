"""LEAF json directories (FEMNIST) as a FederatedDataset.

API note::

    ds = load_leaf_femnist(path, normalize="emnist", train_fraction=0.9, seed=0)
    users = read_leaf_json([file, ...])   # {user: (x_list, y_list)}, in file order (generic)

LEAF's json format (``TalwalkarLab/leaf``, ``data/<name>/data/...``), one or more files each::

    {"users": ["f0000_14", ...], "num_samples": [n_0, ...],
     "user_data": {"f0000_14": {"x": [[784 floats], ...], "y": [int, ...]}, ...},
     "hierarchies": [...]}            # optional, ignored

``path`` may be

- a LEAF ``data`` folder with ``train/`` and ``test/`` sub-folders of json files (the output of
  LEAF's ``split_data.py``); a user's train and test examples come from the two folders. Users
  of a ``--by_user`` split appear in only one of them and get an empty other split;
- a folder of unsplit json files (``all_data/``, ``sampled_data/``, ``rem_user_data/``), or its
  parent holding ``all_data/``: each user's examples are split like LEAF's ``--by_sample``
  rule (users with fewer than 2 examples dropped; ``max(1, int(train_fraction * n))`` train
  examples, exactly 1 if n = 2; the rest test), drawn from
  ``partialfl.rng.generator(seed, "leaf_split", user_id)`` (so not bit-identical to a
  LEAF run, which uses Python's ``random``).

FEMNIST pixels are LEAF floats in [0, 1] (1 = white background), 784 per image in row-major
28×28 order; normalisation as in :mod:`partialfl.data.femnist`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from partialfl.data.federated import DataFormatError, FederatedDataset
from partialfl.data.femnist import (
    DEFAULT_MIN_STD,
    FEMNIST_NUM_CLASSES,
    Normalization,
    images_to_dataset,
)
from partialfl.data.paths import DataNotFoundError
from partialfl.io import FileFormatError, read_json
from partialfl.rng import generator

_LEAF_KEYS = ("users", "num_samples", "user_data")


def read_leaf_json(files: Sequence[str | Path]) -> dict[str, tuple[list, list]]:
    """Read LEAF json files into ``{user: (x, y)}`` (users in the order the files list them).

    Only users named in a file's ``"users"`` list are read (LEAF's split script leaves empty
    entries in ``user_data`` for dropped users). A user in several files is an error.
    """
    out: dict[str, tuple[list, list]] = {}
    for f in files:
        f = Path(f)
        try:  # (a FIFO hung, deep nesting ended in a RecursionError traceback)
            data = read_json(f)
        except FileFormatError as e:
            raise DataFormatError(f"{e}; a LEAF json file is an object with keys "
                                  f"{list(_LEAF_KEYS)}") from None
        missing = [k for k in _LEAF_KEYS if k not in data]
        if missing:
            raise DataFormatError(
                f"{f} is missing key(s) {missing}; a LEAF json file needs {list(_LEAF_KEYS)}"
            )
        users, counts, udata = data["users"], data["num_samples"], data["user_data"]
        if not (isinstance(users, list) and isinstance(counts, list)
                and isinstance(udata, dict)):
            raise DataFormatError(f"{f}: 'users' and 'num_samples' must be lists and "
                                  "'user_data' an object")
        if len(users) != len(counts):
            raise DataFormatError(
                f"{f}: 'users' has {len(users)} entries but 'num_samples' has {len(counts)}"
            )
        for u, n in zip(users, counts):
            u = str(u)
            if u not in udata:
                raise DataFormatError(f"{f}: user {u!r} is listed in 'users' but not in "
                                      "'user_data'")
            d = udata[u]
            if not isinstance(d, dict) or "x" not in d or "y" not in d:
                raise DataFormatError(f"{f}: user_data[{u!r}] must have keys 'x' and 'y'")
            if not (isinstance(d["x"], list) and isinstance(d["y"], list)
                    and isinstance(n, int) and not isinstance(n, bool)):
                raise DataFormatError(f"{f}: user {u!r}: 'x' and 'y' must be lists and its "
                                      "num_samples an integer")
            if not len(d["x"]) == len(d["y"]) == n:
                raise DataFormatError(
                    f"{f}: user {u!r} has {len(d['x'])} x, {len(d['y'])} y but num_samples {n}"
                )
            if u in out:
                raise DataFormatError(f"{f}: user {u!r} appears in more than one file")
            out[u] = (d["x"], d["y"])
    return out


def _json_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix == ".json" and p.is_file())


def _images(u: str, xs: list, where: str) -> np.ndarray:
    if len(xs) == 0:
        return np.zeros((0, 28, 28), np.float32)
    try:  # (dtype=float32 here parsed strings such as "0.5" as pixels)
        a = np.asarray(xs)
    except (ValueError, TypeError) as e:
        raise DataFormatError(f"{where}: user {u!r} has non-numeric or ragged 'x': {e}") from e
    if a.dtype.kind not in "iuf":
        raise DataFormatError(f"{where}: user {u!r} has non-numeric or ragged 'x' (numbers "
                              f"expected, got {a.dtype})")
    a = a.astype(np.float32)
    if a.ndim != 2 or a.shape[1] != 784:
        raise DataFormatError(
            f"{where}: user {u!r} 'x' must be a list of 784-float images, got shape {a.shape}"
        )
    if not np.isfinite(a).all():  # NaN slips through min/max comparisons
        bad = int((~np.isfinite(a)).sum())
        raise DataFormatError(f"{where}: user {u!r} has {bad} non-finite pixel value(s) "
                              "(NaN or inf); pixels must be finite floats in [0, 1]")
    if a.size and (a.min() < 0 or a.max() > 1):
        raise DataFormatError(f"{where}: user {u!r} pixels outside [0, 1] (LEAF floats)")
    return a.reshape(-1, 28, 28)


def _labels(u: str, ys: list, where: str) -> np.ndarray:
    y = np.asarray(ys)
    if y.size and (not np.issubdtype(y.dtype, np.number) or np.any(y != np.round(y))):
        raise DataFormatError(f"{where}: user {u!r} has non-integer labels")
    y = y.astype(np.int64).reshape(-1)
    if y.size and (y.min() < 0 or y.max() >= FEMNIST_NUM_CLASSES):
        raise DataFormatError(
            f"{where}: user {u!r} has labels in [{y.min()}, {y.max()}], outside 0..61"
        )
    return y


def load_leaf_femnist(
    path: str | Path,
    normalize: Normalization = "emnist",
    *,
    train_fraction: float = 0.9,
    seed: int = 0,
    pixel_stats: tuple[np.ndarray, np.ndarray] | None = None,
    min_std: float = DEFAULT_MIN_STD,
) -> FederatedDataset:
    """Load FEMNIST from a LEAF json folder (see the module docstring for the layouts).

    ``train_fraction`` and ``seed`` are used only for unsplit folders. Raises
    :class:`~partialfl.data.paths.DataNotFoundError` for a missing folder (or one without json
    files) and :class:`~partialfl.data.federated.DataFormatError` for a wrong schema or a
    corrupt file.
    """
    root = Path(path)
    if not root.is_dir():
        raise DataNotFoundError(f"LEAF data folder {root} does not exist")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    per_user: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    if (root / "train").is_dir() and (root / "test").is_dir():
        layout = "train/test json"
        for split in ("train", "test"):
            files = _json_files(root / split)
            if not files:
                raise DataNotFoundError(f"no .json files in {root / split}")
            for u, (xs, ys) in read_leaf_json(files).items():
                where = f"{root / split}"
                per_user.setdefault(u, {})[split] = (_images(u, xs, where), _labels(u, ys, where))
    else:
        folder = root / "all_data" if (root / "all_data").is_dir() else root
        files = _json_files(folder)
        if not files:
            raise DataNotFoundError(
                f"no LEAF json files in {folder} (expected train/ and test/ folders, an "
                "all_data/ folder, or json files)"
            )
        layout = f"unsplit json, per-user {train_fraction:g} train split (seed {seed})"
        for u, (xs, ys) in read_leaf_json(files).items():
            n = len(ys)
            if n < 2:
                continue
            x, y = _images(u, xs, str(folder)), _labels(u, ys, str(folder))
            n_tr = 1 if n == 2 else max(1, int(train_fraction * n))
            perm = generator(seed, "leaf_split", u).permutation(n)
            tr, te = np.sort(perm[:n_tr]), np.sort(perm[n_tr:])
            per_user[u] = {"train": (x[tr], y[tr]), "test": (x[te], y[te])}
    if not per_user:
        raise DataFormatError(f"{root}: no users with data")
    users = list(per_user)
    empty = (np.zeros((0, 28, 28), np.float32), np.zeros(0, np.int64))
    arrays = {}
    for split in ("train", "test"):
        parts = [per_user[u].get(split, empty) for u in users]
        arrays[split] = (
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts]),
            np.repeat(np.arange(len(users)), [len(p[1]) for p in parts]),
        )
    if arrays["train"][0].shape[0] == 0:
        raise DataFormatError(f"{root}: no training examples")
    return images_to_dataset(
        *arrays["train"], *arrays["test"], users, FEMNIST_NUM_CLASSES, normalize,
        description=f"FEMNIST from LEAF json at {root} ({layout})",
        pixel_stats=pixel_stats, min_std=min_std,
    )
