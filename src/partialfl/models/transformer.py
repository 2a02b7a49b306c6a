r"""A causal transformer language model with the paper's personalization splits.

The paper's StackOverflow model (Mishchenko et al. 2023, following Pillutla et al. 2022,
``pfl/models/wordlm_transformer.py``): 4 transformer blocks, 4 attention heads, hidden size 256,
feed-forward size 1024, learned positional embeddings, sequences of length 20 and a vocabulary
of 10,000 words + 4 special tokens. Input ``x [B, T]`` (token ids) → logits ``[B, T, V]``::

    h_0 = E[x] + P[0..T-1]                            (word and learned positional embeddings)
    pre-LN block (default):   a = h + A1(Attn(LN1(h)));   h' = a + A2(FF(LN2(a)))
    post-LN block:            a = LN1(h + A1(Attn(h)));   h' = LN2(a + A2(FF(a)))
    logits = W_head · LN_f(h_L) + b                   (LN_f only in the pre-LN variant)

``Attn`` is multi-head causal self-attention (position t attends to positions ≤ t only), ``FF``
is Linear(d, d_ff) → ReLU → Linear(d_ff, d), and ``A1``, ``A2`` are the residual bottleneck
adapters A(u) = u + W_up ReLU(W_down u + b_down) + b_up (Houlsby et al. 2019, as in Pillutla
et al.; identity when the model is built without adapters, ``adapter_dim=0``).

Pre- vs post-LN: Pillutla et al.'s block is post-LN. The default here is **pre-LN**
(``norm_first=True``), which trains stably with plain client SGD at the larger learning
rates a short CPU run needs; ``norm_first=False`` gives the post-LN block. Other small
differences from Pillutla et al.: their Q/K/V/output projections have no bias, they scale the
word embedding by √d and apply a ReLU to the summed embeddings; here the embeddings are simply
summed (GPT-style). No dropout (their federated runs use none).

Splits (parameter names as in ``model.named_parameters()``; the embeddings ``tok_emb``,
``pos_emb``, the final norm ``ln_f`` and the output head ``head`` are always global):

* ``input``: the first transformer block ``blocks.0.*`` personal;
* ``output``: the last transformer block ``blocks.{L-1}.*`` personal;
* ``adapter``: the adapters ``blocks.*.adapter{1,2}.*`` of every block personal (the model must
  be built with ``adapter_dim > 0``), everything else global;
* ``none``: everything global (FedAvg).

:func:`personal_patterns` gives the regular expressions of each split, :func:`split_names`
the resulting (global, personal) name lists and :func:`make_transformer_split` the validated
:class:`partialfl.split.Split` (built with ``partialfl.split.make_split``: ``input`` /
``output`` with ``modules=[r"blocks\.0"]`` / ``[r"blocks\.{L-1}"]``; the adapters are this
model's own bottleneck adapters, not ``split.insert_adapters``' low-rank linear ones, to match
the paper's architecture).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partialfl.models.base import ModelContext, NamedLayersMixin
from partialfl.registry import option, register
from partialfl.split import Split, make_split


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of :class:`TransformerLM`. ``vocab_size`` counts the special tokens too."""

    vocab_size: int
    seq_len: int = 20
    num_layers: int = 4
    num_heads: int = 4
    d_model: int = 256
    d_ff: int = 1024
    adapter_dim: int = 0
    norm_first: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model", "d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {v!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by "
                             f"num_heads={self.num_heads}")
        if not isinstance(self.adapter_dim, int) or self.adapter_dim < 0:
            raise ValueError(f"adapter_dim must be a non-negative integer, got "
                             f"{self.adapter_dim!r}")

    def with_adapters(self, adapter_dim: int) -> TransformerConfig:
        """The same sizes with residual adapters of bottleneck ``adapter_dim``."""
        return replace(self, adapter_dim=adapter_dim)

    def to_dict(self) -> dict:
        """The configuration as a plain dict."""
        return asdict(self)


#: the paper's StackOverflow model (vocabulary 10,000 words + pad, OOV, BOS, EOS)
PAPER_CONFIG = TransformerConfig(vocab_size=10_004, seq_len=20, num_layers=4, num_heads=4,
                                 d_model=256, d_ff=1024)
#: adapter bottleneck for the paper-size model (Pillutla et al.'s StackOverflow runs use 16 and 64)
PAPER_ADAPTER_DIM = 16


class Adapter(nn.Module):
    """Residual bottleneck adapter u ↦ u + W_up ReLU(W_down u + b_down) + b_up.

    Initialised like Pillutla et al.: weights N(0, 0.01²), biases 0, so a fresh adapter is
    close to the identity and adding adapters to a trained model barely changes it.
    """

    def __init__(self, d_model: int, bottleneck: int) -> None:
        super().__init__()
        self.down = nn.Linear(d_model, bottleneck)
        self.up = nn.Linear(bottleneck, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weights N(0, 0.01²), biases 0 (also what ``init_w("random")`` draws)."""
        for lin in (self.down, self.up):
            nn.init.normal_(lin.weight, 0.0, 0.01)
            nn.init.zeros_(lin.bias)

    def forward(self, u: Tensor) -> Tensor:
        """u + up(relu(down(u))) (small initial weights: close to the identity at start)."""
        return u + self.up(F.relu(self.down(u)))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions ≤ t.

    Written with plain tensor ops (no fused kernels) so that it runs under
    ``torch.func.functional_call`` and ``torch.func.vmap``.
    """

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """Multi-head self-attention of ``x [B, T, d]`` where position t sees positions ≤ t."""
        B, T, D = x.shape
        H = self.num_heads
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.reshape(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))  # [B,H,T,d]
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // H)                       # [B,H,T,T]
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        out = scores.softmax(dim=-1) @ v                                             # [B,H,T,d]
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    """The block's position-wise MLP d → d_ff → d with ReLU."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """The MLP applied to every position."""
        return self.fc2(F.relu(self.fc1(x)))


class Block(nn.Module):
    """One transformer block (pre- or post-LN), with optional residual adapters."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.norm_first = cfg.norm_first
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.num_heads)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff)
        if cfg.adapter_dim:
            self.adapter1: nn.Module = Adapter(cfg.d_model, cfg.adapter_dim)
            self.adapter2: nn.Module = Adapter(cfg.d_model, cfg.adapter_dim)
        else:
            self.adapter1 = self.adapter2 = nn.Identity()

    def forward(self, h: Tensor) -> Tensor:
        """Pre-LN: h + adapter(attn(LN(h))), then the same with the feed-forward; post-LN: LN(h +
        adapter(attn(h))), then the same with the feed-forward (adapters: identity when absent)."""
        if self.norm_first:
            h = h + self.adapter1(self.attn(self.ln1(h)))
            return h + self.adapter2(self.ff(self.ln2(h)))
        h = self.ln1(h + self.adapter1(self.attn(h)))
        return self.ln2(h + self.adapter2(self.ff(h)))


class TransformerLM(NamedLayersMixin, nn.Module):
    """Causal transformer LM: ``x [B, T]`` int64 → logits ``[B, T, vocab_size]``.

    Build with a :class:`TransformerConfig` or keyword sizes:
    ``TransformerLM(TransformerConfig(vocab_size=4914, d_model=64))``.
    ``input_layer_names()`` / ``output_layer_names()`` are the parameters of the first / last
    transformer block (the paper's input / output splits for this model).
    """

    def partialfl_split(self, kind: str, options) -> Split:
        """This model's own splits (the registry's split entries ask it first):
        :func:`transformer_split` (``options``: the split's registry options)."""
        opts = {} if options is None else {k: getattr(options, k)
                                           for k in options.__dataclass_fields__}
        if opts.get("adapter_dim") is None:
            opts.pop("adapter_dim", None)
        return transformer_split(self, kind, opts)

    def __init__(self, cfg: TransformerConfig | None = None, **sizes) -> None:
        super().__init__()
        if cfg is None:
            cfg = TransformerConfig(**sizes)
        elif sizes:
            cfg = replace(cfg, **sizes)
        self.cfg = cfg
        self.num_classes = cfg.vocab_size
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        # GPT-style initialisation (Pillutla et al. use N(0, 0.02²) for all weight matrices)
        for name, p in self.named_parameters():
            if "adapter" in name:
                continue
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        self.INPUT_LAYERS = ("blocks.0",)
        self.OUTPUT_LAYERS = (f"blocks.{cfg.num_layers - 1}",)

    def forward(self, x: Tensor) -> Tensor:
        """Next-token logits ``[B, T, vocab]`` of token ids ``[B, T]``."""
        if x.dim() != 2:
            raise ValueError(f"TransformerLM expects token ids [B, T], got shape {tuple(x.shape)}")
        T = x.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len={self.cfg.seq_len}")
        h = self.tok_emb(x) + self.pos_emb.weight[:T]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))

    def adapter_names(self) -> list[str]:
        """Parameter names of all adapters (empty without adapters)."""
        return [n for n, _ in self.named_parameters() if _ADAPTER_RE.match(n)]


_ADAPTER_RE = re.compile(r"^blocks\.\d+\.adapter[12]\.")


def personal_patterns(split: str, num_layers: int) -> list[str]:
    """Regular expressions (``re.match`` on parameter names) of the personal parameters."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if split == "none":
        return []
    if split == "input":
        return [r"^blocks\.0\."]
    if split == "output":
        return [rf"^blocks\.{num_layers - 1}\."]
    if split == "adapter":
        return [_ADAPTER_RE.pattern]
    raise ValueError(f"unknown transformer split {split!r}; allowed: none, input, output, "
                     "adapter")


def split_names(model: TransformerLM, split: str) -> tuple[list[str], list[str]]:
    """``(global_names, personal_names)`` of ``model`` for ``split`` (every parameter on
    exactly one side, in ``named_parameters`` order)."""
    pats = [re.compile(p) for p in personal_patterns(split, model.cfg.num_layers)]
    names = [n for n, _ in model.named_parameters()]
    personal = [n for n in names if any(p.match(n) for p in pats)]
    if split == "adapter" and not personal:
        raise ValueError("the adapter split needs a model built with adapter_dim > 0 "
                         "(TransformerConfig.with_adapters)")
    gl = [n for n in names if n not in set(personal)]
    return gl, personal


def make_transformer_split(model: TransformerLM, split: str) -> Split:
    """The validated :class:`partialfl.split.Split` of ``model`` for ``split`` (the same
    partition as :func:`split_names`)."""
    personal_patterns(split, model.cfg.num_layers)  # validates the name
    if split == "none":
        return make_split(model, "none")
    if split in ("input", "output"):
        block = 0 if split == "input" else model.cfg.num_layers - 1
        return make_split(model, split, modules=[rf"blocks\.{block}"])
    gl, pe = split_names(model, "adapter")
    return Split(model, "adapter", tuple(gl), tuple(pe))


def transformer_split(model: TransformerLM, kind: str,
                      options: dict | None = None) -> Split:
    """The pipeline's ``split_fn`` (:class:`partialfl.build.Task`) for this model.

    ``input`` / ``output`` / ``none`` split ``model`` itself. ``adapter`` needs adapters: if
    ``model`` has none, a copy with adapters of bottleneck ``options["adapter_dim"]`` (default
    ``max(4, d_model // 16)``) is built (fresh adapters drawn from the global torch RNG, which the
    pipeline seeds) and ``model``'s parameters are copied into it, so the adapted model starts
    as the pre-trained one plus near-identity adapters."""
    options = dict(options or {})
    # the generic split options at their defaults mean nothing here (whole blocks, own adapters)
    for key, default in (("layers", 1), ("modules", None), ("rank", 8)):
        if options.get(key, default) == default:
            options.pop(key, None)
    unknown = sorted(set(options) - {"adapter_dim"})
    if unknown:
        raise ValueError(f"unknown transformer split options {unknown}; allowed: adapter_dim")
    if kind == "adapter" and not model.cfg.adapter_dim:
        dim = options.get("adapter_dim") or max(4, model.cfg.d_model // 16)
        adapted = TransformerLM(model.cfg.with_adapters(int(dim)))
        missing, unexpected = adapted.load_state_dict(model.state_dict(), strict=False)
        assert not unexpected and set(missing) == set(adapted.adapter_names())
        model = adapted
    return make_transformer_split(model, kind)


def model_for_split(cfg: TransformerConfig, split: str,
                    adapter_dim: int | None = None) -> TransformerLM:
    """A fresh model for ``split``: with adapters (``adapter_dim``, default
    ``max(4, d_model // 16)``) for the adapter split, without for the others."""
    personal_patterns(split, cfg.num_layers)  # validates the name
    if split == "adapter":
        dim = adapter_dim if adapter_dim is not None else max(4, cfg.d_model // 16)
        return TransformerLM(cfg.with_adapters(dim))
    return TransformerLM(replace(cfg, adapter_dim=0))


def count_parameters(model: nn.Module, names: list[str] | None = None) -> int:
    """Number of scalar parameters (of ``names`` only, if given)."""
    params = dict(model.named_parameters())
    keys = names if names is not None else list(params)
    return int(sum(params[n].numel() for n in keys))


@dataclass(frozen=True)
class TransformerOptions:
    """Sizes of the causal transformer (the vocabulary is the data's)."""

    seq_len: int | None = option(None, "sequence length (None: the data's, else 20)")
    num_layers: int = option(4, "transformer blocks")
    num_heads: int = option(4, "attention heads")
    d_model: int = option(256, "model width")
    d_ff: int = option(1024, "feed-forward width")
    adapter_dim: int = option(0, "residual adapters' bottleneck (0: none)")
    norm_first: bool = option(True, "pre-LayerNorm blocks")


@register("model", "transformer", options=TransformerOptions)
def _transformer(opts: TransformerOptions, ctx: ModelContext) -> TransformerLM:
    """A causal transformer language model over the data's vocabulary (next-token
    prediction)."""
    from partialfl.rng import torch_seed

    data = ctx.data
    seq = opts.seq_len or (int(data.train_x[0].shape[1]) if data is not None
                           and data.train_x[0].dim() == 2 else 20)
    kw = {k: v for k, v in asdict(opts).items() if k != "seq_len"}
    cfg = TransformerConfig(vocab_size=int(ctx.num_classes), seq_len=seq, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(ctx.seed or 0, "model"))  # as the Shakespeare table
        return TransformerLM(cfg)
