"""Federated problems: closed-form (numpy) and model-based (torch)."""

from partialfl.problems.base import ClosedForm, Problem, QuadraticInW
from partialfl.problems.least_squares import LeastSquaresProblem

__all__ = [
    "ClosedForm",
    "LeastSquaresProblem",
    "Problem",
    "QuadraticInW",
]
