"""Federated Google Landmarks v2 (per-user CSV + image folder) as a FederatedDataset.

API note::

    ds = load_gldv2(csv_path, image_dir, test_fraction=0.2, seed=0, image_size=224,
                    clients=None, max_clients=None, num_classes=None, missing_images="error")
    ds.train_x[m]   # float32 [n_m, 3, S, S], ImageNet mean/std normalised; y int64 landmark class

Format (Hsu et al. 2020's federated split as used by ``tff.simulation.datasets.gldv2``): the
``landmarks-user-160k`` bundle's ``federated_train.csv`` (gld160k: 1,262 users, 2,028 classes)
or TFF's ``mini_gld_train_split.csv`` (gld23k: 233 users, 203 classes), with a header row and
columns ``user_id,image_id,class`` (extra columns are ignored), and a folder of
``<image_id>.jpg`` files. TFF's GLDv2 test set (``test.csv``: ``image_id,class``) is not
partitioned by user, so, as Pillutla et al. do, each user's test examples are carved from that
user's own images: a seeded shuffle (``partialfl.rng.generator(seed, "gldv2_split", user)``)
puts ``round(test_fraction · n)`` images in test, keeping at least one in train (a user with a
single image gets no test data).

Images are decoded with Pillow, converted to RGB, resized to ``image_size × image_size``
(bilinear, aspect ratio not kept, like TFF / Pillutla et al.'s evaluation transform), scaled
to [0, 1] and normalised with the ImageNet channel mean (0.485, 0.456, 0.406) and std (0.229,
0.224, 0.225). No random crop / flip augmentation (the data set is stored once, in memory: about
0.6 MB per image at 224×224, so select users with ``clients`` / ``max_clients`` on a laptop).
Users are in order of first appearance in the CSV.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from partialfl.data.federated import DataFormatError, FederatedDataset
from partialfl.data.paths import DataNotFoundError
from partialfl.rng import generator

GLDV2_COLUMNS = ("user_id", "image_id", "class")
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


def read_gldv2_csv(csv_path: str | Path) -> list[tuple[str, str, int]]:
    """Rows ``(user_id, image_id, class)`` of a federated GLDv2 split CSV, in file order."""
    path = Path(csv_path)
    if not path.is_file():
        raise DataNotFoundError(f"GLDv2 split file {path} does not exist")
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:  # a BOM (Excel) is not a name
            reader = csv.DictReader(fh)
            header = reader.fieldnames
            if not header:
                raise DataFormatError(f"{path} is empty; expected a header "
                                      f"{','.join(GLDV2_COLUMNS)}")
            header = [h.strip() for h in header]
            missing = [c for c in GLDV2_COLUMNS if c not in header]
            if missing:
                raise DataFormatError(
                    f"{path} is missing column(s) {missing}; found {header}, need "
                    f"{list(GLDV2_COLUMNS)}"
                )
            reader.fieldnames = header
            rows = []
            for line, r in enumerate(reader, start=2):
                vals = [r.get(c) for c in GLDV2_COLUMNS]
                if any(v is None or v.strip() == "" for v in vals):
                    raise DataFormatError(f"{path}:{line}: empty or missing field in {r}")
                user, image, cls = (v.strip() for v in vals)
                if image in (".", "..") or any(ch in image for ch in "/\\\0"):
                    raise DataFormatError(f"{path}:{line}: image_id {image!r} must be a plain "
                                          "file name (no folder part), read from the image folder")
                try:
                    label = int(cls)
                except ValueError:
                    raise DataFormatError(
                        f"{path}:{line}: class {cls!r} is not an integer"
                    ) from None
                if label < 0:
                    raise DataFormatError(f"{path}:{line}: negative class {label}")
                rows.append((user, image, label))
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path} is not a UTF-8 text CSV (corrupt?): {e}") from e
    except csv.Error as e:  # e.g. a field over the csv module's size limit
        raise DataFormatError(f"{path} is not a valid CSV (corrupt?): {e}") from e
    if not rows:
        raise DataFormatError(f"{path} has a header but no rows")
    return rows


def load_image(path: Path, image_size: int) -> np.ndarray:
    """One JPEG as float32 ``[3, S, S]`` in [0, 1] (RGB, bilinear resize)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:  # pragma: no cover - Pillow is a declared optional dependency
        raise ImportError("reading GLDv2 images needs Pillow: pip install 'partialfl[data]'") from e
    try:
        with Image.open(path) as im:
            im = im.convert("RGB").resize((image_size, image_size), Image.Resampling.BILINEAR)
            a = np.asarray(im, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError,
            ValueError) as e:
        raise DataFormatError(f"image {path} cannot be decoded (corrupt?): {e}") from e
    return a.transpose(2, 0, 1)


def load_gldv2(
    csv_path: str | Path,
    image_dir: str | Path,
    *,
    test_fraction: float = 0.2,
    seed: int = 0,
    image_size: int = 224,
    clients: Sequence[str] | None = None,
    max_clients: int | None = None,
    num_classes: int | None = None,
    missing_images: Literal["error", "skip"] = "error",
) -> FederatedDataset:
    """Load a federated GLDv2 split (see the module docstring for formats and choices).

    ``num_classes`` defaults to 1 + the largest class in the whole CSV. ``missing_images``:
    "error" raises for an image listed in the CSV but absent from ``image_dir``; "skip" drops
    it, like TFF (which logs a warning). Raises
    :class:`~partialfl.data.paths.DataNotFoundError` for a missing CSV / folder / image and
    :class:`~partialfl.data.federated.DataFormatError` for a wrong schema or a corrupt file.
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if missing_images not in ("error", "skip"):
        raise ValueError(f"missing_images must be 'error' or 'skip', got {missing_images!r}")
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients}")
    image_dir = Path(image_dir)
    rows = read_gldv2_csv(csv_path)
    if not image_dir.is_dir():
        raise DataNotFoundError(f"GLDv2 image folder {image_dir} does not exist")
    top = max(r[2] for r in rows) + 1
    if num_classes is None:
        num_classes = top
    elif top > num_classes:
        raise DataFormatError(f"{csv_path}: class {top - 1} >= num_classes={num_classes}")
    by_user: dict[str, list[tuple[str, int]]] = {}
    for user, image, label in rows:
        by_user.setdefault(user, []).append((image, label))
    if clients is not None:
        unknown = [c for c in clients if str(c) not in by_user]
        if unknown:
            raise KeyError(f"user id(s) {unknown[:5]} not in {csv_path}")
        users = [str(c) for c in clients]
    else:
        users = list(by_user)[:max_clients]
    per_split: dict[str, tuple[list, list, list]] = {"train": ([], [], []), "test": ([], [], [])}
    kept: list[str] = []
    for user in users:
        xs, ys = [], []
        for image, label in by_user[user]:
            p = image_dir / f"{image}.jpg"
            if not p.is_file():
                if missing_images == "skip":
                    continue
                raise DataNotFoundError(f"image {p} (user {user!r}) listed in {csv_path} is "
                                        "missing; pass missing_images='skip' to drop it")
            xs.append(load_image(p, image_size))
            ys.append(label)
        if not xs:
            continue
        n = len(xs)
        n_te = min(int(round(test_fraction * n)), n - 1)
        perm = generator(seed, "gldv2_split", user).permutation(n)
        idx = {"train": np.sort(perm[n_te:]), "test": np.sort(perm[:n_te])}
        for split in ("train", "test"):
            bx, by, bc = per_split[split]
            bx += [xs[i] for i in idx[split]]
            by += [ys[i] for i in idx[split]]
            bc += [len(kept)] * len(idx[split])
        kept.append(user)
    if not kept:
        raise DataFormatError(f"{csv_path}: none of the selected users has an image")
    mean, std = IMAGENET_MEAN[:, None, None], IMAGENET_STD[:, None, None]
    arrays = []
    for split in ("train", "test"):
        bx, by, bc = per_split[split]
        x = (np.stack(bx) if bx else np.zeros((0, 3, image_size, image_size), np.float32))
        arrays += [((x - mean) / std).astype(np.float32), np.asarray(by, np.int64),
                   np.asarray(bc, np.int64)]
    return FederatedDataset.from_arrays(
        *arrays, client_ids=kept, num_classes=num_classes,
        description=f"GLDv2 (federated by user) from {Path(csv_path).name}, images "
                    f"{image_size}x{image_size}, ImageNet-normalised",
        meta={"image_size": image_size, "mean": IMAGENET_MEAN, "std": IMAGENET_STD,
              "test_fraction": test_fraction, "seed": seed},
    )
