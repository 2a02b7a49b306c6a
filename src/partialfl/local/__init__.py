"""Local solvers: approximate w*_m(θ) = argmin_w f_m(θ, w) on each client of a cohort.

Every solver starts afresh (clients are stateless in FFGG) from zero or random w, and returns
the approximate minimiser together with the number of local gradient (or Hessian-vector)
computations it spent per client. By name: :func:`partialfl.build.make_solver`.
"""

from partialfl.local.solvers import (
    ConjugateGradient,
    ExactSolver,
    GradientDescent,
    LocalSolver,
    SolverResult,
)

__all__ = [
    "ConjugateGradient",
    "ExactSolver",
    "GradientDescent",
    "LocalSolver",
    "SolverResult",
]
