"""Numbers inside a checkpoint or a consolidated file, streamed: per-tensor statistics and diffs.

No torch, bounded memory: every tensor is read in ``CHUNK_BYTES`` pieces (positional reads of the
byte ranges the plan or the format registry names), decoded with numpy and folded into running
reductions over cache-sized blocks, so a 1 GB tensor costs one chunk of memory.  Tensors
are spread over a few threads (numpy and pread release the GIL).

Statistics are over the finite values; NaN and ±Inf are counted, never folded into min/max/mean.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np

from ..dtypes import ITEMSIZE, label, numpy_dtype
from ..formats.storage import LocalStorage, Storage
from ..plan.segments import Segment

CHUNK_BYTES = 16 << 20
THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class Source:
    """A tensor to read: its bytes are ``pieces`` (``plan.segments.Segment``s) back to back, in ``dtype``."""

    name: str
    kind: str  # param | frozen | buffer | exp_avg | exp_avg_sq | tensor (a consolidated file's)
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TensorStats:
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    count: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    norm: float
    nan: int
    inf: int
    zeros: int

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0

    def record(self) -> dict:
        return {**asdict(self), "shape": list(self.shape), "dtype": label(self.dtype)}


BLOCK = 1 << 16  # elements reduced at a time: the several passes below then run in the CPU's cache


def chunks(src: Source, files: Storage) -> Iterator[np.ndarray]:
    """The tensor's values (float32, or float64 for F64) in cache-sized blocks, read ~CHUNK_BYTES at a time."""
    size = ITEMSIZE[src.dtype]
    step = max(size, CHUNK_BYTES - CHUNK_BYTES % size)
    for path, offset, nbytes in src.pieces:
        for start in range(0, nbytes, step):
            values = decode(files.pread(path, min(step, nbytes - start), offset + start), src.dtype)
            for i in range(0, values.size, BLOCK):
                yield values[i:i + BLOCK]


def decode(raw: bytes | bytearray, dtype: str) -> np.ndarray:
    values = np.frombuffer(raw, dtype=numpy_dtype(dtype))
    if dtype == "BF16":  # the uint16 bit pattern of a bf16 is the top half of a float32
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values if dtype in ("F32", "F64") else values.astype(np.float32 if dtype in ("F16",) else np.float64)


def tensor_stats(src: Source, files: Storage) -> TensorStats:
    """One tensor's statistics in few passes over cache-resident blocks.

    Sums are taken of ``x - shift`` (``shift``: the tensor's first finite value), so the variance of
    values far from zero (a LayerNorm weight near 1.0 with a tiny spread) keeps its digits; each block's
    sums are float32 BLAS/numpy reductions (relative error ~1e-6), accumulated in float64.
    """
    n = nan = inf = zeros = 0
    s1 = s2 = 0.0  # sums of (x - shift) and (x - shift)**2
    shift = 0.0  # set from the first finite block
    lo, hi = math.inf, -math.inf
    for x in chunks(src, files):
        b_lo, b_hi = x.min(), x.max()  # NaN propagates, so a clean block needs no isfinite pass
        if not (math.isfinite(b_lo) and math.isfinite(b_hi)):
            bad_nan = np.isnan(x)
            nan += int(bad_nan.sum())
            inf += int(np.isinf(x).sum())
            x = x[np.isfinite(x)]
            if not x.size:
                continue
            b_lo, b_hi = x.min(), x.max()
        lo, hi = min(lo, float(b_lo)), max(hi, float(b_hi))
        zeros += x.size - int(np.count_nonzero(x))
        if not n:
            shift = float(x[0])
        y = x - x.dtype.type(shift)
        s1 += float(y.sum(dtype=np.float64)) if x.dtype == np.float64 else float(np.add.reduce(y))
        s2 += float(np.dot(y, y))
        n += x.size
    if not n:
        return TensorStats(src.name, src.kind, src.dtype, src.shape, src.numel, None, None, None, None, 0.0,
                           nan, inf, zeros)
    mean = shift + s1 / n
    var = max(s2 / n - (s1 / n) ** 2, 0.0)
    sumsq = s2 + 2 * shift * s1 + n * shift * shift  # sum of x**2
    return TensorStats(src.name, src.kind, src.dtype, src.shape, src.numel, lo, hi, mean, math.sqrt(var),
                       math.sqrt(max(sumsq, 0.0)), nan, inf, zeros)


def compute_stats(sources: list[Source], threads: int = THREADS) -> list[TensorStats]:
    """Statistics of every source, in the sources' order."""
    with LocalStorage() as files, ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda s: tensor_stats(s, files), sources))
