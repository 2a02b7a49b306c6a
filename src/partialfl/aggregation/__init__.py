"""Aggregation rules: (stacked update vectors [k, d], weights [k]) -> [d].

The server applies an aggregator to the stacked θ-vectors its cohort sent. ``mean`` is the
default (:mod:`~partialfl.aggregation.basic`); robust rules (for Byzantine-robust FFGG,
Algorithm 5) are listed in :mod:`~partialfl.aggregation.rules` and live by kind in
:mod:`~partialfl.aggregation.coordinate`, :mod:`~partialfl.aggregation.distance`,
:mod:`~partialfl.aggregation.geometric_median` and :mod:`~partialfl.aggregation.spectral`;
the wrappers (bucketing, NNM, ARC, static clipping) in :mod:`~partialfl.aggregation.wrappers`,
a rule with its wrappers in :mod:`~partialfl.aggregation.compose` (by name:
:func:`partialfl.build.make_aggregator`), the refusal of unprotected settings in
:mod:`~partialfl.aggregation.protection`, shared helpers in :mod:`~partialfl.aggregation.common`.
"""

from partialfl.aggregation.basic import Aggregator, Mean, aggregate_tree
from partialfl.aggregation.common import (
    NonFiniteInputError,
    bind,
    drop_nonfinite,
    finite_rows,
    to_numpy,
)
from partialfl.aggregation.compose import PRE_AGGREGATORS, compose
from partialfl.aggregation.protection import UnprotectedError, UnprotectedWarning, tolerated
from partialfl.aggregation.rules import (
    CAF,
    MDA,
    SMEA,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Meamed,
    MoNNA,
    TrimmedMean,
)
from partialfl.aggregation.wrappers import ARC, Bucketing, NearestNeighborMixing, StaticClipping

__all__ = [
    "ARC",
    "CAF",
    "MDA",
    "PRE_AGGREGATORS",
    "SMEA",
    "Aggregator",
    "Bucketing",
    "CenteredClipping",
    "CoordinateMedian",
    "GeometricMedian",
    "Krum",
    "Mean",
    "Meamed",
    "MoNNA",
    "NearestNeighborMixing",
    "NonFiniteInputError",
    "StaticClipping",
    "TrimmedMean",
    "UnprotectedError",
    "UnprotectedWarning",
    "aggregate_tree",
    "bind",
    "drop_nonfinite",
    "finite_rows",
    "compose",
    "to_numpy",
    "tolerated",
]
