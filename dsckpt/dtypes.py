"""Every element type dsckpt handles, in one table, and the names each format spells it by.

The canonical name is safetensors' (``"F32"``): plans, writers and readers pass it around.
The other spellings meet it at the edges: torch storage classes (``FloatStorage``) and dtype
names (``torch.float32`` / ``torch.float``) inside pickles, numpy for casts, user-facing labels
(``fp32`` / ``bf16``), and training precisions as DeepSpeed/Lightning write them (``"32"``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DType:
    name: str  # safetensors name, dsckpt's canonical one
    itemsize: int
    storage: str  # torch storage class in pickles
    torch_names: tuple[str, ...]  # attribute names on the torch module (first: the canonical one)
    numpy: str  # numpy dtype carrying the bytes (bf16 has none: its uint16 bit pattern)
    label: str  # what users type (--dtype, inspect output)
    floating: bool


_TABLE = (
    DType("F64", 8, "DoubleStorage", ("float64", "double"), "float64", "fp64", True),
    DType("F32", 4, "FloatStorage", ("float32", "float"), "float32", "fp32", True),
    DType("F16", 2, "HalfStorage", ("float16", "half"), "float16", "fp16", True),
    DType("BF16", 2, "BFloat16Storage", ("bfloat16",), "uint16", "bf16", True),
    DType("I64", 8, "LongStorage", ("int64", "long"), "int64", "int64", False),
    DType("I32", 4, "IntStorage", ("int32", "int"), "int32", "int32", False),
    DType("I16", 2, "ShortStorage", ("int16", "short"), "int16", "int16", False),
    DType("I8", 1, "CharStorage", ("int8",), "int8", "int8", False),
    DType("U8", 1, "ByteStorage", ("uint8",), "uint8", "uint8", False),
    DType("BOOL", 1, "BoolStorage", ("bool",), "bool", "bool", False),
)
DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
ITEMSIZE: dict[str, int] = {d.name: d.itemsize for d in _TABLE}
FLOATING = frozenset(d.name for d in _TABLE if d.floating)
BY_STORAGE: dict[str, DType] = {d.storage: d for d in _TABLE}
BY_TORCH_NAME: dict[str, str] = {n: d.name for d in _TABLE for n in d.torch_names}
# --dtype and API spellings -> canonical
BY_LABEL: dict[str, str] = {**{d.label: d.name for d in _TABLE}, **BY_TORCH_NAME, **{d.name: d.name for d in _TABLE}}
# training precision (DeepSpeed config / Lightning / dsckpt --precision) <-> parameter dtype
PRECISION_DTYPE = {"32": "F32", "16": "F16", "bf16": "BF16"}
# One vocabulary for --precision and --dtype: every spelling -> the label errors and output use.
PRECISION_WORDS = {"32": "fp32", "fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                   "16": "fp16", "fp16": "fp16", "float16": "fp16"}
TRAINING_PRECISION = {"fp32": "32", "bf16": "bf16", "fp16": "16"}  # label -> DeepSpeed/Lightning's spelling


def canonical(name: str) -> str:
    """``"bf16"``, ``"bfloat16"`` or ``"BF16"`` -> ``"BF16"``; ``KeyError`` for anything else."""
    return BY_LABEL[name]


OUTPUT_DTYPES = ("fp32", "bf16", "fp16")  # what a consolidated output may be cast to


def output_dtype(value: object) -> str | None:
    """The canonical name of a requested output dtype: a word ``--dtype`` takes (``"bf16"``, ``"bfloat16"``,
    ``"32"``...; any case) or a torch dtype (``torch.bfloat16``); None keeps each tensor's own.  Anything else is
    a ``ConfigError`` in Python's words."""
    from .errors import ConfigError

    if value is None:
        return None
    text = str(value).lower()
    word = PRECISION_WORDS.get(text.removeprefix("torch.")) if text.startswith("torch.") or isinstance(value, str) \
        else None
    if word is None:
        raise ConfigError(f"dtype={value!r}: a consolidated output is cast to a floating-point type: one of "
                          f"{', '.join(repr(w) for w in OUTPUT_DTYPES)} (or 'float32', 'bfloat16', 'float16', "
                          "torch.float32, torch.bfloat16, torch.float16); None keeps each tensor's own")
    return BY_LABEL[word]


def label(name: str) -> str:
    """``"BF16"`` -> ``"bf16"`` (what inspect prints and errors say)."""
    return DTYPES[name].label if name in DTYPES else name


def torch_dtype(name: str) -> Any:
    """The torch dtype of a canonical name (imports torch: runtime and API paths only)."""
    import torch

    return getattr(torch, DTYPES[name].torch_names[0])


def numpy_dtype(name: str) -> Any:
    import numpy as np

    return np.dtype(DTYPES[name].numpy)


class Shaped:
    """``numel`` and ``nbytes`` of a tensor described by its ``shape`` and safetensors ``dtype`` name (a base of the
    plans' and writers' tensor records)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]
