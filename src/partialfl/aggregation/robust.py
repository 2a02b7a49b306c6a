"""Compatibility: the robust rules moved to :mod:`partialfl.aggregation.rules`, NNM to
:mod:`partialfl.aggregation.wrappers` and the factory to :mod:`partialfl.aggregation.registry`
(import from :mod:`partialfl.aggregation`)."""

from partialfl.aggregation.common import bind, drop_nonfinite, finite_rows, to_numpy
from partialfl.aggregation.registry import AGGREGATORS, make_aggregator
from partialfl.aggregation.rules import (
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    TrimmedMean,
)
from partialfl.aggregation.wrappers import NearestNeighborMixing

__all__ = ["AGGREGATORS", "CenteredClipping", "CoordinateMedian", "GeometricMedian", "Krum",
           "NearestNeighborMixing", "TrimmedMean", "bind", "drop_nonfinite", "finite_rows",
           "make_aggregator", "to_numpy"]
