"""Decode and cast raw tensor bytes with numpy (no torch): exact, round-to-nearest-even for bf16."""
from __future__ import annotations

import numpy as np

from ..dtypes import numpy_dtype  # bf16 travels as its uint16 bit pattern



def to_f32(raw: np.ndarray, src: str) -> np.ndarray:
    if src == "BF16":
        widened: np.ndarray = raw.astype(np.uint32) << 16
        return widened.view(np.float32)
    same: np.ndarray = raw.astype(np.float32, copy=False)
    return same


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """As torch does it: round to nearest even; NaN becomes the canonical quiet NaN 0x7FC0."""
    u: np.ndarray = x.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    out: np.ndarray = np.where(np.isnan(x), np.uint16(0x7FC0), rounded)
    return out


def cast_bytes(data: bytes | bytearray | memoryview, src: str, dst: str) -> bytes | bytearray | memoryview:
    """``data`` (elements of ``src``) as elements of ``dst``."""
    if src == dst:
        return data
    raw = np.frombuffer(data, dtype=numpy_dtype(src))
    if dst == "BF16":
        out = f32_to_bf16(to_f32(raw, src) if src != "F64" else raw.astype(np.float32))
    elif src == "BF16":
        out = to_f32(raw, src).astype(numpy_dtype(dst), copy=False)
    else:
        out = raw.astype(numpy_dtype(dst))
    return out.tobytes()
