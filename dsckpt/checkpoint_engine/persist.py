"""The background engine's file writer: the file ``torch.save`` writes, its storages' bytes copied from the
snapshot's host buffers by several threads and checked as they land.

``write_snapshot(state, path)``, in order:
1. ``torch.save`` under ``torch.serialization.skip_data``: torch writes the pickle, every header and the central
   directory, and leaves a hole with a zero CRC-32 where each storage's bytes go.  The storage behind each of the
   pickle's keys is recorded as torch's own pickler names it (``_recording_pickler``).
2. Each storage's bytes go into their hole in chunks, on ``THREADS`` threads: a chunk's CRC-32 is taken from the
   host buffer, the chunk written, its write-back started (``sync_file_range``), then read back and compared.  The
   file's lock serialises the copies into the page cache, not the CRC-32s around them.  A chunk is one ``pwrite``:
   each call's return takes the GIL back from the training thread (performance-log 37).
3. The CRC-32s go where torch's writer puts them: each entry's data descriptor (or local header) and its
   central-directory record.  The caller fsyncs the file.
The result is the file ``torch.save`` writes, byte for byte but for its random ``.data/serialization_id``.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import struct
import threading
import types
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptFileError
from ..formats.crc import crc32, crc32_combine
from ..formats.positional import pwrite_all
from ..io import writeback

CHUNK = 64 << 20
_READ_BACK = 8 << 20  # a thread's buffer for reading its chunks back (a 64 MiB one, mapped anew per file, is slower)
# 0: no read-back (a benchmark's control: what the read-back's memory traffic costs the training, performance-log 40)
WRITE_PIECE = CHUNK  # the most one pwrite takes: a chunk in one call
STARTED_FROM = 1 << 20  # a smaller write's write-back is left to the fsync
THREADS = int(os.environ.get("DSCKPT_PERSIST_THREADS", "0")) or max(1, min(4, os.cpu_count() or 1))
_NICE = 0  # added to the persist threads' nice value (Linux: per thread); 0 until measured (performance-log 37)
_CRC_FIELD = 14  # a local header's CRC-32, from its start
_DESCRIPTOR_MAGIC = b"PK\x07\x08"  # a data descriptor (the CRC-32 after the bytes: torch's writer sets flag bit 3)
_CD_RECORD = struct.Struct("<4s12xI8xHHH12x")  # a central-directory record: signature, CRC-32, name/extra/comment lengths
_CD_MAGIC = b"PK\x01\x02"


@dataclass(frozen=True)
class _Entry:
    key: str
    data: int  # the first byte of the storage's bytes
    nbytes: int
    crc_at: tuple[int, int]  # where its CRC-32 goes: data descriptor (or local header), central-directory record


def write_snapshot(state: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(state, path)``, the storages' bytes written in parallel and read back (module docstring)."""
    storages: dict[str, torch.UntypedStorage] = {}
    with torch.serialization.skip_data():
        try:
            torch.save(state, path, pickle_module=_recording_pickler(storages))
        except RuntimeError:
            _raise_os_error(state, path)
            raise
    fd = os.open(path, os.O_RDWR)
    try:
        entries = _entries(fd)
        crcs = _fill(path, fd, entries, storages)
        for entry in entries:
            for at in entry.crc_at:
                os.pwrite(fd, struct.pack("<I", crcs[entry.key]), at)
    finally:
        os.close(fd)


def _raise_os_error(state: Any, path: str | os.PathLike[str]) -> None:
    """torch's zip writer reports a failed write in its own words ("unexpected pos ..."); the same write through a
    Python file object lets the OS's error (ENOSPC, EFBIG, EDQUOT) reach us, raised as that."""
    try:
        with open(path, "wb") as fh, torch.serialization.skip_data():
            torch.save(state, fh, pickle_module=_recording_pickler({}))
    except OSError:
        raise
    except RuntimeError as exc:
        if isinstance(exc.__context__, OSError):
            raise exc.__context__ from None


def _recording_pickler(found: dict[str, torch.UntypedStorage]) -> types.ModuleType:
    """A pickle module for ``torch.save`` whose pickler records each storage key torch gives out."""

    class Pickler(pickle.Pickler):
        def __init_subclass__(cls, **kwargs: Any) -> None:  # torch's pickler subclasses this one inside torch.save
            super().__init_subclass__(**kwargs)
            named = cls.persistent_id

            def persistent_id(self: pickle.Pickler, obj: Any) -> Any:
                pid = named(self, obj)
                if isinstance(pid, tuple) and pid and pid[0] == "storage":
                    found[pid[2]] = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                return pid
            cls.persistent_id = persistent_id  # type: ignore[method-assign]

    module = types.ModuleType("pickle")
    module.Pickler = Pickler  # type: ignore[attr-defined]
    return module


def _entries(fd: int) -> list[_Entry]:
    """The ``data/<key>`` entries of the zip torch just wrote: where their bytes lie, where their CRC-32s go."""
    with os.fdopen(os.dup(fd), "rb") as fh, zipfile.ZipFile(fh) as zf:
        start, infos = zf.start_dir, zf.infolist()  # (in the directory's order; zip64 offsets resolved)
    directory = os.pread(fd, os.fstat(fd).st_size - start, start)
    out, at = [], 0
    for info in infos:
        magic, _crc, name_len, extra_len, comment_len = _CD_RECORD.unpack_from(directory, at)
        if magic != _CD_MAGIC:
            raise CorruptFileError(f"the central directory record at byte {start + at} is unreadable")
        record, at = start + at, at + _CD_RECORD.size + name_len + extra_len + comment_len
        folder, _, key = info.filename.rpartition("/data/")
        if not folder or "/" in folder:
            continue
        local_name, local_extra = struct.unpack("<HH", os.pread(fd, 4, info.header_offset + 26))
        data = info.header_offset + 30 + local_name + local_extra
        crc_at = info.header_offset + _CRC_FIELD
        if info.flag_bits & 0x08:  # a data descriptor after the bytes, its signature optional
            end = data + info.file_size
            crc_at = end + 4 if os.pread(fd, 4, end) == _DESCRIPTOR_MAGIC else end
        out.append(_Entry(key, data, info.file_size, (crc_at, record + 16)))
    return out


def _fill(path: str | os.PathLike[str], fd: int, entries: list[_Entry],
          storages: dict[str, torch.UntypedStorage]) -> dict[str, int]:
    """Every entry's bytes written from its storage; the CRC-32 of each."""
    started = writeback.for_output(Path(path), fd, [Path(path)])
    scratch = threading.local()
    work: list[tuple[_Entry, memoryview, int]] = []
    kept = []
    for entry in entries:
        storage = storages[entry.key]
        if storage.device.type != "cpu":  # a save outside a snapshot (DeepSpeed's other files): as torch.save does
            storage = storage.cpu()
        if storage.nbytes() != entry.nbytes:
            raise CorruptFileError(f"storage {entry.key} holds {storage.nbytes()} bytes, its entry "
                                   f"{entry.nbytes}", at=path)
        kept.append(storage)  # (a copy off the GPU lives as long as the views of its address)
        if entry.nbytes:
            whole = memoryview((ctypes.c_char * entry.nbytes).from_address(storage.data_ptr())).cast("B")
            work += [(entry, whole[at:at + CHUNK], at) for at in range(0, entry.nbytes, CHUNK)]

    def write(entry: _Entry, chunk: memoryview, at: int) -> int:
        crc = crc32(chunk)
        offset = entry.data + at
        pwrite_all(fd, chunk, offset, WRITE_PIECE)
        if len(chunk) >= STARTED_FROM:
            started(offset, len(chunk))
        if _READ_BACK and _read_back_crc(fd, offset, len(chunk), scratch) != crc:
            raise CorruptFileError(f"storage {entry.key}: the bytes read back at [{offset}, "
                                   f"{offset + len(chunk)}) are not the ones written", at=path)
        return crc

    crcs = {entry.key: 0 for entry in entries}
    if sum(len(chunk) for _, chunk, _ in work) < CHUNK:  # a small file: no threads to start
        results = [(entry, len(chunk), write(entry, chunk, at)) for entry, chunk, at in work]
    else:
        with ThreadPoolExecutor(THREADS, thread_name_prefix="dsckpt-persist", initializer=_lower_priority) as pool:
            futures = [(entry, len(chunk), pool.submit(write, entry, chunk, at)) for entry, chunk, at in work]
            results = [(entry, nbytes, done.result()) for entry, nbytes, done in futures]
    for entry, nbytes, crc in results:
        crcs[entry.key] = crc32_combine(crcs[entry.key], crc, nbytes)  # (the CRC-32 of no bytes is 0)
    return crcs


def _lower_priority() -> None:
    if _NICE and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _NICE))


def _read_back_crc(fd: int, offset: int, nbytes: int, scratch: threading.local) -> int:
    """The CRC-32 of ``nbytes`` of the file from ``offset``, read through a buffer of the thread's own."""
    buffer = getattr(scratch, "buffer", None)
    if buffer is None:
        buffer = scratch.buffer = memoryview(mmap.mmap(-1, _READ_BACK))  # (a bytearray's zero-fill holds the GIL)
    crc, done = 0, 0
    while done < nbytes:
        got = os.preadv(fd, [buffer[:min(_READ_BACK, nbytes - done)]], offset + done)
        if got <= 0:
            break
        crc, done = crc32(buffer[:got], crc), done + got
    return crc if done == nbytes else -1
