"""Aggregation rules: (stacked update vectors [k, d], weights [k]) -> [d].

The server applies an aggregator to the stacked θ-vectors its cohort sent. ``mean`` is the
default; robust rules (for Byzantine-robust FFGG, Algorithm 5) live beside it.
"""

from partialfl.aggregation.basic import Aggregator, Mean, aggregate_tree
from partialfl.aggregation.bucketing import Bucketing
from partialfl.aggregation.robust import (
    AGGREGATORS,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    NearestNeighborMixing,
    TrimmedMean,
    bind,
    drop_nonfinite,
    finite_rows,
    make_aggregator,
)

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "Bucketing",
    "CenteredClipping",
    "CoordinateMedian",
    "GeometricMedian",
    "Krum",
    "Mean",
    "NearestNeighborMixing",
    "TrimmedMean",
    "aggregate_tree",
    "bind",
    "drop_nonfinite",
    "finite_rows",
    "make_aggregator",
]
