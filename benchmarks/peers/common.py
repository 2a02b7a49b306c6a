"""What every runner of ``benchmarks/peers.py`` shares (numpy + torch only, so it imports in
the peers' own virtual environments too).

The *cohort file* (written by ``peers.py`` from partialfl's FEMNIST problem) holds, for the
10 writers of the round, each writer's training examples already in the order of its
minibatches (partialfl's batch plan of the round, so a peer that slices its data into
consecutive batches of ``batch`` takes the same steps), the initial weights θ⁰ and the
round's settings (``algorithm``: ``fedavg`` or ``ffgg``). The model is the EMNIST CNN of
``partialfl.models`` (imported from the repository's ``src``: the same module definition in
every library).

FFGG's client (:func:`ffgg_client`, for the peers that have no such method of their own):
the personal output layer ``fc`` fine-tuned for one epoch of SGD with θ fixed (from θ⁰'s
``fc``, partialfl's ``pretrained`` initialisation), then g = ∇_θ of the mean loss over the
writer's training data (chunks of ``chunk``); the server steps θ ← θ − mean g (lr 1,
example-weighted), ``fc`` unchanged.

A runner talks to ``peers.py`` over stdin/stdout: it answers ``round`` with one line
``@@peers {json}`` (the round's seconds, the examples trained on, the cohort's mean training
loss before and after) and stops at ``quit``; lines without the prefix are the libraries' own
output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

PREFIX = "@@peers "
REPO = Path(__file__).resolve().parents[2]


def emit(**msg) -> None:
    """One protocol line on stdout."""
    sys.stdout.write(PREFIX + json.dumps(msg) + "\n")
    sys.stdout.flush()


def commands():
    """The commands from ``peers.py`` (``round``), until ``quit`` or the end of stdin."""
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            return
        if cmd:
            yield cmd


def one_thread() -> None:
    """One torch thread in this process (the benchmark's convention for every library)."""
    import torch

    torch.set_num_threads(1)


class Cohort:
    """The cohort file: ``xs[m]``, ``ys[m]`` (torch, batch order), ``theta0`` (name → torch),
    ``lr``, ``batch``, ``sizes``, ``names``."""

    def __init__(self, path: str | os.PathLike) -> None:
        import torch

        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            self.k = int(meta["clients"])
            self.lr, self.batch = float(meta["lr"]), int(meta["batch"])
            self.algorithm, self.chunk = str(meta["algorithm"]), int(meta["chunk"])
            self.names = list(meta["names"])
            self.writers = list(meta["writers"])
            self.xs = [torch.from_numpy(z[f"x{m}"]) for m in range(self.k)]
            self.ys = [torch.from_numpy(z[f"y{m}"]) for m in range(self.k)]
            self.theta0 = {n: torch.from_numpy(z[f"theta/{n}"]) for n in self.names}
        self.sizes = [int(y.shape[0]) for y in self.ys]

    def model(self):
        """A fresh EMNIST CNN holding θ⁰."""
        import torch

        if str(REPO / "src") not in sys.path:
            sys.path.insert(0, str(REPO / "src"))
        from partialfl.models.cnn import EmnistCNN

        net = EmnistCNN(num_classes=62)
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(self.theta0[n])
        return net

    def mean_loss(self, weights: dict) -> float:
        """The cohort's mean training cross-entropy (over all its examples) at ``weights``."""
        import torch
        import torch.nn.functional as F

        net = self.model()
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(torch.as_tensor(np.asarray(weights[n])))
            total = sum(float(F.cross_entropy(net(x), y, reduction="sum"))
                        for x, y in zip(self.xs, self.ys))
        return total / sum(self.sizes)


PERSONAL = ("fc.weight", "fc.bias")  # FFGG's personal layer (the output layer)


def ffgg_client(net, x, y, lr: float, batch: int, chunk: int) -> dict:
    """One FFGG client on ``net`` (holding θ and the initial w): w fine-tuned in place, then
    ``name -> ∇_θ`` of the mean loss on (x, y) (θ's names only)."""
    import torch
    import torch.nn.functional as F

    params = dict(net.named_parameters())
    for n, p in params.items():
        p.requires_grad_(n in PERSONAL)
        p.grad = None
    opt = torch.optim.SGD([params[n] for n in PERSONAL], lr=lr)
    for i in range(0, len(y), batch):
        opt.zero_grad()
        F.cross_entropy(net(x[i:i + batch]), y[i:i + batch]).backward()
        opt.step()
    for n, p in params.items():
        p.requires_grad_(n not in PERSONAL)
        p.grad = None
    for i in range(0, len(y), chunk):
        (F.cross_entropy(net(x[i:i + chunk]), y[i:i + chunk], reduction="sum")
         / len(y)).backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items() if n not in PERSONAL}
    for p in params.values():
        p.requires_grad_(True)
        p.grad = None
    return grads


def save_weights(path: str | os.PathLike, weights: dict) -> None:
    """``name -> array`` as an npz (written to a temporary name, then renamed)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **{n: np.asarray(v, dtype=np.float32) for n, v in weights.items()})
    os.replace(tmp, path)


class RoundTimer:
    """Times the rounds a runner is told to run and reports each with its checks."""

    def __init__(self, cohort: Cohort, weights_out: str | None) -> None:
        self.cohort, self.weights_out, self.done = cohort, weights_out, 0
        self.loss0 = cohort.mean_loss(cohort.theta0)

    def report(self, seconds: float, examples: int, weights: dict, **extra) -> None:
        """After a round: the loss at its result (not timed), its weights saved once (the first
        round after the warm-up), the protocol line."""
        if self.done == 1 and self.weights_out:
            save_weights(self.weights_out, {n: _np(v) for n, v in weights.items()})
        self.done += 1
        emit(round_s=seconds, examples=int(examples), loss_before=self.loss0,
             loss_after=self.cohort.mean_loss({n: _np(v) for n, v in weights.items()}), **extra)


def _np(v) -> np.ndarray:
    return v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)


def now() -> float:
    return time.perf_counter()
