"""Stream object trees into ``torch.save``-compatible zip archives, without torch and without holding tensors.

``write_archive(path, obj, chunks)`` does, in order:
1. ``pickle_writer.dumps(obj)``: the pickle and the storages it names (keys "0", "1", ...);
2. the zip entries torch writes - ``data.pkl``, ``.format_version``, ``.storage_alignment``,
   ``byteorder`` - under a folder named after the file's stem, as ``torch.save`` names it;
3. each storage as ``data/<key>``: stored uncompressed, its data 64-byte aligned (as torch aligns
   it, so memory-mapped loading works), streamed from ``chunks(storage)`` - memory stays O(chunk);
4. ``version``.
Consolidated ``.pt`` files (``write_torch``) and resharded rank files both go through here; the
results load with torch's weights-only unpickler whenever the tree names only allowlisted globals.
"""
from __future__ import annotations

import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable

from ..formats.pickle_writer import NewTensor, StorageOut, dumps
from ..plan.consolidate import Plan
from .read import Reader

ALIGN = 64
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed: the same input gives the same bytes


def _aligned(zf: zipfile.ZipFile, name: str, size: int) -> zipfile.ZipInfo:
    """A stored entry whose data starts on a 64-byte boundary (padding in the extra field)."""
    info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64_extra = 20 if size > zipfile.ZIP64_LIMIT else 0  # zipfile adds a zip64 field to big entries
    base = zf.fp.tell() + 30 + len(info.filename.encode()) + zip64_extra + 4
    pad = -base % ALIGN
    info.extra = struct.pack("<HH", 0x4644, pad) + b"\0" * pad
    return info


def write_archive(path: Path, obj: Any, chunks: Callable[[StorageOut], Iterable[bytes]],
                  progress: Callable[[int], None] | None = None, allow_foreign: bool = False) -> list[StorageOut]:
    """Write ``obj`` to ``path`` as torch.save would; returns the storages written (``allow_foreign``:
    see ``pickle_writer.dumps``)."""
    pickle_bytes, storages = dumps(obj, allow_foreign)
    folder = Path(path).name.split(".")[0] or "archive"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in (("data.pkl", pickle_bytes), (".format_version", b"1"),
                           (".storage_alignment", str(ALIGN).encode()), ("byteorder", b"little")):
            zf.writestr(zipfile.ZipInfo(f"{folder}/{name}", date_time=ZIP_DATE), data)
        for storage in storages:
            info = _aligned(zf, f"{folder}/data/{storage.key}", storage.nbytes)
            written = 0
            with zf.open(info, "w", force_zip64=storage.nbytes > zipfile.ZIP64_LIMIT) as out:
                for chunk in chunks(storage):
                    out.write(chunk)
                    written += len(chunk)
                    if progress:
                        progress(len(chunk))
            if written != storage.nbytes:
                raise ValueError(f"storage {storage.key} of {path}: {written} bytes written, {storage.nbytes} expected")
        zf.writestr(zipfile.ZipInfo(f"{folder}/version", date_time=ZIP_DATE), b"3\n")
    return storages


def write_torch(plan: Plan, path: Path, progress: Callable[[int], None] | None = None) -> None:
    """A consolidated state dict: ``{name: tensor}`` in plan order; tied aliases share their source's storage."""
    tensors = {t.name: NewTensor(t.dtype, t.shape, t) for t in plan.tensors}
    state = OrderedDict(tensors)
    for alias, src in plan.aliases.items():
        state[alias] = tensors[src]
    with Reader() as reader:
        write_archive(path, state, reader.storage_chunks, progress)
