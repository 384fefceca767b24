"""Benchmark models: the demo transformer sized by BENCH_DIM / BENCH_LAYERS.

Untied, because DeepSpeed's zero_to_fp32 --safe_serialization fails on tied weights and the
benchmark needs it to finish.
"""
import os

from dsckpt.runtime.demo_model import TinyCausalLM


def transformer():
    dim, layers = int(os.environ.get("BENCH_DIM", "1024")), int(os.environ.get("BENCH_LAYERS", "8"))
    vocab = int(os.environ.get("BENCH_VOCAB", "256"))  # 50257: an embedding no world size divides
    return TinyCausalLM(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=8, seq_len=16, tie_embeddings=False)
