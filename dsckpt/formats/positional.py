"""The one positional read: exactly ``nbytes`` at ``offset``, or a typed error naming the file.

Positional reads (``pread``) need no seek state, so threads share a descriptor, and they read
exactly the bytes a plan names: no mmap, whose touched pages would count in the reader's RSS.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import CorruptFileError


def pread_exact(fd: int, nbytes: int, offset: int, path: Path | str, into=None) -> bytes | bytearray:
    """``nbytes`` at ``offset`` of the open file ``fd`` (``path`` names it in errors); ``into`` (a writable
    buffer: bytearray, memoryview) is filled in place when given (one buffer, no copy)."""
    if offset < 0 or nbytes < 0:
        raise CorruptFileError(f"{path}: read of {nbytes} bytes at offset {offset} is out of range")
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
        raise CorruptFileError(f"{path}: short read of {nbytes} bytes at offset {offset} (file truncated?)")
    return data


def read_range(path: Path | str, offset: int, nbytes: int, into=None) -> bytes | bytearray:
    """Open, read exactly one range, close."""
    with open(path, "rb") as fh:
        return pread_exact(fh.fileno(), nbytes, offset, path, into)
