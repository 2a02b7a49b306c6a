"""Algorithms: what a client computes and sends, and how the server updates θ.

Importing this package registers every algorithm and wrapper (registry kinds ``algorithm``
and ``wrapper``)."""

from partialfl.algorithms import (  # noqa: F401 - registers their entries
    apfl,
    asynchronous,
    byzantine,
    ditto,
    dp,
    fedprox,
    presets,
)
from partialfl.algorithms.base import (
    Algorithm,
    ClientResult,
    Deployed,
    RoundContext,
    ServerState,
)
from partialfl.algorithms.fedavg import FedAvg, LocalGD, Scaffold
from partialfl.algorithms.ffgg import FFGG
from partialfl.algorithms.l2gd import L2GD
from partialfl.algorithms.personal import FedAlt, FedSim, LocalFFGG

__all__ = [
    "FFGG",
    "L2GD",
    "Algorithm",
    "ClientResult",
    "Deployed",
    "FedAlt",
    "FedAvg",
    "FedSim",
    "LocalFFGG",
    "LocalGD",
    "RoundContext",
    "Scaffold",
    "ServerState",
]
