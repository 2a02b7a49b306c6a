"""Devices and numeric precision for model problems.

``device`` is one of ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``auto`` (the first of CUDA,
MPS, CPU that is present). A device that is not present is refused with a message that names
the devices this machine has. ``precision`` is ``fp32`` (no autocast), ``bf16`` or ``fp16``
(``torch.autocast`` around the forward pass; parameters, gradients and optimizer state stay
fp32; fp16 adds dynamic loss scaling, see :class:`LossScaler`).

Randomness never depends on the device: every draw (client sampling, minibatch order, a fresh
personal initialisation) comes from CPU generators derived from (seed, purpose, round, client),
so the same run on another device takes the same steps and differs only by floating-point
rounding.
"""

from __future__ import annotations

import re

import torch

DEVICES = ("cpu", "cuda", "cuda:N", "mps", "auto")
PRECISIONS = ("fp32", "bf16", "fp16")
_AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def available_devices() -> list[str]:
    """The device names usable on this machine, e.g. ``['cpu', 'cuda', 'cuda:0']``."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
        out.extend(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append("mps")
    return out


def resolve_device(name: str | torch.device | None = "cpu") -> torch.device:
    """The ``torch.device`` for ``name`` (see the module docstring).

    Raises:
        ValueError: an unknown name, or a device this machine does not have; the message names
            the allowed forms and the devices available here.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if name is None:
        name = "cpu"
    if not isinstance(name, str):
        raise ValueError(f"device must be a string, got {type(name).__name__}")
    have = available_devices()
    s = name.strip().lower()
    if s == "auto":
        return torch.device("cuda" if "cuda" in have else "mps" if "mps" in have else "cpu")
    if s in ("cpu", "mps", "cuda") or re.fullmatch(r"cuda:\d+", s):
        if s not in have:
            raise ValueError(f"device {name!r} is not available on this machine; available: "
                             f"{', '.join(have)}")
        return torch.device(s)
    raise ValueError(f"unknown device {name!r}; allowed: {', '.join(DEVICES)} "
                     f"(available here: {', '.join(have)})")


def check_precision(precision: str, device: torch.device) -> str:
    """Validate ``precision`` for ``device``; returns it."""
    if precision not in _AMP_DTYPES:
        raise ValueError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    if precision != "fp32" and not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"precision {precision!r} needs autocast, which torch does not offer "
                         f"on device {device.type!r}; use fp32")
    return precision


def amp_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None for fp32)."""
    return _AMP_DTYPES[precision]


class LossScaler:
    """Dynamic loss scaling for fp16 (the scheme of mixed-precision training, Micikevicius et
    al. 2018): gradients are computed for s·loss and divided by s; when any is non-finite the
    step is recomputed with s/2; after ``growth_interval`` finite steps in a row s doubles.

    The scale is a function of the gradients' history only (no randomness), so it is the same
    on every backend that computes the same gradients.
    """

    def __init__(self, init_scale: float = 2.0**14, growth_interval: int = 200,
                 min_scale: float = 1.0, max_scale: float = 2.0**24) -> None:
        self.scale = float(init_scale)
        self.growth_interval = int(growth_interval)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self._good = 0

    def run(self, grad_fn):
        """``grad_fn(scale) -> (grads, aux)`` with grads of scale·loss; returns the unscaled
        grads and aux. Retries with a halved scale while the grads are non-finite; at the
        minimum scale the non-finite grads are returned as they are (the caller's guards
        refuse them)."""
        while True:
            g, aux = grad_fn(self.scale)
            inv = 1.0 / self.scale
            g = {n: v * inv for n, v in g.items()}
            finite = all(bool(torch.isfinite(v).all()) for v in g.values())
            if finite:
                self._good += 1
                if self._good >= self.growth_interval:
                    self.scale = min(self.scale * 2.0, self.max_scale)
                    self._good = 0
                return g, aux
            self._good = 0
            if self.scale <= self.min_scale:
                return g, aux
            self.scale = max(self.scale / 2.0, self.min_scale)


def use_threads(n: int) -> None:
    """Run torch's intra-op pool and the BLAS/OpenMP pools with ``n`` threads (a run's
    ``threads``: results repeat exactly at the same thread count)."""
    from threadpoolctl import threadpool_limits

    from partialfl.spec.run import MAX_THREADS

    if not (isinstance(n, int) and 1 <= n <= MAX_THREADS):
        raise ValueError(f"threads must be an integer in [1, {MAX_THREADS}], got {n!r}")
    torch.set_num_threads(n)
    threadpool_limits(n)
