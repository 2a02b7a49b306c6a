"""A validation split carved from each client's *training* data (never its test data).

Client m with n_m training examples gives k_m = min(n_m − 1, max(min_examples,
round(fraction · n_m))) of them (k_m = 0 when n_m < 2) to validation, chosen by a permutation
from ``partialfl.rng.generator(seed, "validation", m)``; the rest stay for training. Two views
share the tensors:

* ``fit``: train = the remaining training examples, test = the client's real test examples;
* ``val``: train = the same remaining examples, test = the validation examples.

Stages that choose anything (when to stop, which fine-tuning setting) run on ``val``, whose
"test" split is the validation data, so no choice can read a test example.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from partialfl.data.federated import FederatedDataset
from partialfl.rng import generator


@dataclass(frozen=True)
class ValidationViews:
    """The two views of :func:`carve_validation` and the per-client validation sizes."""

    fit: FederatedDataset
    val: FederatedDataset
    sizes: np.ndarray


def validation_sizes(train_sizes: np.ndarray, fraction: float, min_examples: int) -> np.ndarray:
    """k_m = min(n_m − 1, max(min_examples, round(fraction · n_m))), 0 when n_m < 2."""
    n = np.asarray(train_sizes, dtype=np.int64)
    k = np.maximum(int(min_examples), np.rint(fraction * n).astype(np.int64))
    return np.where(n < 2, 0, np.minimum(k, n - 1))


def carve_validation(data: FederatedDataset, fraction: float, min_examples: int, seed: int
                     ) -> ValidationViews:
    """Split every client's training data into (train, validation); see the module doc."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation fraction must be in (0, 1), got {fraction}")
    if not isinstance(min_examples, int) or min_examples < 0:
        raise ValueError(f"validation min_examples must be an integer >= 0, got {min_examples!r}")
    sizes = validation_sizes(data.train_sizes(), fraction, min_examples)
    tr_x, tr_y, va_x, va_y = [], [], [], []
    for m in range(data.num_clients):
        x, y = data.train_x[m], data.train_y[m]
        perm = generator(seed, "validation", m).permutation(x.shape[0])
        val = torch.from_numpy(np.sort(perm[:sizes[m]]))
        keep = torch.from_numpy(np.sort(perm[sizes[m]:]))
        tr_x.append(x[keep])
        tr_y.append(y[keep])
        va_x.append(x[val])
        va_y.append(y[val])
    common = dict(train_x=tuple(tr_x), train_y=tuple(tr_y), client_ids=data.client_ids,
                  num_classes=data.num_classes, meta=dict(data.meta))
    desc = f"{fraction:g} of each client's training data (min {min_examples}) held out"
    fit = FederatedDataset(test_x=data.test_x, test_y=data.test_y,
                           description=f"{data.description}; {desc}", **common)
    val = FederatedDataset(test_x=tuple(va_x), test_y=tuple(va_y),
                           description=f"{data.description}; {desc} as the test split",
                           **common)
    return ValidationViews(fit, val, sizes)
