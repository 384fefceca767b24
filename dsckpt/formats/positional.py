"""The one positional read: exactly ``nbytes`` at ``offset``, or a typed error naming the file; and the one
way large buffers are handed to the kernel for writing (``write_all`` / ``pwrite_all``, in 1 MiB calls).

Positional reads (``pread``) need no seek state, so threads share a descriptor, and they read
exactly the bytes a plan names: no mmap, whose touched pages would count in the reader's RSS.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

Buffer = bytes | bytearray | memoryview  # what a write takes

from ..errors import CorruptFileError

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor


def pread_exact(fd: int, nbytes: int, offset: int, path: Path | str, into: Any = None) -> bytes | bytearray:
    """``nbytes`` at ``offset`` of the open file ``fd`` (``path`` names it in errors); ``into`` (a writable
    buffer: bytearray, memoryview) is filled in place when given (one buffer, no copy)."""
    if offset < 0 or nbytes < 0:
        raise CorruptFileError(f"read of {nbytes} bytes at offset {offset} is out of range", at=path)
    data: bytes | bytearray
    if into is not None:
        view, got = memoryview(into).cast("B"), 0
        while got < nbytes:  # Linux returns at most 0x7ffff000 bytes per call: a 4 GB tensor takes two
            n = os.preadv(fd, [view[got:nbytes]], offset + got)
            if n == 0:
                break
            got += n
        data = into
    else:
        data = os.pread(fd, nbytes, offset)
        got = len(data)
    if got != nbytes:
        raise CorruptFileError(f"short read of {nbytes} bytes at offset {offset} (file truncated?)", at=path)
    return data


# Writes reach the kernel in calls of at most this size: larger calls get large page-cache folios, which a VM that
# reports free memory to its host must fault back in, many times slower (docs/dev/performance-log.md 15, 17).
WRITE_SLICE = 1 << 20


def write_all(fp: Any, data: Buffer) -> int:
    """``fp.write`` of all of ``data`` (any buffer), in ``WRITE_SLICE`` calls; returns the bytes written."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), WRITE_SLICE):
        piece = view[start:start + WRITE_SLICE]
        while piece:  # raw files may write less than asked
            n = fp.write(piece)
            piece = piece[n if n is not None else len(piece):]
    return len(view)


def pwrite_all(fd: int, data: Buffer, offset: int, piece: int = WRITE_SLICE) -> int:
    """``os.pwrite`` of all of ``data`` at ``offset``, at most ``piece`` bytes a call; returns the bytes written."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + piece], offset + done)
    return len(view)


def read_range(path: Path | str, offset: int, nbytes: int, into: Any = None) -> bytes | bytearray:
    """Open, read exactly one range, close."""
    with open(path, "rb") as fh:
        return pread_exact(fh.fileno(), nbytes, offset, path, into)


# A range this large is read in pieces on several threads (``preadv`` releases the GIL): one thread's copy out of
# the page cache bounds a GPU resume (docs/dev/performance-log.md 16); smaller ranges are not worth a hand-off.
PARALLEL_READ_BYTES = 32 << 20
_PIECE_BYTES = 16 << 20
_readers: "ThreadPoolExecutor | None" = None


def read_range_into(path: Path | str, offset: int, nbytes: int, into: Any) -> None:
    """``read_range`` into a buffer, a large range on several threads at once."""
    global _readers
    threads = min(8, os.cpu_count() or 1)
    if nbytes < PARALLEL_READ_BYTES or threads < 2:
        read_range(path, offset, nbytes, into)
        return
    from concurrent.futures import ThreadPoolExecutor, wait  # (logging comes with it: only for a large range)

    view = memoryview(into).cast("B")
    piece = max(_PIECE_BYTES, -(-nbytes // threads))
    if _readers is None:
        _readers = ThreadPoolExecutor(threads, thread_name_prefix="dsckpt-read")
    with open(path, "rb") as fh:
        fd = fh.fileno()
        pieces = [_readers.submit(pread_exact, fd, min(piece, nbytes - start), offset + start, path,
                                  view[start:start + piece]) for start in range(0, nbytes, piece)]
        wait(pieces)  # every piece ends before the descriptor closes (a reused fd number would be read)
    for done in pieces:
        error = done.exception()
        if isinstance(error, CorruptFileError):  # a piece came short: name the whole range, as one read would
            raise CorruptFileError(f"short read of {nbytes} bytes at offset {offset} (file truncated?)", at=path)
        if error:
            raise error
