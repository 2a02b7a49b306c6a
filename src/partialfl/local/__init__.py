"""Local solvers: approximate w*_m(θ) = argmin_w f_m(θ, w) on each client of a cohort.

Every solver starts afresh (clients are stateless in FFGG) from zero or random w, and returns
the approximate minimiser together with the number of local gradient (or Hessian-vector)
computations it spent per client. Local *trainers* (:class:`LocalTrainer`: full-gradient
:class:`GDConfig` on any problem, :class:`~partialfl.local.sgd.SGDConfig` on model problems) are
the client optimizers of the algorithms that train θ locally (FedAvg, Scaffold, FedAlt, ...).
By name: the registry's kind ``local`` (``sgd``, ``gd``, ``cg``, ``exact``).
"""

from partialfl.local.base import LocalResult, LocalTrainer
from partialfl.local.gd import GDConfig
from partialfl.local.sgd import SGDConfig
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
    "GDConfig",
    "GradientDescent",
    "SGDConfig",
    "LocalResult",
    "LocalSolver",
    "LocalTrainer",
    "SolverResult",
]
