"""Metrics for closed-form problems (the paper's Sec. 4.2 plots).

* ``F_norm2``   ‖F(θʳ)‖², F(θ) = (1/M)Σ_m ∇₁f_m(θ, w*_m(θ))
* ``dist2``     ‖θʳ − θ*‖²  and ``rel_dist2`` = ‖θʳ − θ*‖² / ‖θ⁰ − θ*‖² (θ⁰ = 0)
* ``loss_gap``  (1/M)Σ_m f_m(θ_m, w_m) − min f_m, for the model each method deploys
  (FFGG: θʳ with w fine-tuned by its own solver; FedAvg/Scaffold: the shared (θ, w);
  L2GD: each client's own x_m). min f_m is the fully personalized optimum over (θ, w).
"""

from __future__ import annotations

import numpy as np


def closed_form_metrics(algorithm, state, problem, client_state, ctx, with_loss: bool = True):
    """An ``evaluate=`` callback for closed-form problems: ‖F(θ)‖², ‖θ − θ*‖², the relative
    distance ‖θ − θ*‖²/‖θ*‖² and (``with_loss``) the personalized loss gap of the deployed
    models."""
    theta = algorithm.global_theta(state, problem)
    star = problem.theta_star()["theta"]
    d = theta["theta"] - star
    F = problem.F(theta)
    rec = {
        "F_norm2": float(F @ F),
        "dist2": float(d @ d),
        "rel_dist2": float(d @ d) / float(star @ star),
    }
    if with_loss:
        dep = algorithm.deployed(state, problem, client_state, ctx)
        allc = np.arange(problem.num_clients)
        rec["loss_gap"] = float((problem.loss(allc, dep.theta, dep.w) - problem.f_star()).mean())
    return rec
