"""The TP fixtures' Llama (fixtures/make_tp_fixtures.py) as dsckpt's runtime trains a model: ``forward(ids)`` is the
loss.  A subclass, so its parameter names are Transformers' own and AutoTP splits it as it splits the fixtures."""
import sys
from pathlib import Path

from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))
from make_tp_fixtures import VOCAB, build as build_llama  # noqa: E402


class TinyLlama(LlamaForCausalLM):
    def forward(self, ids, **kwargs):
        if kwargs:  # Transformers' own calls (generation) keep their meaning
            return super().forward(input_ids=ids, **kwargs)
        return super().forward(input_ids=ids, labels=ids).loss


def _build(tied: bool) -> TinyLlama:
    model = TinyLlama(build_llama(tied).config)
    model.vocab_size, model.seq_len = VOCAB, 8
    return model


def build() -> TinyLlama:
    return _build(False)


def build_tied() -> TinyLlama:
    return _build(True)
