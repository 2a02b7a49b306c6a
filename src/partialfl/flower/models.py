"""Model problems on Flower: what a SuperNode's evaluation sends (sums over its clients) and
how the ServerApp pools them. The problem and the algorithm are built from the spec
(:mod:`partialfl.flower.stage`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from partialfl.algorithms.base import RoundContext
from partialfl.stats import ratio_of_sums


def evaluate_model_clients(rt, state) -> dict[str, Any]:
    """Sums over this node's clients of the test counts of
    :meth:`~partialfl.problems.model.ModelProblem.metric_counts` (:func:`count_sums`), or
    ``{}`` when fewer than ``rt.eval_min_clients`` of them have test data. No per-client value
    is sent."""
    own = rt.clients
    dep = rt.algorithm.deploy(state, rt.problem, own, None, RoundContext(rt.cfg.seed, -1))
    return count_sums(rt.problem.metric_counts(own, dep.theta, dep.w, "test"),
                      getattr(rt, "eval_min_clients", 1))


def count_sums(per_client: dict[str, Any], min_clients: int = 1) -> dict[str, Any]:
    """The node's evaluation reply from its per-client counts (which stay on the node):
    ``clients``, ``correct.sum``, ``total.sum``, ``loss_sum.sum``, ``loss_weight.sum`` and
    ``acc.count`` (the number of clients with test data) — or ``{}`` (withheld) when fewer
    than ``min_clients`` clients have test data, so no reply is about fewer clients than that.
    Linear sums only: the sum of the per-client accuracies c_m/t_m, sent with Σ c_m and Σ t_m,
    gave the server each client's exact c_m and t_m on a node of two clients (the default
    eval-min-clients) — so the mean per-client accuracy is not computed on Flower."""
    counts = {k: np.asarray(v, dtype=np.float64) for k, v in per_client.items()}
    t = counts["total"]
    acc = counts["correct"][t > 0] / t[t > 0]
    if acc.size < min_clients:
        return {}
    out: dict[str, Any] = {"clients": float(len(t))}
    out.update({f"{k}.sum": float(v.sum()) for k, v in counts.items()})
    out["acc.count"] = float(acc.size)
    return out


def summarize_sums(sums: dict[str, Any]) -> dict[str, float]:
    """The server's evaluation metrics from the nodes' summed counts (each entry a sum, or
    the list of the nodes' sums): pooled accuracy and loss. No mean or percentiles over
    clients: they need per-client values (see :func:`count_sums`), which the SuperNodes do
    not send."""
    return {"eval_acc": ratio_of_sums(sums["correct.sum"], sums["total.sum"]),
            "eval_loss": ratio_of_sums(sums["loss_sum.sum"], sums["loss_weight.sum"])}
