"""Byzantine-robust aggregation rules (for BR-FFGG, the paper's Algorithm 5): the overview,
the conventions every rule shares, and the names (the rules live in
:mod:`~partialfl.aggregation.coordinate` (CM, TM, Meamed),
:mod:`~partialfl.aggregation.distance` (Krum, CC, MDA, MoNNA),
:mod:`~partialfl.aggregation.geometric_median` (GM) and :mod:`~partialfl.aggregation.spectral`
(CAF, SMEA)).

Each rule is a small frozen dataclass, validated once at construction, and called like every
aggregator: ``agg(vectors [k, d], weights [k]) -> [d]`` (numpy arrays or torch tensors; the
computation runs in float64 numpy and the result comes back in the input's type).

* :class:`CoordinateMedian`  CM(x)_j = median_i x_{i,j}.
* :class:`TrimmedMean`       per coordinate, drop the f largest and f smallest values and
  average the remaining k − 2f.
* :class:`GeometricMedian`   argmin_z Σ_i a_i ‖z − x_i‖ by the smoothed Weiszfeld iteration
  (Pillutla et al., 2022, RFA), run in the k-dimensional span of the inputs (Gram matrix).
* :class:`Krum`              Krum / multi-Krum (Blanchard et al., 2017).
* :class:`CenteredClipping`  (Karimireddy et al., 2021).
* :class:`MDA`               minimum-diameter averaging (El Mhamdi et al., 2018).
* :class:`MoNNA`             mean of the k − f nearest neighbours of a trusted input
  (Farhadkhani et al., 2023).
* :class:`Meamed`            per coordinate, mean of the k − f values closest to the median
  (Xie et al., 2018).
* :class:`CAF`               covariance-bound agnostic filter (Allouah et al., 2024).
* :class:`SMEA`              smallest-maximum-eigenvalue averaging (Allouah et al., 2023).

Conventions (where byzfl 0.0.11 differs, the byzfl call giving the same result is named):
the number of Byzantine inputs is a fraction ``delta`` of the inputs seen at call time,
f = ⌊δk⌋ (byzfl takes an integer f), so the same rule works on raw updates and on bucket means.
Krum's score sums the k − f − 2 nearest squared distances (Blanchard et al.; byzfl averages
the k − f − 1 nearest: ``byzfl.Krum(f + 1)`` selects the same input). CAF and SMEA use the
exact top eigenvalue of the covariance (byzfl: one power-iteration step from a random start,
exact only when the covariance has rank one). Ties go to the lower index. Robust rules treat
all inputs alike and ignore ``weights`` (a Byzantine client could claim any weight), except
:class:`GeometricMedian` with ``weighted=True``.

Non-finite inputs are rejected with a clear error: the server drops them first
(:func:`~partialfl.aggregation.common.drop_nonfinite`), so a NaN or inf sent by a client never
reaches θ.
"""

from partialfl.aggregation.coordinate import CoordinateMedian, Meamed, TrimmedMean
from partialfl.aggregation.distance import MDA, CenteredClipping, Krum, MoNNA
from partialfl.aggregation.geometric_median import GeometricMedian
from partialfl.aggregation.spectral import CAF, SMEA

__all__ = ["CAF", "MDA", "SMEA", "CenteredClipping", "CoordinateMedian", "GeometricMedian",
           "Krum", "Meamed", "MoNNA", "TrimmedMean"]
