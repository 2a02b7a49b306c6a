"""The next-word metric: special-token masking, weighting over clients, the masked loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partialfl.data.federated import FederatedDataset
from partialfl.data.text import BOS, EOS, OOV, PAD
from partialfl.lm import NextWordAccuracy, counted_mask, lm_loss, token_cross_entropy
from partialfl.pipeline.evaluation import summarize_counts

V = 8  # ids 0..3 special, 4..7 words


def _logits_predicting(pred: list[list[int]]) -> torch.Tensor:
    """Logits [B, T, V] whose arg-max is ``pred``."""
    p = torch.tensor(pred)
    out = torch.zeros(*p.shape, V)
    out.scatter_(-1, p.unsqueeze(-1), 5.0)
    return out


def test_accuracy_ignores_pad_oov_bos_eos_by_hand():
    targets = torch.tensor([[4, 5, EOS, PAD, PAD],
                            [OOV, 6, 7, BOS, 4]])
    preds = [[4, 7, EOS, PAD, PAD],        # word ok, word wrong, EOS "ok" (ignored), pads
             [OOV, 6, 4, BOS, 4]]          # OOV "ok" (ignored), ok, wrong, BOS (ignored), ok
    correct, total = NextWordAccuracy()(_logits_predicting(preds), targets)
    # counted positions: (0,0) (0,1) (1,1) (1,2) (1,4) -> 5; correct: (0,0) (1,1) (1,4) -> 3
    assert correct.tolist() == [1, 2] and total.tolist() == [2, 3]   # per sequence
    assert counted_mask(targets).tolist() == [[True, True, False, False, False],
                                              [False, True, True, False, True]]


def test_predicting_a_special_token_for_a_real_word_is_wrong():
    targets = torch.tensor([[4, 5, 6]])
    for special in (PAD, OOV, BOS, EOS):
        c, t = NextWordAccuracy()(_logits_predicting([[special, 5, special]]), targets)
        assert (c.item(), t.item()) == (1, 3)


def test_all_special_targets_count_nothing_and_custom_ignore():
    targets = torch.tensor([[PAD, OOV, BOS, EOS]])
    c, t = NextWordAccuracy()(_logits_predicting([[PAD, OOV, BOS, EOS]]), targets)
    assert (c.item(), t.item()) == (0, 0)
    # ignoring only pad: the three other specials count (and are predicted right)
    c, t = NextWordAccuracy(ignore=(PAD,))(_logits_predicting([[PAD, OOV, BOS, EOS]]), targets)
    assert (c.item(), t.item()) == (3, 3)
    # classifier-shaped input [B, V] / [B]: 0/1 per example
    c, t = NextWordAccuracy()(_logits_predicting([[4, 5, 0]])[0], torch.tensor([4, 6, 0]))
    assert c.tolist() == [1, 0, 0] and t.tolist() == [1, 1, 0]


def test_accuracy_matches_brute_force_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 9, V, generator=g)
    targets = torch.randint(0, V, (6, 9), generator=g)
    logits[:3, :, :].scatter_(-1, targets[:3].unsqueeze(-1), 10.0)   # some right answers
    c, t = NextWordAccuracy()(logits, targets)
    c, t = c.sum(), t.sum()
    cc = tt = 0
    for b in range(6):
        for s in range(9):
            y = int(targets[b, s])
            if y in (PAD, OOV, BOS, EOS):
                continue
            tt += 1
            cc += int(int(torch.argmax(logits[b, s])) == y)
    assert (int(c), int(t)) == (cc, tt) and cc > 0


def test_shape_error():
    with pytest.raises(ValueError, match="vocabulary axis"):
        NextWordAccuracy()(torch.zeros(2, 3, V), torch.zeros(2, 4, dtype=torch.long))


def test_weighted_over_clients_and_per_client_distribution():
    """Two hand-made clients through ModelProblem.metric_counts + summarize_counts."""
    from partialfl.problems.model import ModelProblem
    from partialfl.split import make_split

    class Model(torch.nn.Module):         # logits = table[input]: predicts table's arg-max
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(V, V))

        def forward(self, x):
            return self.table[x]

    model = Model()
    with torch.no_grad():
        model.table[BOS, 4] = 1.0          # after BOS predict 4
        model.table[4, 5] = 1.0            # after 4 predict 5
        model.table[5, EOS] = 1.0          # after 5 predict EOS
    # client 0: "4 5": targets 4 (ok) 5 (ok) EOS (ignored) -> 2 / 2
    # client 1: "4 6 6" and "7": targets 4 ok, 6 wrong, 6 wrong, EOS ign.; 7 wrong, EOS ign.
    x0 = torch.tensor([[BOS, 4, 5, PAD]])
    y0 = torch.tensor([[4, 5, EOS, PAD]])
    x1 = torch.tensor([[BOS, 4, 6, 6], [BOS, 7, PAD, PAD]])
    y1 = torch.tensor([[4, 6, 6, EOS], [7, EOS, PAD, PAD]])
    data = FederatedDataset([x0, x1], [y0, y1], [x0, x1], [y0, y1], ["a", "b"], V)
    pb = ModelProblem(make_split(model, "none"), data, loss_fn=token_cross_entropy,
                      metric=NextWordAccuracy(), vectorize=False)
    counts = pb.metric_counts(np.arange(2), pb.init_theta(), {}, "test")
    np.testing.assert_array_equal(counts["correct"], [2, 1])
    np.testing.assert_array_equal(counts["total"], [2, 4])
    ev = summarize_counts(counts)
    assert ev.accuracy == pytest.approx(3 / 6)                  # pooled, not (1 + 1/4) / 2
    assert ev.mean_client == pytest.approx((1.0 + 0.25) / 2)
    np.testing.assert_allclose(ev.per_client, [1.0, 0.25])
    np.testing.assert_allclose([ev.p10, ev.p50, ev.p90],
                               np.percentile([1.0, 0.25], [10, 50, 90]))
    # the loss is the mean over non-pad target tokens of each client, pooled
    assert ev.loss == pytest.approx(float(np.sum(counts["loss_sum"]) / 9))


def test_lm_loss_ignores_pad_positions_only():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, V, generator=g)
    targets = torch.tensor([[4, EOS, PAD, PAD], [OOV, 5, 6, EOS]])
    keep = targets != PAD
    ref = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    assert torch.allclose(lm_loss(logits, targets), ref)
    # changing the logits at pad positions does not change the loss
    logits2 = logits.clone()
    logits2[0, 2:] += 100 * torch.randn(2, V, generator=g)
    assert torch.allclose(lm_loss(logits2, targets), ref)


def test_token_cross_entropy_per_sequence_sums_match_mean_loss():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, V, generator=g)
    targets = torch.tensor([[4, 5, EOS, PAD, PAD], [OOV, 6, 7, 4, EOS], [5, EOS, PAD, PAD, PAD]])
    s, d = token_cross_entropy(logits, targets)
    assert d.tolist() == [3, 5, 2]
    assert torch.allclose(s.sum() / d.sum(), lm_loss(logits, targets))
    ref0 = sum(torch.nn.functional.cross_entropy(logits[0, t], targets[0, t]) for t in range(3))
    assert torch.allclose(s[0], ref0)
    # works under vmap (clients batched by ModelProblem)
    sv, dv = torch.func.vmap(token_cross_entropy)(logits[None].expand(2, -1, -1, -1),
                                                  targets[None].expand(2, -1, -1))
    assert torch.allclose(sv[1], s) and torch.equal(dv[0], d)
    cv, tv = torch.func.vmap(NextWordAccuracy())(logits[None], targets[None])
    c, t = NextWordAccuracy()(logits, targets)
    assert torch.equal(cv[0], c) and torch.equal(tv[0], t)
