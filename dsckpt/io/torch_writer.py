"""Stream object trees into ``torch.save``-compatible zip archives, without torch and without holding tensors.

``write_archive(path, obj, source, context)`` does, in order:
1. ``pickle_writer.dumps(obj)``: the pickle and the storages it names (keys "0", "1", ...) - or takes them
   done (``write_pickled``);
2. the zip entries torch writes - ``data.pkl``, ``.format_version``, ``.storage_alignment``,
   ``byteorder`` - under a folder named after the file's stem, as ``torch.save`` names it;
3. each storage as ``data/<key>``: stored uncompressed, its data 64-byte aligned (as torch aligns
   it, so memory-mapped loading works), from ``source`` (``StorageBytes``: ``io.read.Reader``): into a local file
   copied straight in where it can be (``copy_storage``), else streamed from ``storage_chunks(storage, next
   storage)`` - memory stays O(chunk) - with the CRC-32 its chunks come with (``io.read`` steps 3, 4);
4. ``version``.
The write's context (``io.context``) says whether ``path`` streams to a bucket, starts its write-back as it goes,
and whom to tell the bytes written; None: a local file, nothing else.
Consolidated ``.pt`` files (``write_torch``) and resharded rank files both go through here; the
results load with torch's weights-only unpickler whenever the tree names only allowlisted globals.
"""
from __future__ import annotations

import contextlib
import os
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator, Protocol

from ..formats.crc import crc32_combine
from ..formats.positional import write_all
from ..formats.pickle_writer import NewTensor, StorageOut, dumps
from ..plan.consolidate import Plan
from . import writeback
from .context import WriteContext
from .read import Chunk, Reader

if TYPE_CHECKING:
    from .stream import ZipSink

ALIGN = 64


class StorageBytes(Protocol):
    """Where a storage's bytes come from (``io.read.Reader``)."""

    def storage_chunks(self, storage: StorageOut, then: StorageOut | None) -> Iterable[tuple[Chunk, int | None]]:
        """The bytes in chunks, each with its CRC-32; ``then`` names the storage streamed next."""

    def copy_storage(self, storage: StorageOut, fd: int, offset: int, started: writeback.Started,
                     progress: Callable[[int], None] | None) -> tuple[int, int] | None:
        """The bytes written into ``fd`` from ``offset``: (bytes, CRC-32), or None (then ``storage_chunks``)."""

ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed: the same input gives the same bytes


def _aligned(zf: zipfile.ZipFile, name: str, size: int) -> zipfile.ZipInfo:
    """A stored entry whose data starts on a 64-byte boundary (padding in the extra field)."""
    info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64_extra = 20 if size > zipfile.ZIP64_LIMIT else 0  # zipfile adds a zip64 field to big entries
    base = _tell(zf) + 30 + len(info.filename.encode()) + zip64_extra + 4
    pad = -base % ALIGN
    info.extra = struct.pack("<HH", 0x4644, pad) + b"\0" * pad
    return info


def _stream(out, fp, chunks: Iterable[tuple[Chunk, int | None]], progress,
            started: writeback.Started) -> int:
    """Write one stored entry's chunks, its CRC-32 joined from theirs.

    zipfile computes the CRC inside ``write``, a second pass over bytes the reader checksummed already (and, in
    turn with the write, once the larger part of a reshard's time: docs/dev/performance-log.md 12).  Its entry
    writer keeps the running CRC and size in ``_crc`` / ``_file_size`` (Python 3.6 - 3.13) and writes them
    into the headers on close; without those attributes, plain ``write`` is used.
    """
    if not (hasattr(out, "_crc") and hasattr(out, "_file_size")):
        size = 0
        for chunk, _ in chunks:
            size += write_all(out, chunk)
            if progress:
                progress(len(chunk))
        return size
    crc, size = 0, 0
    for chunk, chunk_crc in chunks:
        if chunk_crc is None:
            raise ValueError("a chunk came without its CRC-32")
        written = write_all(fp, chunk)
        started(fp.tell() - written, written)
        crc = crc32_combine(crc, chunk_crc, written) if size else chunk_crc
        size += written
        if progress:
            progress(written)
    out._crc, out._file_size = crc, size
    return size


def _fileno(fp) -> int | None:
    """The descriptor of a local file, else None (a streamed zip's sink has none)."""
    try:
        return fp.fileno()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is an OSError and a ValueError)
        return None


def write_archive(path: Path | BinaryIO, obj: Any, source: StorageBytes, context: WriteContext | None = None,
                  allow_foreign: bool = False) -> list[StorageOut]:
    """Write ``obj`` to ``path`` (or an open seekable binary stream, whose ``tell()`` the archive's offsets are
    relative to) as torch.save would; returns the storages written (``allow_foreign``: see ``pickle_writer.dumps``)."""
    return write_pickled(path, dumps(obj, allow_foreign), source, context)


def write_pickled(path: Path | BinaryIO, pickled: tuple[bytes, list[StorageOut]], source: StorageBytes,
                  context: WriteContext | None = None) -> list[StorageOut]:
    """``write_archive`` of a tree already pickled (``dumps``' result): a caller that pickled every tree to check
    it before writing (reshard) does not pickle it twice."""
    local = Path(path) if isinstance(path, (str, os.PathLike)) else None
    folder = (local.name.split(".")[0] if local is not None else "") or "archive"  # (torch.save's for a stream)
    streamed = context.stream_target(local) if local is not None and context is not None else None
    if streamed is None or local is None:
        return _write_zip(path, folder, pickled, source, context)
    from .stream import ZipSink  # (a bucket's modules, imported for one only)

    with ZipSink(*streamed, local) as sink:  # a run streaming OUT to object storage (io.stream)
        return _write_zip(sink, folder, pickled, source, context)


def write_raw(path: Path, storage: StorageOut, source: StorageBytes, context: WriteContext | None = None) -> None:
    """One storage's bytes alone in a local file (a ZeRO-Infinity swap file), copied straight in where it can be."""
    progress = context.progress if context is not None else None
    with open(path, "wb") as fp:
        started = context.started(path, fp.fileno()) if context is not None else writeback.skip
        copied = source.copy_storage(storage, fp.fileno(), 0, started, progress) if storage.nbytes else (0, 0)
        if copied is None:
            written = 0
            for chunk, _ in source.storage_chunks(storage, None):
                written += write_all(fp, chunk)
                started(written - len(chunk), len(chunk))
                if progress:
                    progress(len(chunk))
            copied = (written, 0)
    if copied[0] != storage.nbytes:
        raise ValueError(f"{path}: {copied[0]} bytes written, {storage.nbytes} expected")


def _write_zip(path: Path | BinaryIO | ZipSink, folder: str, pickled: tuple[bytes, list[StorageOut]],
               source: StorageBytes, context: WriteContext | None) -> list[StorageOut]:
    progress = context.progress if context is not None else None
    pickle_bytes, storages = pickled
    sink: Any = path if hasattr(path, "hold") else None  # a ZipSink, or a window on one (export.dcp)
    local = isinstance(path, (str, os.PathLike))  # (a file this opens: its descriptor's offsets are the zip's)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in (("data.pkl", pickle_bytes), (".format_version", b"1"),
                           (".storage_alignment", str(ALIGN).encode()), ("byteorder", b"little")):
            with _held(sink, zf):
                zf.writestr(zipfile.ZipInfo(f"{folder}/{name}", date_time=ZIP_DATE), data)
        started = context.started(path, _fileno(zf.fp)) if context is not None else writeback.skip
        following: list[StorageOut | None] = []  # each storage's next one with bytes (read ahead while it is written)
        then: StorageOut | None = None
        for storage in reversed(storages):
            following.append(then)
            then = storage if storage.nbytes else then
        for storage, then in zip(storages, reversed(following)):
            info = _aligned(zf, f"{folder}/data/{storage.key}", storage.nbytes)
            with _held(sink, zf), zf.open(info, "w", force_zip64=storage.nbytes > zipfile.ZIP64_LIMIT) as out:
                if sink:  # (its data is not kept locally)
                    sink.mirror = False
                copied = _copy(zf.fp, out, source, storage, started, progress) if local and storage.nbytes else None
                written = copied if copied is not None else _stream(out, zf.fp, source.storage_chunks(storage, then),
                                                                    progress, started)
                if sink:
                    sink.mirror = True
            if written != storage.nbytes:
                raise ValueError(f"storage {storage.key} of {path}: {written} bytes written, {storage.nbytes} expected")
        with _held(sink, zf):
            zf.writestr(zipfile.ZipInfo(f"{folder}/version", date_time=ZIP_DATE), b"3\n")
    return storages


def _copy(fp, out, source: StorageBytes, storage: StorageOut, started: writeback.Started,
          progress: Callable[[int], None] | None) -> int | None:
    """The entry's bytes written by ``source.copy_storage`` at the zip's position (None: it could not); the entry
    writer gets its CRC-32 and size as ``_stream`` gives them."""
    if not (hasattr(out, "_crc") and hasattr(out, "_file_size")):
        return None
    fp.flush()
    start = fp.tell()
    copied = source.copy_storage(storage, fp.fileno(), start, started, progress)
    if copied is None:
        return None
    size, crc = copied
    fp.seek(start + size)
    out._crc, out._file_size = crc, size
    return size


@contextlib.contextmanager
def _held(sink: Any, zf: zipfile.ZipFile) -> Iterator[None]:
    """An entry written into a streamed zip: zipfile writes its local header again when it closes (the CRC)."""
    if sink is None:
        yield
        return
    header = _tell(zf)
    sink.hold(header)
    yield
    sink.release(header)


def _tell(zf: zipfile.ZipFile) -> int:
    """Where the archive's next byte goes."""
    if zf.fp is None:
        raise ValueError("the archive is closed")
    return zf.fp.tell()


def write_torch(plan: Plan, path: Path, context: WriteContext) -> None:
    """A consolidated state dict: ``{name: tensor}`` in plan order; tied aliases share their source's storage."""
    tensors = {t.name: NewTensor(t.dtype, t.shape, t) for t in plan.tensors}
    state = OrderedDict(tensors)
    for alias, src in plan.aliases.items():
        state[alias] = tensors[src]
    with Reader(context) as reader:
        write_archive(path, state, reader, context)
