"""Stream a plan into a ``torch.save``-compatible zip, without torch and without holding tensors.

The pickle is emitted opcode by opcode (protocol 2, as torch writes it): a dict of
``torch._utils._rebuild_tensor_v2(persistent storage, 0, shape, stride, False, OrderedDict())``
calls, one storage per written tensor; tied aliases reference the same storage, so ``torch.load``
gives them one shared tensor.  Storages go into the zip uncompressed, 64-byte aligned (as torch
writes them, so memory-mapped loading works), streamed chunk by chunk: memory stays O(chunk).
The result loads with torch's weights-only unpickler: it names only allowlisted globals.
"""
from __future__ import annotations

import math
import struct
import zipfile
from pathlib import Path
from typing import Callable

from ..dtypes import DTYPES
from ..plan.consolidate import Plan
from .writer import SourceFiles, iter_tensor_chunks

ARCHIVE = "archive"
ALIGN = 64


class _Pickle:
    """Just enough of pickle protocol 2 for a flat state dict of tensors."""

    def __init__(self):
        self.out = bytearray(b"\x80\x02")  # PROTO 2

    def global_(self, module: str, name: str) -> None:
        self.out += b"c" + f"{module}\n{name}\n".encode()

    def string(self, s: str) -> None:
        raw = s.encode()
        self.out += b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE

    def int_(self, v: int) -> None:
        self.out += b"J" + struct.pack("<i", v) if -2**31 <= v < 2**31 else b"\x8a\x08" + struct.pack("<q", v)

    def tuple_(self, items: tuple[int, ...]) -> None:
        self.out += b"("  # MARK
        for v in items:
            self.int_(v)
        self.out += b"t"  # TUPLE

    def tensor(self, key: str, dtype: str, shape: tuple[int, ...]) -> None:
        numel = math.prod(shape)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        self.global_("torch._utils", "_rebuild_tensor_v2")
        self.out += b"("  # MARK: the args tuple
        self.out += b"("  # MARK: persistent id ('storage', type, key, location, numel)
        self.string("storage")
        self.global_("torch", DTYPES[dtype].storage)
        self.string(key)
        self.string("cpu")
        self.int_(numel)
        self.out += b"tQ"  # TUPLE, BINPERSID
        self.int_(0)
        self.tuple_(shape)
        self.tuple_(stride)
        self.out += b"\x89"  # NEWFALSE: requires_grad
        self.global_("collections", "OrderedDict")
        self.out += b")R"  # EMPTY_TUPLE, REDUCE: backward hooks
        self.out += b"tR"  # TUPLE, REDUCE

    def state_dict(self, entries: list[tuple[str, str, str, tuple[int, ...]]]) -> bytes:
        self.out += b"}"  # EMPTY_DICT
        if entries:
            self.out += b"("
            for name, key, dtype, shape in entries:
                self.string(name)
                self.tensor(key, dtype, shape)
            self.out += b"u"  # SETITEMS
        self.out += b"."  # STOP
        return bytes(self.out)


def _aligned(zf: zipfile.ZipFile, name: str, size: int) -> zipfile.ZipInfo:
    """A stored entry whose data starts on a 64-byte boundary (padding in the extra field)."""
    info = zipfile.ZipInfo(f"{ARCHIVE}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64_extra = 20 if size > zipfile.ZIP64_LIMIT else 0  # zipfile adds a zip64 field to big entries
    base = zf.fp.tell() + 30 + len(info.filename.encode()) + zip64_extra + 4
    pad = -base % ALIGN
    info.extra = struct.pack("<HH", 0x4644, pad) + b"\0" * pad
    return info


def write_torch(plan: Plan, path: Path, progress: Callable[[int], None] | None = None) -> None:
    tensors = list(plan.tensors)
    keys = {t.name: str(i) for i, t in enumerate(tensors)}
    entries = [(t.name, keys[t.name], t.dtype, t.shape) for t in tensors]
    by_name = {t.name: t for t in tensors}
    entries += [(alias, keys[src], by_name[src].dtype, by_name[src].shape) for alias, src in plan.aliases.items()]
    pickle_bytes = _Pickle().state_dict(entries)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf, SourceFiles() as src:
        zf.writestr(f"{ARCHIVE}/data.pkl", pickle_bytes)
        zf.writestr(f"{ARCHIVE}/.format_version", "1")
        zf.writestr(f"{ARCHIVE}/.storage_alignment", str(ALIGN))
        zf.writestr(f"{ARCHIVE}/byteorder", "little")
        for t in tensors:
            info = _aligned(zf, f"data/{keys[t.name]}", t.nbytes)
            with zf.open(info, "w", force_zip64=t.nbytes > zipfile.ZIP64_LIMIT) as out:
                for chunk in iter_tensor_chunks(src, t):
                    out.write(chunk)
            if progress:
                progress(t.nbytes)
        zf.writestr(f"{ARCHIVE}/version", "3\n")
