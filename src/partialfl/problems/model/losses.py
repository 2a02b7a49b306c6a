"""Losses and metrics of model problems: per-example values ``ℓ_i`` (or ``(ℓ_i, d_i)``) and
per-example ``(correct, total)`` counts, registered as the ``loss`` / ``metric`` components."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from partialfl.registry import register

LossFn = Callable[[Tensor, Tensor], "Tensor | tuple[Tensor, Tensor]"]
Metric = Callable[[Tensor, Tensor], "tuple[Tensor, Tensor]"]


def cross_entropy(output: Tensor, y: Tensor) -> Tensor:
    """Per-example cross-entropy of logits ``[B, C]`` against labels ``[B]``."""
    return F.cross_entropy(output, y, reduction="none")


def accuracy(output: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-example ``(correct, total)`` counts of a classifier: ``argmax == y`` and 1."""
    return (output.argmax(-1) == y).to(output.dtype), torch.ones_like(y, dtype=output.dtype)


def masked_token_accuracy(ignore_index: int = -100) -> Metric:
    """Per-sequence ``(correct, total)`` token counts for outputs ``[B, T, V]`` and targets
    ``[B, T]``; positions with target ``ignore_index`` are not counted (next-word tasks)."""

    def metric(output: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        valid = (y != ignore_index).to(output.dtype)
        hit = (output.argmax(-1) == y).to(output.dtype) * valid
        return hit.sum(-1), valid.sum(-1)

    return metric


def pair(v: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """``(value, weight)`` of a loss or metric output (weight 1 when it gives values only)."""
    if isinstance(v, tuple):
        if len(v) != 2:
            raise ValueError("a loss/metric that returns a tuple must return (value, weight)")
        return v
    return v, torch.ones_like(v)


@register("loss", "cross-entropy")
def _cross_entropy(opts: None = None, ctx=None) -> Callable:
    """Mean cross-entropy of class logits ``[B, C]`` (classification)."""
    return cross_entropy


@register("metric", "accuracy")
def _accuracy(opts: None = None, ctx=None) -> Callable:
    """Classification accuracy: (correct, counted) per batch."""
    return accuracy
