"""Small helpers on parameter trees (dicts name -> numpy array or torch tensor)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from partialfl import arrays
from partialfl.types import Params


def tree_map(fn: Callable, *trees: Params) -> Params:
    """Apply ``fn`` leafwise over trees that share the same keys."""
    first = trees[0]
    for t in trees[1:]:
        if t.keys() != first.keys():
            raise KeyError(f"trees have different keys: {sorted(first)} vs {sorted(t)}")
    return {k: fn(*(t[k] for t in trees)) for k in first}


def tree_add(a: Params, b: Params, scale: float = 1.0) -> Params:
    """a + scale·b."""
    return {k: a[k] + scale * b[k] for k in a}


def tree_sub(a: Params, b: Params) -> Params:
    """a − b, leaf by leaf."""
    return {k: a[k] - b[k] for k in a}


def tree_scale(a: Params, s: float) -> Params:
    """s·a, leaf by leaf."""
    return {k: s * v for k, v in a.items()}


def tree_sq_norm(a: Params) -> float:
    """Σ over leaves of ‖leaf‖², as a float."""
    return float(sum(float((v * v).sum()) for v in a.values()))


def tree_copy(a: Params) -> Params:
    """An independent copy of every leaf (torch tensors cloned, arrays copied)."""
    return {k: arrays.copy(v) for k, v in a.items()}


def tree_stack_index(a: Params, idx) -> Params:
    """Leading-axis selection of a stacked tree."""
    return {k: v[idx] for k, v in a.items()}


def flatten_stacked(tree: Params) -> tuple[object, Callable[[object], Params]]:
    """Concatenate the leaves of a stacked tree ``[k, ...]`` into ``[k, D]``.

    Returns the matrix and a function mapping a ``[D]`` vector back to an unstacked tree (or
    a ``[k, D]`` matrix back to a stacked one).
    """
    names = list(tree)
    shapes = [tuple(tree[n].shape[1:]) for n in names]
    sizes = [int(np.prod(s)) if s else 1 for s in shapes]
    leaves = [tree[n].reshape(tree[n].shape[0], -1) for n in names]
    mat = arrays.concat(leaves, 1)

    def unflatten(vec) -> Params:
        out, i = {}, 0
        lead = tuple(vec.shape[:-1])  # () for a vector, (k,) for a matrix
        for n, s, z in zip(names, shapes, sizes):
            out[n] = vec[..., i : i + z].reshape(lead + s)
            i += z
        return out

    return mat, unflatten


def fitted(own: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (torch tensors) cast to the dtype of ``own``'s tensors of the same names,
    each of that tensor's shape and finite in that dtype (a finite float64 1e300 is inf in a
    float32 module); otherwise a ValueError naming the leaf (``copy_`` would broadcast a
    misshaped leaf and keep a NaN without a word)."""
    import torch

    cast = {}
    for n, v in values.items():
        if tuple(own[n].shape) != tuple(v.shape):
            raise ValueError(f"{n!r}: saved shape {tuple(v.shape)} does not fit the "
                             f"module's {tuple(own[n].shape)}")
        cast[n] = c = v.to(own[n].dtype)
        if (v.is_floating_point() and not bool(torch.isfinite(v).all())) or (
                c.is_floating_point() and not bool(torch.isfinite(c).all())):
            raise ValueError(f"{n!r}: the saved values are not all finite in the module's "
                             f"dtype {own[n].dtype}")
    return cast
