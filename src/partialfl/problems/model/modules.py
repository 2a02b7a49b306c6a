"""What a model problem needs to know about its torch module: the normalization layers whose
running statistics are personal client state, train mode for a minibatch step, and the
submodules that can re-initialise the personal parameters."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from partialfl.types import Params


def running_stat_modules(model: nn.Module
                         ) -> tuple[tuple[nn.Module, ...], Params, frozenset[str], tuple[str, ...]]:
    """Normalization layers with running statistics, those statistics (name → buffer copy),
    the names of their parameters and statistics, and the layers with ``momentum=None``
    (a cumulative average, which cannot run under vmap). Refuses what cannot be personal
    client state (see :mod:`partialfl.problems.model`)."""
    mods, state, names, cumulative = [], {}, set(), []
    for name, m in model.named_modules():
        if not isinstance(m, nn.modules.batchnorm._NormBase):
            continue
        if not m.track_running_stats:
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                raise ValueError(
                    f"module {name!r} is a BatchNorm without running statistics "
                    "(track_running_stats=False): it would normalize evaluation batches with "
                    "their own statistics; keep track_running_stats=True (the statistics are "
                    "personal client state) or use GroupNorm / LayerNorm")
            continue
        if m.momentum is None:
            cumulative.append(name)
        mods.append(m)
        for b, v in m.named_buffers(recurse=False):
            if v is not None:
                state[f"{name}.{b}" if name else b] = v.detach().clone()
        names.update(f"{name}.{p}" if name else p for p, _ in m.named_parameters(recurse=False))
    return (tuple(mods), state, frozenset(names) | frozenset(state), tuple(cumulative))


def fresh_stats(state: Params) -> Params:
    """Running statistics of a freshly built layer: mean 0, variance 1, count 0."""
    return {n: (torch.ones_like(v) if n.endswith("running_var") else torch.zeros_like(v))
            for n, v in state.items()}


class train_mode:  # noqa: N801 - a context manager, named like torch.no_grad
    """Context: the given modules in train mode (batch statistics), eval mode afterwards."""

    def __init__(self, modules) -> None:
        self.modules = modules

    def __enter__(self) -> None:
        for m in self.modules:
            m.train()

    def __exit__(self, *exc) -> None:
        for m in self.modules:
            m.eval()


def resettable_owners(module: nn.Module, names: Sequence[str]) -> list[str]:
    """Maximal submodules whose parameters are all personal and that can re-initialise
    themselves (``reset_parameters``), covering every personal name."""
    wanted = set(names)
    chosen: list[str] = []
    covered: set[str] = set()
    for mname, m in module.named_modules():
        if any(mname == c or mname.startswith(c + ".") for c in chosen if c) or "" in chosen:
            continue
        pnames = [f"{mname}.{n}" if mname else n for n, _ in m.named_parameters()]
        if pnames and set(pnames) <= wanted and hasattr(m, "reset_parameters"):
            chosen.append(mname)
            covered.update(pnames)
    missing = sorted(wanted - covered)
    if missing:
        raise ValueError(
            f"init 'random' needs reset_parameters() on a module owning only personal "
            f"parameters; none for {missing[:6]}"
        )
    return chosen
