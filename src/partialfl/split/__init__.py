"""Which parameters of a model are global (θ, shared, trained by the server) and which are
personal (w_m, private to client m, never sent anywhere).

A :class:`Split` partitions the parameter names of one torch ``nn.Module`` into two disjoint
sets that cover every parameter (:mod:`~partialfl.split.base`); the kinds — ``none``,
``input``, ``output``, ``adapter`` (:mod:`~partialfl.split.adapters`), ``norm``, ``pattern``
— are registry entries of kind ``split`` built by :func:`make_split`
(:mod:`~partialfl.split.kinds`, whose docstring describes each).
"""

from partialfl.split.adapters import ConvAdapter, LowRankAdapter, insert_adapters
from partialfl.split.base import (
    ADAPTER_CHILD,
    NORM_TYPES,
    Split,
    SplitError,
    parameterised_modules,
    validate_partition,
)
from partialfl.split.kinds import SplitContext, build_split, make_split, split_report

__all__ = ["ADAPTER_CHILD", "NORM_TYPES", "ConvAdapter", "LowRankAdapter", "Split",
           "SplitContext", "SplitError", "build_split", "insert_adapters", "make_split",
           "parameterised_modules", "split_report", "validate_partition"]
