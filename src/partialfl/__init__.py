"""partialfl: partially personalized federated learning.

A model's parameters are split into global parameters θ (shared, trained by the server) and
personal parameters w_m (private to client m). The core algorithm is FFGG (Mishchenko et al.,
2023, "Partially Personalized Federated Learning: Breaking the Curse of Data Heterogeneity",
Algorithm 1): every sampled client fine-tunes w from scratch for the current θ, then sends
∇_θ f_m(θ, w); the server aggregates and steps.
"""

from partialfl.types import ClientUpdates, Params

__all__ = ["ClientUpdates", "Params", "__version__"]
__version__ = "0.1.0"
