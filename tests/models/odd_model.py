"""A model whose every parameter size is odd or prime, for world sizes that divide nothing.

Embedding(101, 37) tied to the output head (3737 elements: 2 and 3 do not divide it), a frozen
layer, LayerNorm(37), a 9-element gate, a float and an int persistent buffer and a non-persistent one.
"""
import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, HIDDEN = 101, 37, 53


class OddLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.vocab_size, self.seq_len = VOCAB, 9
        self.embed = nn.Embedding(VOCAB, DIM)  # 3737
        self.up = nn.Linear(DIM, HIDDEN)  # 1961 + 53
        self.frozen = nn.Linear(HIDDEN, DIM)  # 1961 + 37, not trained
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(DIM)  # 37 + 37
        # 9: the trainable total (5834) is then no multiple of 2 x world size at 2 or 3 ranks, so ZeRO-1/2
        # groups end in real padding (DeepSpeed trims it from the last rank's saved fp32 partition)
        self.gate = nn.Parameter(torch.full((9,), 0.5))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 11))  # persistent float buffer
        self.register_buffer("seen", torch.zeros(3, dtype=torch.long))  # persistent int buffer
        self.register_buffer("scratch", torch.zeros(5), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.embed(inputs)
        x = x + self.frozen(F.gelu(self.up(x))) * self.gate.mean() * self.scale.mean().to(x.dtype)
        logits = self.head(self.norm(x)) * DIM ** -0.5
        if self.training:
            self.seen += 1
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def build() -> OddLM:
    return OddLM()


def build_with_lazy_import() -> OddLM:
    """A factory that imports a heavy library inside itself, as transformers users do."""
    import torch._dynamo  # noqa: F401  (the import that failed under zero.Init's patched Tensor.__new__)

    return OddLM()


class _CausalLMLoss(nn.Module):
    """forward(tokens) -> loss around a Hugging Face causal LM (dsckpt's model contract)."""

    def __init__(self, lm: nn.Module, vocab_size: int, seq_len: int):
        super().__init__()
        self.lm, self.vocab_size, self.seq_len = lm, vocab_size, seq_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, labels=tokens).loss


def build_tiny_gpt2() -> nn.Module:
    """A transformers GPT-2 with odd sizes, imported inside the factory (called under zero.Init)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=38, n_layer=2, n_head=2)
    return _CausalLMLoss(GPT2LMHeadModel(config), VOCAB, 9)


def build_large() -> nn.Module:
    """~21M parameters (an 84 MB fp32 output): large enough for a kill to land mid-write."""
    from dsckpt.runtime.demo_model import TinyCausalLM

    return TinyCausalLM(vocab_size=8192, dim=512, n_layers=4, n_heads=8, seq_len=16, tie_embeddings=False)


def build_deep() -> nn.Module:
    """100 blocks of a small model: for plots that must stay readable at 100 layers."""
    from dsckpt.runtime.demo_model import TinyCausalLM

    return TinyCausalLM(vocab_size=64, dim=16, n_layers=100, n_heads=2, seq_len=8)
