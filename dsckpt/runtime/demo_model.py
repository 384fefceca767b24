"""The built-in model: a small causal LM on synthetic, learnable token sequences.

It has every feature a checkpoint tool must handle: an embedding tied to the output head, an
optional frozen block, a persistent float buffer, a persistent int buffer and a non-persistent one.

Model contract for ``--model package.module:factory``: ``factory(**kwargs)`` returns an
``nn.Module`` whose ``forward(tokens)`` takes a LongTensor ``[batch, seq]`` and returns a scalar
loss; an optional ``vocab_size`` / ``seq_len`` attribute sizes the synthetic data.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp_in = nn.Linear(dim, 4 * dim)
        self.mlp_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))


class TinyCausalLM(nn.Module):
    def __init__(self, vocab_size: int = 64, dim: int = 64, n_layers: int = 2, n_heads: int = 4,
                 seq_len: int = 32, freeze_first_block: bool = False, tie_embeddings: bool = True):
        super().__init__()
        self.vocab_size, self.seq_len, self.dim = vocab_size, seq_len, dim
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight  # tied: one tensor, two names
        self.register_buffer("logit_scale", torch.ones(vocab_size))  # persistent float buffer
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))  # persistent int buffer
        self.positions: torch.Tensor
        self.logit_scale: torch.Tensor
        self.tokens_seen: torch.Tensor
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)  # not saved
        if freeze_first_block:
            self.blocks[0].requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.embed(inputs) + self.pos_embed[self.positions[: inputs.shape[1]]].to(self.embed.weight.dtype)
        for block in self.blocks:
            x = block(x)
        # 1/sqrt(dim): the head shares the N(0, 1) embedding, whose raw logits would start the loss near 60
        logits = self.head(self.norm(x)) * (self.logit_scale.to(x.dtype) * self.dim ** -0.5)
        if self.training:
            self.tokens_seen += inputs.numel()
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_demo_model(**kwargs) -> TinyCausalLM:
    return TinyCausalLM(**kwargs)


def synthetic_batch(index: int, *, seed: int, batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Batch ``index`` of an endless, deterministic stream: arithmetic sequences modulo the vocab.

    Each batch depends only on ``(seed, index)``, so the data position is one integer and a resumed
    run sees exactly the batches an uninterrupted run would.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    return (start + stride * torch.arange(seq_len + 1)) % vocab_size


def build_small_model(**kwargs) -> TinyCausalLM:
    """The fixtures' model: the demo model at its smallest, with a frozen first block."""
    kwargs.setdefault("freeze_first_block", True)
    return TinyCausalLM(vocab_size=32, dim=16, n_layers=2, n_heads=2, seq_len=16, **kwargs)
