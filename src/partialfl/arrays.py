"""The one place that tells numpy arrays and torch tensors apart.

Parameter trees hold numpy arrays (closed-form problems) or torch tensors (model problems);
everything that must treat the two differently goes through these functions, so no other
module tests ``hasattr(x, "detach")``. torch is imported only by :func:`to_torch`: a value can
only be a tensor if torch is already loaded, so numpy-only runs never pay for it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

Array = Any  # numpy.ndarray or torch.Tensor


def _torch():
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor."""
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def is_array(x: Any) -> bool:
    """Whether ``x`` is a numpy array or a torch tensor."""
    return isinstance(x, np.ndarray) or is_torch(x)


def to_numpy(x: Any) -> np.ndarray:
    """A numpy view (or copy, for a tensor off the CPU) of ``x``; a tensor is detached."""
    if is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def to_torch(x: Any):
    """A contiguous CPU torch tensor copy of ``x`` (array or tensor; imports torch)."""
    import torch  # noqa: PLC0415 - only when a tensor is asked for

    if is_torch(x):
        return x.detach().cpu().contiguous().clone()
    return torch.from_numpy(np.array(x, copy=True, order="C"))


def as_like(values: Any, ref: Array, dtype: Any = None) -> Array:
    """``values`` (array-like) as the kind of ``ref``: a tensor on ``ref``'s device with its
    dtype, or a numpy array (``ref``'s dtype unless ``dtype`` is given)."""
    if is_torch(ref):
        return _torch().as_tensor(to_numpy(values), dtype=dtype or ref.dtype, device=ref.device)
    return np.asarray(to_numpy(values), dtype=dtype or ref.dtype)


def plain(x: Array) -> Array:
    """``x``'s values only, as a plain array of the base class: nothing a subclass, a Python
    attribute, a dtype's metadata, the strides of a size-1 axis (any stride leaves values and
    contiguity unchanged), flags, a tensor's autograd version counter, names or the buffer of
    which ``x`` is a view (``.base``, a tensor's storage) carries survives. A tensor is always
    copied into a fresh one; a numpy array is kept as it is only when it already is that: a
    base-class, writeable, C-ordered array with canonical strides owning exactly its values."""
    if is_torch(x):
        t = x.detach().as_subclass(_torch().Tensor)
        return _torch().empty(tuple(t.shape), dtype=t.dtype, device=t.device).copy_(t)
    a = np.asarray(x)
    if (a is x and a.base is None and a.dtype.metadata is None and a.flags.writeable
            and a.flags.aligned and a.size and a.strides == _c_strides(a.shape, a.itemsize)):
        return a
    out = np.empty(a.shape, dtype=np.dtype(a.dtype.str))  # (np.array keeps dtype metadata)
    out[...] = a
    return out


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The strides numpy gives a fresh C-ordered array of ``shape`` (not empty)."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def copy(x: Array) -> Array:
    """An independent copy (a tensor is cloned, an array copied)."""
    return x.clone() if is_torch(x) else np.array(x, copy=True)


def concat(xs: Sequence[Array], axis: int = 0) -> Array:
    """Concatenation along ``axis`` of arrays of one kind."""
    if is_torch(xs[0]):
        return _torch().cat(list(xs), axis)
    return np.concatenate(xs, axis)


def take_rows(x: Array, idx: Any) -> Array:
    """``x[idx]`` along the leading axis, with ``idx`` integer positions or a bool mask."""
    idx = np.asarray(idx)
    if idx.dtype == bool:
        idx = np.flatnonzero(idx)
    if is_torch(x):
        return x[_torch().as_tensor(idx, device=x.device)]
    return x[idx]


def rows_finite(x: Array) -> np.ndarray:
    """``[k]`` bool: the rows of ``x`` (leading axis) without NaN or ±inf.

    One pass where ``x`` lives (a tensor stays on its device): a row's sum is finite unless
    the row holds NaN/±inf or its finite values overflow the sum, so only rows whose sum is
    not finite get the exact elementwise check (≈ 40× cheaper than an elementwise mask on a
    cohort's stacked updates)."""
    if len(x.shape) and x.shape[0] == 0:  # no row (an empty round): nothing to check
        return np.ones(0, dtype=bool)
    if is_torch(x):
        torch = _torch()
        t = x.detach().reshape(x.shape[0], -1)
        if not (t.dtype.is_floating_point or t.dtype.is_complex):
            return np.ones(t.shape[0], dtype=bool)
        acc = torch.float32 if t.dtype.itemsize < 4 else None  # fp16/bf16 sums overflow
        ok = torch.isfinite(t.sum(1, dtype=acc)).cpu().numpy()
        for i in np.flatnonzero(~ok):
            ok[i] = bool(torch.isfinite(t[i]).all())
        return ok
    a = np.asarray(x)
    if a.dtype.kind not in "fc":
        return np.ones(a.shape[0], dtype=bool)
    a = a.reshape(a.shape[0], -1)
    with np.errstate(over="ignore", invalid="ignore"):
        ok = np.isfinite(a.sum(1, dtype=np.float32 if a.dtype.itemsize < 4 else None))
    for i in np.flatnonzero(~ok):
        ok[i] = bool(np.isfinite(a[i]).all())
    return ok


def per_row(v: Any, ref: Array) -> Array:
    """A ``[k]`` vector of per-row scalars shaped ``[k, 1, ...]`` to scale ``ref`` ``[k, ...]``
    row by row (in ``ref``'s kind, dtype and device)."""
    return as_like(np.asarray(v, dtype=np.float64).reshape((-1,) + (1,) * (ref.ndim - 1)),
                   ref)


def repeat_rows(x: Array, k: int) -> Array:
    """``[k, ...]``: ``k`` independent copies of ``x`` stacked on a new leading axis."""
    if is_torch(x):
        return x.unsqueeze(0).repeat((k,) + (1,) * x.dim())
    return np.repeat(np.asarray(x)[None], k, 0)


def zeros_like(x: Array) -> Array:
    """Zeros of ``x``'s shape, kind, dtype (and device)."""
    return _torch().zeros_like(x) if is_torch(x) else np.zeros_like(x)


def where_rows(mask: Any, a: Array, b: Array) -> Array:
    """Row ``i`` of ``a`` where ``mask[i]``, else row ``i`` of ``b`` (same kind and shape)."""
    m = np.asarray(mask, dtype=bool).reshape((-1,) + (1,) * (a.ndim - 1))
    if is_torch(a):
        return _torch().where(_torch().as_tensor(m, device=a.device), a, b)
    return np.where(m, a, b)
