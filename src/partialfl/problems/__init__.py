"""Federated problems: closed-form (numpy) and model-based (torch)."""

from partialfl.problems.base import ClosedForm, Problem, QuadraticInW
from partialfl.problems.glm import GeneralizedLinearProblem, GLMSpec
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec

__all__ = [
    "ClosedForm",
    "GLMSpec",
    "GeneralizedLinearProblem",
    "LeastSquaresProblem",
    "LeastSquaresSpec",
    "Problem",
    "QuadraticInW",
]
