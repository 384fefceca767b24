"""Copy byte ranges between local files at known offsets, each range's CRC-32 noted as it goes.

``copy_range`` moves one range of a source file to an offset of the output, one of three ways:
1. a small range (``SMALL_COPY``): ``pread`` then ``pwrite`` - a mapping would cost more than the copy;
2. source and output out of step within a page, or the range's CRC-32 wanted: ``pwrite`` from populated
   mapped windows of the source, ``MAPPED_SLICE`` at a time, each slice checksummed just after it was written
   (still in the core's cache).  The kernel's own copy runs at half speed out of step, and shows no byte to
   checksum (docs/dev/performance-log.md 17, 27);
3. otherwise ``copy_file_range`` (kernel to kernel, no user copy).
What passes through user space is noted for the integrity check (``io.integrity.note``): ways 1 and 2.
``copy_pieces`` writes a source's pieces (``plan.segments``: segments and zero fills) one after another and
returns their CRC-32: a resharded rank file's storages go into its zip this way (``io.read.Reader.copy_storage``).
"""
from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Callable, Iterable

from ..errors import CorruptFileError
from ..formats.crc import crc32, crc32_combine
from ..formats.positional import pwrite_all
from ..plan.segments import Segment, Zeros
from . import writeback
from .integrity import note, recording_now

SMALL_COPY = 64 << 10  # up to this: pread and pwrite (most ZeRO-3 pieces of norms and biases are a few KB)
MAP_WINDOW = 8 << 20  # mapped at a time: page-cache pages, counted in RSS only while mapped
MAPPED_SLICE = 256 << 10  # written, then checksummed while still in the core's L2 cache
FALLBACK_CHUNK = 64 << 20  # pread/pwrite where the file system has no copy_file_range
ZERO_FILL = 1 << 20
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: every page mapped up front (without it: slower than cfr)


def copy_range(src_fd: int, dst_fd: int, nbytes: int, src_off: int, dst_off: int, src_path: Path,
               started: writeback.Started = writeback.skip, want_crc: bool = False) -> int | None:
    """``nbytes`` from ``src_off`` of one file (``src_path``, named in errors) to ``dst_off`` of another (see the
    module docstring); with ``want_crc`` the range's CRC-32 (never the kernel's copy then), else None."""
    if nbytes <= SMALL_COPY:
        data = os.pread(src_fd, nbytes, src_off)
        if len(data) < nbytes:
            raise CorruptFileError(f"{src_path}: ends before byte {src_off + nbytes} while being copied (truncated?)")
        pwrite_all(dst_fd, data, dst_off)
        crc = crc32(data) if want_crc or recording_now() else None
        note(src_path, src_off, data, crc)
        started(dst_off, nbytes)
        return crc if want_crc else None
    crc = None
    if _MAP_POPULATE and (want_crc or (src_off - dst_off) % mmap.PAGESIZE):
        nbytes, src_off, dst_off, crc = _copy_mapped(src_fd, dst_fd, nbytes, src_off, dst_off, src_path, started,
                                                     want_crc or recording_now())
    while nbytes:  # (what could not be mapped: the kernel's copy, or a read and a write when a CRC is wanted)
        if want_crc:
            data = os.pread(src_fd, min(nbytes, FALLBACK_CHUNK), src_off)
            n = pwrite_all(dst_fd, data, dst_off) if data else 0
            if n:
                note(src_path, src_off, data)
                crc = crc32(data, crc) if crc is not None else crc32(data)
        else:
            try:
                n = os.copy_file_range(src_fd, dst_fd, nbytes, src_off, dst_off)
            except OSError:  # filesystems without support: fall back to pread/pwrite
                n = pwrite_all(dst_fd, os.pread(src_fd, min(nbytes, FALLBACK_CHUNK), src_off), dst_off)
        if n == 0:
            raise CorruptFileError(f"{src_path}: ends before byte {src_off + nbytes} while being copied (truncated?)")
        started(dst_off, n)
        nbytes, src_off, dst_off = nbytes - n, src_off + n, dst_off + n
    return crc if want_crc else None


def copy_pieces(pieces: Iterable[Segment | Zeros], fd: Callable[[Path], int], dst_fd: int, dst_off: int,
                started: writeback.Started = writeback.skip,
                progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Each piece (``fd(path)``: its file's descriptor) written after the last from ``dst_off`` of ``dst_fd``; the
    bytes written and their CRC-32."""
    total, crc = 0, 0
    for piece in pieces:
        if not piece.nbytes:
            continue
        if isinstance(piece, Zeros):
            piece_crc = _write_zeros(dst_fd, piece.nbytes, dst_off + total)
            started(dst_off + total, piece.nbytes)
        else:
            piece_crc = copy_range(fd(piece.path), dst_fd, piece.nbytes, piece.offset, dst_off + total, piece.path,
                                   started, want_crc=True)
        crc = crc32_combine(crc, piece_crc, piece.nbytes) if total else piece_crc
        total += piece.nbytes
        if progress:
            progress(piece.nbytes)
    return total, crc


def _write_zeros(fd: int, nbytes: int, offset: int) -> int:
    zeros = bytes(min(nbytes, ZERO_FILL))
    crc, done = 0, 0
    while done < nbytes:
        n = pwrite_all(fd, zeros[:nbytes - done], offset + done)
        crc, done = crc32(zeros[:n], crc), done + n
    return crc


def _copy_mapped(src_fd: int, dst_fd: int, nbytes: int, src_off: int, dst_off: int, src_path: Path,
                 started: writeback.Started, with_crc: bool) -> tuple[int, int, int, int | None]:
    """Copy through mapped windows of the source; returns what is left (all of it where the source cannot be
    mapped, or is shorter than the range: the caller's loop then copies it, or reports the truncation) and, with
    ``with_crc``, the CRC-32 of what was copied (noted too; None: nothing copied, or no CRC).
    A page beyond a file truncated meanwhile fails the ``pwrite`` with EFAULT (an OSError), not the process with
    SIGBUS; a slice is checksummed only after its ``pwrite`` went through whole (a file changed while it is read is
    outside the threat model, docs/security.md)."""
    total = None
    while nbytes:
        n = min(MAP_WINDOW, nbytes)
        start = src_off % mmap.PAGESIZE
        try:
            window = mmap.mmap(src_fd, start + n, offset=src_off - start, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                               prot=mmap.PROT_READ)
        except (OSError, ValueError):  # (ValueError: the range runs past the end of the file)
            break
        with window, memoryview(window) as view:
            crc = _write_view(dst_fd, view, start, n, dst_off, with_crc)
            if crc is not None and with_crc:
                with view[start:start + n] as copied:
                    note(src_path, src_off, copied, crc)
        if crc is None:
            raise CorruptFileError(f"{src_path}: shrank while being copied (truncated by another process?)")
        started(dst_off, n)
        if with_crc:
            total = crc if total is None else crc32_combine(total, crc, n)
        nbytes, src_off, dst_off = nbytes - n, src_off + n, dst_off + n
    return nbytes, src_off, dst_off, total


def _write_view(fd: int, view: memoryview, start: int, n: int, offset: int, with_crc: bool) -> int | None:
    """``view[start:start + n]`` to ``fd`` at ``offset`` in ``MAPPED_SLICE`` calls, with ``with_crc`` each slice
    checksummed just after it was written; the CRC-32 of the whole (0 without), None when the mapped file shrank
    under it (EFAULT).  Each slice is
    released before the mapping closes (an exception's frames would otherwise keep it exported)."""
    done, crc = 0, 0
    while done < n:
        with view[start + done:start + min(n, done + MAPPED_SLICE)] as piece:
            try:
                written = os.pwrite(fd, piece, offset + done)
            except OSError as exc:
                if exc.errno == errno.EFAULT:
                    return None
                raise
            if with_crc:
                with piece[:written] as copied:
                    crc = crc32(copied, crc)
            done += written
    return crc
