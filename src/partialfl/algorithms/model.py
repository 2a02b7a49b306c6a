"""FFGG on model problems (:class:`partialfl.problems.model.ModelProblem`), and where the
model algorithms' names live.

FFGG itself is :class:`partialfl.algorithms.ffgg.FFGG` with the
:class:`~partialfl.local.sgd.SGDFineTuner` local solver (see :func:`model_ffgg`). FedAvg
(:mod:`partialfl.algorithms.fedavg`) and Local FFGG, FedAlt, FedSim
(:mod:`partialfl.algorithms.personal`) run on any problem; with an
:class:`~partialfl.local.sgd.SGDConfig` client optimizer they are the model-problem methods:

* FedAvg — SGD epochs on every parameter from θʳ, send Δ = θ_local − θʳ; the server steps
  with −mean Δ (server SGD lr 1 = averaging, Adam = FedAdam). Its problem must have no personal
  parameter (split ``none``) unless it shares w; a model with BatchNorm keeps each client's
  running statistics on the client (runtime-held client state, never sent).
* Local FFGG (Algorithm 4), FedAlt / FedSim (Pillutla et al. 2022): see their module.
"""

from __future__ import annotations

from partialfl.algorithms.common import WEIGHTINGS, check_init
from partialfl.algorithms.fedavg import FedAvg
from partialfl.algorithms.ffgg import FFGG
from partialfl.algorithms.personal import FedAlt, FedSim, LocalFFGG
from partialfl.local.sgd import SGDConfig

__all__ = ["WEIGHTINGS", "FedAlt", "FedAvg", "FedSim", "LocalFFGG", "model_ffgg"]


def model_ffgg(finetune: SGDConfig, init: str = "pretrained", server_opt=None, aggregator=None,
               weighting: str = "uniform") -> FFGG:
    """FFGG (Algorithm 1) on a model problem: each sampled client fine-tunes a fresh w with
    ``finetune`` SGD epochs (θʳ fixed, w from ``init``) and sends ∇_θ f_m(θʳ, w_m) on its full
    training data."""
    return FFGG(finetune.finetuner(check_init(init)), server_opt, aggregator, weighting)
