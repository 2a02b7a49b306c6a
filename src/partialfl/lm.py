"""Next-word prediction: the masked training loss and the masked top-1 accuracy.

Following TFF's StackOverflow task (and Pillutla et al. 2022, used by the paper), accuracy is
measured only on *real words*: a position t counts iff its target y_t is none of
pad, out-of-vocabulary, beginning- or end-of-sentence (:data:`partialfl.data.text.SPECIAL_IDS`).
The prediction is the arg-max over *all* ids, so predicting OOV or EOS for a real word is an
error. For client m with counted positions P_m,

    correct_m = #{t ∈ P_m : argmax_v logits_t[v] = y_t},    total_m = |P_m|,
    accuracy  = Σ_m correct_m / Σ_m total_m                (weighted over clients = pooled)

and the per-client distribution is {correct_m / total_m} over clients with total_m > 0.
:class:`NextWordAccuracy` gives the per-sequence counts (the pluggable ``metric`` of
:class:`partialfl.problems.model.ModelProblem`, which sums them per client);
:func:`partialfl.pipeline.evaluation.summarize_counts` turns per-client counts into the weighted
accuracy and the distribution (10th / 50th / 90th percentile, mean over clients).

The training loss is the mean cross-entropy over non-pad targets (EOS and OOV targets are
trained on, as in TFF; pad positions are ignored, unlike Pillutla et al.'s code, which also
trains the model to predict pad after EOS).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from partialfl.data.text import PAD, SPECIAL_IDS
from partialfl.registry import register


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = PAD) -> Tensor:
    """Mean cross-entropy of ``logits [..., T, V]`` against ``targets [..., T]``, ignoring pad."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index)


def token_cross_entropy(logits: Tensor, targets: Tensor,
                        ignore_index: int = PAD) -> tuple[Tensor, Tensor]:
    """Per-sequence ``(Σ_t CE_t, #counted t)`` over the non-pad targets: ``[B]`` each.

    This is the ``loss_fn`` of :class:`partialfl.problems.model.ModelProblem` for next-word
    prediction: a client's loss is Σ token losses / Σ tokens over its sequences, i.e. the
    mean over its non-pad target tokens (the same as :func:`lm_loss` on all its data)."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                         reduction="none", ignore_index=ignore_index).reshape(targets.shape)
    valid = (targets != ignore_index).to(ce.dtype)
    return (ce * valid).sum(-1), valid.sum(-1)


def counted_mask(targets: Tensor, ignore: Sequence[int] = SPECIAL_IDS) -> Tensor:
    """Boolean mask of the target positions the accuracy counts (targets not in ``ignore``)."""
    mask = torch.ones_like(targets, dtype=torch.bool)
    for i in ignore:
        mask = mask & (targets != i)
    return mask


class NextWordAccuracy:
    """Top-1 next-word accuracy as per-example ``(correct, total)`` counts.

    ``metric(logits [B, T, V], targets [B, T]) -> (correct [B], total [B])`` (float counts
    summed over the positions of each sequence; for ``[B, V]`` / ``[B]`` inputs, 0/1 per
    example). This is the pluggable ``metric`` of
    :class:`partialfl.problems.model.ModelProblem`; summing over all sequences of a client and
    dividing gives its accuracy. ``ignore``: target ids not counted (default: pad, OOV, BOS,
    EOS).
    """

    name = "accuracy"

    def __init__(self, ignore: Sequence[int] = SPECIAL_IDS) -> None:
        self.ignore = tuple(int(i) for i in ignore)

    def __call__(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        if logits.shape[:-1] != targets.shape:
            raise ValueError(f"logits {tuple(logits.shape)} must be targets "
                             f"{tuple(targets.shape)} plus a vocabulary axis")
        mask = counted_mask(targets, self.ignore).to(logits.dtype)
        hit = (logits.argmax(dim=-1) == targets).to(logits.dtype) * mask
        if targets.dim() > 1:
            dims = tuple(range(1, targets.dim()))
            return hit.sum(dims), mask.sum(dims)
        return hit, mask

    def __repr__(self) -> str:
        return f"NextWordAccuracy(ignore={self.ignore})"


@register("loss", "token-cross-entropy")
def _token_cross_entropy(opts: None = None, ctx=None):
    """Mean cross-entropy over the non-padding tokens of ``[B, T, V]`` logits (language
    models)."""
    return token_cross_entropy


@register("metric", "next-word-accuracy")
def _next_word_accuracy(opts: None = None, ctx=None):
    """Accuracy of next-word prediction over the counted tokens (no padding, <unk>, <bos>,
    <eos>), as in the paper's StackOverflow / Shakespeare tables."""
    return NextWordAccuracy()
