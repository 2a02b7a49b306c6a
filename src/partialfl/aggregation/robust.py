"""Compatibility: the robust rules moved to :mod:`partialfl.aggregation.rules`, NNM to
:mod:`partialfl.aggregation.wrappers` and the factory to :func:`partialfl.build.make_aggregator`
(import the classes from :mod:`partialfl.aggregation`)."""

from partialfl.aggregation.common import bind, drop_nonfinite, finite_rows, to_numpy
from partialfl.aggregation.rules import (
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    TrimmedMean,
)
from partialfl.aggregation.wrappers import NearestNeighborMixing

__all__ = ["CenteredClipping", "CoordinateMedian", "GeometricMedian", "Krum",
           "NearestNeighborMixing", "TrimmedMean", "bind", "drop_nonfinite", "finite_rows",
           "to_numpy"]
