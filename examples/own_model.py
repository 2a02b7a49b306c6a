"""FFGG on your own torch model and data in a few lines.

Each client here has its own label permutation (so a personal output layer helps); replace
the synthetic data with yours (any per-client tensors) and the model with yours.

    python examples/own_model.py
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from partialfl.algorithms.model import model_ffgg
from partialfl.data.federated import FederatedDataset
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.model import ModelProblem
from partialfl.runtime import run_rounds
from partialfl.server import SGD
from partialfl.split import make_split, split_report


def synthetic_clients(num_clients: int = 12, n: int = 80, seed: int = 0) -> FederatedDataset:
    g = np.random.default_rng(seed)
    centers = g.standard_normal((4, 10)) * 2
    xs, ys = [], []
    for _ in range(num_clients):
        perm = g.permutation(4)                       # client-specific labelling
        y = g.integers(0, 4, 2 * n)
        x = centers[y] + g.standard_normal((2 * n, 10))
        xs.append(torch.tensor(x, dtype=torch.float32))
        ys.append(torch.tensor(perm[y], dtype=torch.int64))
    return FederatedDataset([x[:n] for x in xs], [y[:n] for y in ys],
                            [x[n:] for x in xs], [y[n:] for y in ys],
                            client_ids=[f"client{i}" for i in range(num_clients)], num_classes=4)


def main(rounds: int = 30) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    split = make_split(model, "output")               # last layer personal, the rest global
    print(split_report(model, ["input", "output", "adapter"]))
    problem = ModelProblem(split, synthetic_clients())
    ffgg = model_ffgg(SGDConfig(lr=0.1, epochs=2, batch_size=16), init="zero",
                      server_opt=SGD(lr=0.5))
    result = run_rounds(problem, ffgg, rounds, clients_per_round=6, seed=0,
                        evaluate=round_evaluator(["test"]), eval_every=10)
    for rec in result.history:
        print(f"round {rec['round']:3d}  test accuracy {rec['test_acc']:.3f}")
    return result.history[-1]["test_acc"]


if __name__ == "__main__":
    main()
