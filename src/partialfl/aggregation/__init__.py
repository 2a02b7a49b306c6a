"""Aggregation rules: (stacked update vectors [k, d], weights [k]) -> [d].

The server applies an aggregator to the stacked θ-vectors its cohort sent. ``mean`` is the
default; robust rules (for Byzantine-robust FFGG, Algorithm 5) live beside it.
"""

from partialfl.aggregation.basic import Aggregator, Mean, aggregate_tree

__all__ = ["Aggregator", "Mean", "aggregate_tree"]
