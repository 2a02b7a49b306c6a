"""Algorithms: what a client computes and sends, and how the server updates θ."""

from partialfl.algorithms.base import (
    Algorithm,
    ClientResult,
    Deployed,
    RoundContext,
    ServerState,
)
from partialfl.algorithms.ffgg import FFGG
from partialfl.algorithms.joint import LocalGD, Scaffold
from partialfl.algorithms.l2gd import L2GD

__all__ = [
    "FFGG",
    "L2GD",
    "Algorithm",
    "ClientResult",
    "Deployed",
    "LocalGD",
    "RoundContext",
    "Scaffold",
    "ServerState",
]
