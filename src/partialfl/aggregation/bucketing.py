"""Compatibility: :class:`Bucketing` moved to :mod:`partialfl.aggregation.wrappers`."""

from partialfl.aggregation.wrappers import Bucketing

__all__ = ["Bucketing"]
