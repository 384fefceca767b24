"""Copy byte ranges between local files at known offsets, each range's CRC-32 noted as it goes.

``copy_range`` (one thread filling a file: consolidate) moves one range of a source file to an offset of the
output, one of three ways:
1. a small range (``SMALL_COPY``): ``pread`` then ``pwrite`` - a mapping would cost more than the copy;
2. source and output out of step within a page: ``pwrite`` from populated mapped windows of the source,
   ``MAPPED_SLICE`` at a time, each slice checksummed just after it was written (still in the core's cache).
   The kernel's own copy runs at half speed out of step (docs/dev/performance-log.md 17, 27);
3. otherwise ``copy_file_range`` (kernel to kernel, no user copy).
What passes through user space is noted in the write's ``ledger`` for the integrity check (``io.integrity``):
ways 1 and 2.
``copy_pieces`` (several threads each filling a file: reshard's rank files, ``io.read.Reader.copy_storage``)
writes a source's pieces (``plan.segments``: segments and zero fills) one after another through the thread's own
``BUFFER``, read, written and checksummed a buffer at a time, and returns their CRC-32 for the zip entry.
Mappings do not pay there: each unmapping while other threads of the process run costs a TLB shootdown on
every core (log 27).
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from ..errors import CorruptFileError
from ..formats.crc import crc32, crc32_combine
from ..formats.positional import pwrite_all
from ..plan.segments import Segment, Zeros
from . import writeback

if TYPE_CHECKING:
    from .integrity import Ledger

SMALL_COPY = 64 << 10  # up to this: pread and pwrite (most ZeRO-3 pieces of norms and biases are a few KB)
MAP_WINDOW = 8 << 20  # mapped at a time: page-cache pages, counted in RSS only while mapped
MAPPED_SLICE = 256 << 10  # written, then checksummed while still in the core's L2 cache
FALLBACK_CHUNK = 64 << 20  # pread/pwrite where the file system has no copy_file_range
BUFFER = 1 << 20  # copy_pieces' per thread: read, written, then checksummed while in L2
ZERO_FILL = 1 << 20
_THREAD = threading.local()
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: every page mapped up front (without it: slower than cfr)


def copy_range(src_fd: int, dst_fd: int, nbytes: int, src_off: int, dst_off: int, src_path: Path,
               started: writeback.Started = writeback.skip, ledger: "Ledger | None" = None) -> None:
    """``nbytes`` from ``src_off`` of one file (``src_path``, named in errors) to ``dst_off`` of another (see the
    module docstring); what passes through user space noted in ``ledger``."""
    if nbytes <= SMALL_COPY:
        data = os.pread(src_fd, nbytes, src_off)
        if len(data) < nbytes:
            raise CorruptFileError(f"ends before byte {src_off + nbytes} while being copied (truncated?)", at=src_path)
        pwrite_all(dst_fd, data, dst_off)
        if ledger is not None:
            ledger.add(src_path, src_off, data)
        started(dst_off, nbytes)
        return
    if _MAP_POPULATE and (src_off - dst_off) % mmap.PAGESIZE:
        nbytes, src_off, dst_off = _copy_mapped(src_fd, dst_fd, nbytes, src_off, dst_off, src_path, started, ledger)
    while nbytes:
        try:
            n = os.copy_file_range(src_fd, dst_fd, nbytes, src_off, dst_off)
        except OSError:  # filesystems without support: fall back to pread/pwrite
            n = pwrite_all(dst_fd, os.pread(src_fd, min(nbytes, FALLBACK_CHUNK), src_off), dst_off)
        if n == 0:
            raise CorruptFileError(f"ends before byte {src_off + nbytes} while being copied (truncated?)", at=src_path)
        started(dst_off, n)
        nbytes, src_off, dst_off = nbytes - n, src_off + n, dst_off + n


def copy_pieces(pieces: Iterable[Segment | Zeros], fd: Callable[[Path], int], dst_fd: int, dst_off: int,
                started: writeback.Started = writeback.skip,
                progress: Callable[[int], None] | None = None, ledger: "Ledger | None" = None) -> tuple[int, int]:
    """Each piece (``fd(path)``: its file's descriptor) written after the last from ``dst_off`` of ``dst_fd``; the
    bytes written and their CRC-32 (each buffer's noted in ``ledger``)."""
    total, crc = 0, 0
    for piece in pieces:
        if not piece.nbytes:
            continue
        if isinstance(piece, Zeros):
            piece_crc = _write_zeros(dst_fd, piece.nbytes, dst_off + total)
            started(dst_off + total, piece.nbytes)
        else:
            piece_crc = _copy_buffered(fd(piece.path), dst_fd, piece.nbytes, piece.offset, dst_off + total,
                                       piece.path, started, ledger)
        crc = crc32_combine(crc, piece_crc, piece.nbytes) if total else piece_crc
        total += piece.nbytes
        if progress:
            progress(piece.nbytes)
    return total, crc


def _copy_buffered(src_fd: int, dst_fd: int, nbytes: int, src_off: int, dst_off: int, src_path: Path,
                   started: writeback.Started, ledger: "Ledger | None") -> int:
    """``copy_range`` through this thread's ``BUFFER``; the range's CRC-32 (each buffer's noted)."""
    view = getattr(_THREAD, "buffer", None)
    if view is None:
        view = _THREAD.buffer = memoryview(bytearray(BUFFER))
    crc, done = 0, 0
    while done < nbytes:
        n = os.preadv(src_fd, [view[:min(len(view), nbytes - done)]], src_off + done)
        if n == 0:
            raise CorruptFileError(f"ends before byte {src_off + nbytes} while being copied (truncated?)", at=src_path)
        pwrite_all(dst_fd, view[:n], dst_off + done)
        part_crc = crc32(view[:n])
        if ledger is not None:
            ledger.add(src_path, src_off + done, view[:n], part_crc)
        started(dst_off + done, n)
        crc = crc32_combine(crc, part_crc, n) if done else part_crc
        done += n
    return crc


def _write_zeros(fd: int, nbytes: int, offset: int) -> int:
    zeros = bytes(min(nbytes, ZERO_FILL))
    crc, done = 0, 0
    while done < nbytes:
        n = pwrite_all(fd, zeros[:nbytes - done], offset + done)
        crc, done = crc32(zeros[:n], crc), done + n
    return crc


def _copy_mapped(src_fd: int, dst_fd: int, nbytes: int, src_off: int, dst_off: int, src_path: Path,
                 started: writeback.Started, ledger: "Ledger | None") -> tuple[int, int, int]:
    """Copy through mapped windows of the source, the CRC-32 of each noted in ``ledger`` (if any); returns what
    is left (all of it where the source cannot be mapped, or is shorter than the range: the caller's loop then
    copies it, or reports the truncation).
    A page beyond a file truncated meanwhile fails the ``pwrite`` with EFAULT (an OSError), not the process with
    SIGBUS; a slice is checksummed only after its ``pwrite`` went through whole (a file changed while it is read is
    outside the threat model, docs/security.md)."""
    while nbytes:
        n = min(MAP_WINDOW, nbytes)
        start = src_off % mmap.PAGESIZE
        try:
            window = mmap.mmap(src_fd, start + n, offset=src_off - start, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                               prot=mmap.PROT_READ)
        except (OSError, ValueError):  # (ValueError: the range runs past the end of the file)
            break
        with window, memoryview(window) as view:
            scan = (lambda at, data: ledger.finite.scan(src_path, src_off + at, data)) if ledger is not None else None
            crc = _write_view(dst_fd, view, start, n, dst_off, scan)
            if crc is not None and ledger is not None:
                with view[start:start + n] as copied:
                    ledger.add(src_path, src_off, copied, crc, scanned=True)
        if crc is None:
            raise CorruptFileError("shrank while being copied (truncated by another process?)", at=src_path)
        started(dst_off, n)
        nbytes, src_off, dst_off = nbytes - n, src_off + n, dst_off + n
    return nbytes, src_off, dst_off


def _write_view(fd: int, view: memoryview, start: int, n: int, offset: int,
                scan: Callable[[int, memoryview], None] | None) -> int | None:
    """``view[start:start + n]`` to ``fd`` at ``offset`` in ``MAPPED_SLICE`` calls, with ``scan`` each slice
    checksummed and shown to it (its offset in the range) just after it was written, while in the core's cache; the
    CRC-32 of the whole (0 without), None when the mapped file shrank under it (EFAULT).  Each slice is released
    before the mapping closes (an exception's frames would otherwise keep it exported)."""
    done, crc = 0, 0
    while done < n:
        with view[start + done:start + min(n, done + MAPPED_SLICE)] as piece:
            try:
                written = os.pwrite(fd, piece, offset + done)
            except OSError as exc:
                if exc.errno == errno.EFAULT:
                    return None
                raise
            if scan is not None:
                with piece[:written] as copied:
                    crc = crc32(copied, crc)
                    scan(done, copied)
            done += written
    return crc
