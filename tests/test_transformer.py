"""The causal transformer LM: shapes, causality, splits, functional evaluation."""

from __future__ import annotations

import pytest
import torch

from partialfl.lm import lm_loss
from partialfl.models.transformer import (
    PAPER_CONFIG,
    TransformerConfig,
    TransformerLM,
    count_parameters,
    make_transformer_split,
    model_for_split,
    personal_patterns,
    split_names,
)

SMALL = TransformerConfig(vocab_size=30, seq_len=12, num_layers=3, num_heads=2, d_model=16,
                          d_ff=32)


def _model(norm_first=True, adapter_dim=0, seed=0):
    torch.manual_seed(seed)
    cfg = TransformerConfig(**{**SMALL.to_dict(), "norm_first": norm_first,
                               "adapter_dim": adapter_dim})
    return TransformerLM(cfg)


@pytest.mark.parametrize("norm_first", [True, False])
def test_shapes_and_shorter_sequences(norm_first):
    m = _model(norm_first)
    x = torch.randint(0, 30, (5, 12))
    assert m(x).shape == (5, 12, 30)
    assert m(x[:, :7]).shape == (5, 7, 30)
    with pytest.raises(ValueError, match="seq_len"):
        m(torch.randint(0, 30, (2, 13)))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        m(torch.randint(0, 30, (12,)))


@pytest.mark.parametrize("norm_first,adapter_dim", [(True, 0), (False, 0), (True, 4)])
def test_causality_output_at_t_ignores_later_tokens(norm_first, adapter_dim):
    m = _model(norm_first, adapter_dim)
    if adapter_dim:      # make the adapters matter
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "adapter" in n:
                    p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 30, (4, 12), generator=g)
    out = m(x)
    for t in range(11):
        x2 = x.clone()
        x2[:, t + 1:] = torch.randint(0, 30, (4, 11 - t), generator=g)
        out2 = m(x2)
        torch.testing.assert_close(out2[:, : t + 1], out[:, : t + 1], rtol=1e-5, atol=1e-5)
        # and the later positions do change (the check is not vacuous)
        assert (out2[:, t + 1:] - out[:, t + 1:]).abs().max() > 1e-4
    # gradient form of the same statement: d out[:, t] / d emb(x[:, s]) = 0 for s > t
    emb = m.tok_emb(x).detach().requires_grad_(True)
    h = emb + m.pos_emb.weight[:12]
    for b in m.blocks:
        h = b(h)
    logits = m.head(m.ln_f(h))
    (gr,) = torch.autograd.grad(logits[:, 5].sum(), emb)
    assert gr[:, 6:].abs().max() == 0 and gr[:, :6].abs().max() > 0


def test_paper_config_sizes():
    assert (PAPER_CONFIG.num_layers, PAPER_CONFIG.num_heads, PAPER_CONFIG.d_model,
            PAPER_CONFIG.d_ff, PAPER_CONFIG.seq_len, PAPER_CONFIG.vocab_size) == (
        4, 4, 256, 1024, 20, 10_004)
    m = TransformerLM(PAPER_CONFIG)
    d, f, V, T = 256, 1024, 10_004, 20
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    assert count_parameters(m) == V * d + T * d + 4 * block + 2 * d + (d * V + V)
    _, personal = split_names(m, "output")
    assert count_parameters(m, personal) == block


def test_split_parameter_assignment_each_split():
    for split in ("none", "input", "output", "adapter"):
        m = model_for_split(SMALL, split, adapter_dim=4)
        names = [n for n, _ in m.named_parameters()]
        gl, pe = split_names(m, split)
        assert sorted(gl + pe) == sorted(names) and not set(gl) & set(pe)  # a partition
        # embeddings, final norm and head are always global
        assert {"tok_emb.weight", "pos_emb.weight", "head.weight", "head.bias"} <= set(gl)
        if split == "none":
            assert pe == [] and not any("adapter" in n for n in names)
        elif split == "input":
            assert pe and all(n.startswith("blocks.0.") for n in pe)
            assert pe == [n for n in names if n.startswith("blocks.0.")]
            assert pe == m.input_layer_names()
        elif split == "output":
            assert pe == [n for n in names if n.startswith("blocks.2.")]
            assert pe == m.output_layer_names()
        else:  # adapter: two adapters (down, up: weight, bias) in each of the 3 blocks
            assert len(pe) == 3 * 2 * 4 and all(".adapter" in n for n in pe)
            assert pe == m.adapter_names()
            assert count_parameters(m, pe) == 3 * 2 * (16 * 4 + 4 + 4 * 16 + 16)
            assert not any("adapter" in n for n in gl)
        # the core Split object agrees and validates the partition
        sp = make_transformer_split(m, split)
        assert (list(sp.global_names), list(sp.personal_names)) == (gl, pe)
        assert sp.kind == split and sp.counts()["personal_params"] == count_parameters(m, pe)


def test_split_errors():
    with pytest.raises(ValueError, match="unknown transformer split"):
        personal_patterns("middle", 4)
    with pytest.raises(ValueError, match="adapter_dim > 0"):
        split_names(_model(), "adapter")
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(vocab_size=10, d_model=10, num_heads=3)
    with pytest.raises(ValueError, match="positive integer"):
        TransformerConfig(vocab_size=0)
    # the block index of the output split follows num_layers
    assert personal_patterns("output", 6) == [r"^blocks\.5\."]


def test_fresh_adapters_are_nearly_identity_and_load_pretrained_weights():
    base = _model(adapter_dim=0, seed=3)
    ad = TransformerLM(base.cfg.with_adapters(4))
    missing, unexpected = ad.load_state_dict(base.state_dict(), strict=False)
    assert unexpected == [] and set(missing) == set(ad.adapter_names())
    x = torch.randint(0, 30, (3, 12))
    diff = (ad(x) - base(x)).abs().max()
    assert 0 < diff < 1e-2
    # with zero up-projections the adapters are exactly the identity
    with torch.no_grad():
        for n, p in ad.named_parameters():
            if ".up." in n:
                p.zero_()
    torch.testing.assert_close(ad(x), base(x))


def test_functional_call_and_vmap_over_clients():
    """One module serves several clients' (θ, w): vmap over stacked personal parameters."""
    m = model_for_split(SMALL, "output")
    gl, pe = split_names(m, "output")
    params = dict(m.named_parameters())
    theta = {n: params[n].detach() for n in gl}
    k = 3
    g = torch.Generator().manual_seed(0)
    w = {n: params[n].detach() + 0.1 * torch.randn(k, *params[n].shape, generator=g)
         for n in pe}
    x = torch.randint(0, 30, (k, 4, 12), generator=g)

    def loss(wc, xc):
        out = torch.func.functional_call(m, {**theta, **wc}, (xc,))
        return lm_loss(out, xc)

    batched = torch.func.vmap(loss)(w, x)
    for i in range(k):
        torch.testing.assert_close(batched[i], loss({n: v[i] for n, v in w.items()}, x[i]),
                                   rtol=1e-5, atol=1e-6)


def test_model_learns_a_deterministic_sequence():
    """A few Adam steps fit a fixed next-token rule (sanity check that gradients flow)."""
    torch.manual_seed(0)
    m = TransformerLM(SMALL)
    x = (torch.arange(12).repeat(8, 1) + torch.arange(8)[:, None]) % 26 + 4
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.Adam(m.parameters(), lr=3e-2)
    with torch.no_grad():
        first = float(lm_loss(m(x), y))
    for _ in range(30):
        opt.zero_grad()
        loss = lm_loss(m(x), y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first


def _tiny_text_data(num_clients=3, seed=0):
    from partialfl.data.federated import FederatedDataset

    g = torch.Generator().manual_seed(seed)
    xs, ys, txs, tys = [], [], [], []
    for m in range(num_clients):
        for lst_x, lst_y, n in ((xs, ys, 5 + m), (txs, tys, 3)):
            s = torch.randint(4, 30, (n, 13), generator=g)
            s[:, 0] = 2                                   # BOS
            s[0, 6:] = 0                                  # one padded sequence
            lst_x.append(s[:, :-1].clone())
            lst_y.append(s[:, 1:].clone())
    return FederatedDataset(xs, ys, txs, tys, [f"c{m}" for m in range(num_clients)], 30)


@pytest.mark.parametrize("split", ["input", "output", "adapter"])
def test_model_problem_on_transformer_matches_autograd(split):
    """ModelProblem (the NN core) with the token loss: f_m and ∇_θ f_m equal plain autograd
    on the client's data, vectorised and sequential alike."""
    from partialfl.lm import NextWordAccuracy, lm_loss, token_cross_entropy
    from partialfl.problems.model import ModelProblem

    torch.manual_seed(0)
    m = model_for_split(SMALL, split, adapter_dim=4)
    data = _tiny_text_data()
    cohort = torch.arange(3).numpy()
    outs = []
    for vec in (True, False):
        sp = make_transformer_split(m, split)
        pb = ModelProblem(sp, data, loss_fn=token_cross_entropy, metric=NextWordAccuracy(),
                          vectorize=vec)
        theta = pb.init_theta()
        w = pb.init_w(cohort, "random", seed=1, round_=0)
        outs.append((pb.loss(cohort, theta, w), pb.grad_theta(cohort, theta, w)))
    for i in range(3):
        params = {**{n: v.clone().requires_grad_(True) for n, v in theta.items()},
                  **{n: v[i] for n, v in w.items()}}
        out = torch.func.functional_call(m, params, (data.train_x[i],))
        ref = lm_loss(out, data.train_y[i])
        gref = torch.autograd.grad(ref, [params[n] for n in theta])
        for loss, grads in outs:
            assert loss[i] == pytest.approx(ref.item(), rel=1e-5)
            for n, gr in zip(theta, gref):
                torch.testing.assert_close(grads[n][i], gr, rtol=1e-4, atol=1e-6)
    if split == "adapter":   # "random" personal init = the adapters' own N(0, 0.01²) init
        ups = torch.cat([v.reshape(3, -1) for n, v in w.items() if n.endswith("up.weight")], 1)
        assert 0.005 < ups.std().item() < 0.02
        assert all(v.abs().max() == 0 for n, v in w.items() if n.endswith("bias"))


def test_transformer_split_builds_adapted_copy_from_pretrained():
    from partialfl.models.transformer import transformer_split

    base = _model(seed=5)
    torch.manual_seed(9)
    sp = transformer_split(base, "adapter", {"adapter_dim": 3})
    assert sp.model is not base and sp.model.cfg.adapter_dim == 3
    assert list(sp.personal_names) == sp.model.adapter_names()
    own = dict(sp.model.named_parameters())
    for n, p in base.named_parameters():          # every base parameter carried over
        assert torch.equal(own[n], p)
    for kind in ("none", "input", "output"):
        assert transformer_split(base, kind).model is base
    with pytest.raises(ValueError, match="unknown transformer split options"):
        transformer_split(base, "adapter", {"rank": 3})


def test_table_split_fn_gives_the_sizes_bottleneck_to_every_run_spec():
    """The Shakespeare table's split_fn: a run spec's adapter split leaves ``adapter_dim`` at
    None, and the size's bottleneck must then be the one trained (a None in the spec once
    overrode it, and the table trained the split's default, d_model/16)."""
    from partialfl.build.task import split_of
    from partialfl.reproductions.matched import with_matched
    from partialfl.reproductions.shakespeare import METHODS, size_split_fn

    split_fn = size_split_fn(7)
    model = _model()
    seen = 0
    for label, method in with_matched(METHODS):
        for finetune in (False, True):
            if finetune and method.finetune_split is None:
                continue
            kind, options = split_of(method, finetune=finetune)
            if kind != "adapter":
                continue
            split = split_fn(model, kind, options)
            down = [p for n, p in split.model.named_parameters() if n.endswith("down.weight")]
            assert down and all(p.shape[0] == 7 for p in down), label
            seen += 1
    assert seen >= 2  # FFGG (adapter) and FedAvg + FT (adapter)
    # an explicit bottleneck in the spec still wins
    adapted = split_fn(model, "adapter", {"adapter_dim": 5}).model
    assert {p.shape[0] for n, p in adapted.named_parameters() if n.endswith("down.weight")} == {5}
