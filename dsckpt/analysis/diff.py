"""``dsckpt diff``: two checkpoints (or tags, or a checkpoint and a consolidated file), tensor by tensor.

Both sides are ``Source`` lists (``analysis.sources``); common tensors are streamed in lockstep, one
chunk of each at a time, so memory stays two chunks whatever the sizes.  Per tensor: bitwise equal,
max |a - b|, relative L2 change ||a - b|| / ||a||, and whether it is within ``atol + rtol * |b|``
(torch.allclose's rule; NaN equals nothing, except bitwise).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ..dtypes import ITEMSIZE
from ..formats.storage import LocalStorage, Storage
from .stats import CHUNK_BYTES, Source, decode


@dataclass(frozen=True)
class TensorDiff:
    name: str
    equal: bool  # every value identical (bitwise for one dtype; exactly, as numbers, across dtypes)
    within: bool  # |a - b| <= atol + rtol * |b| everywhere
    max_abs_diff: float
    rel_l2: float  # ||a - b|| / ||a|| (inf when a is all zeros and b is not)


@dataclass
class DiffReport:
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "name: shape a vs b" (not compared)
    dtype_changed: list[str] = field(default_factory=list)  # "name: F32 vs BF16" (compared as numbers)
    tensors: list[TensorDiff] = field(default_factory=list)
    tolerances: tuple[float, float] = (0.0, 0.0)

    @property
    def identical(self) -> bool:
        """No missing or mis-shaped tensor, and every tensor equal (bitwise, or within the tolerances given)."""
        exact = self.tolerances == (0.0, 0.0)
        return not (self.only_a or self.only_b or self.mismatched) and all(
            t.equal if exact else t.within for t in self.tensors)

    def record(self) -> dict:
        return {"identical": self.identical, "atol": self.tolerances[0], "rtol": self.tolerances[1],
                "only_a": self.only_a, "only_b": self.only_b, "mismatched": self.mismatched,
                "dtype_changed": self.dtype_changed, "tensors": len(self.tensors),
                "tensor_list": [asdict(t) for t in self.tensors]}


def read_elements(src: Source, start: int, count: int, files: Storage) -> bytes:
    """Elements ``[start, start + count)`` of a source, as raw bytes, across its pieces."""
    size, out, pos = ITEMSIZE[src.dtype], [], 0
    lo, hi = start * size, (start + count) * size
    for path, offset, nbytes in src.pieces:
        a, b = max(lo, pos), min(hi, pos + nbytes)
        if a < b:
            out.append(files.pread(path, b - a, offset + a - pos))
        pos += nbytes
    return b"".join(out)


def compare(a: Source, b: Source, files: Storage, atol: float, rtol: float) -> TensorDiff:
    step = CHUNK_BYTES // max(ITEMSIZE[a.dtype], ITEMSIZE[b.dtype])
    equal = within = True
    max_diff = diff_sq = a_sq = 0.0
    for start in range(0, a.numel, step):
        count = min(step, a.numel - start)
        raw_a, raw_b = read_elements(a, start, count, files), read_elements(b, start, count, files)
        x = np.nan_to_num(decode(raw_a, a.dtype).astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        a_sq += float(np.dot(x, x))
        if a.dtype == b.dtype and raw_a == raw_b:
            continue
        y: np.ndarray
        x, y = decode(raw_a, a.dtype).astype(np.float64), decode(raw_b, b.dtype).astype(np.float64)
        if np.array_equal(x, y, equal_nan=True):
            continue  # same numbers in another dtype (an upcast frozen parameter)
        equal = False
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(x - y)
            within = within and bool(np.all(d <= atol + rtol * np.abs(y)))
            finite = np.isfinite(d)
            if not finite.all():
                max_diff = math.inf
            if finite.any():
                max_diff = max(max_diff, float(d[finite].max()))
                diff_sq += float(np.dot(d[finite], d[finite]))
    rel = math.sqrt(diff_sq) / math.sqrt(a_sq) if a_sq else (0.0 if diff_sq == 0 else math.inf)
    return TensorDiff(a.name, equal, within, max_diff, rel)


def diff(a_sources: list[Source], b_sources: list[Source], atol: float = 0.0, rtol: float = 0.0) -> DiffReport:
    a_by, b_by = {s.name: s for s in a_sources}, {s.name: s for s in b_sources}
    report = DiffReport(only_a=[n for n in a_by if n not in b_by], only_b=[n for n in b_by if n not in a_by],
                        tolerances=(atol, rtol))
    common = [n for n in a_by if n in b_by]
    pairs = []
    for name in common:
        a, b = a_by[name], b_by[name]
        if a.shape != b.shape:
            report.mismatched.append(f"{name}: shape {list(a.shape)} vs {list(b.shape)}")
            continue
        if a.dtype != b.dtype:
            report.dtype_changed.append(f"{name}: {a.dtype} vs {b.dtype}")
        pairs.append((a, b))
    with LocalStorage() as files:
        report.tensors = [compare(a, b, files, atol, rtol) for a, b in pairs]
    return report
