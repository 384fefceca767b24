"""The one positional read: exactly ``nbytes`` at ``offset``, or a typed error naming the file.

Positional reads (``pread``) need no seek state, so threads share a descriptor, and they read
exactly the bytes a plan names: no mmap, whose touched pages would count in the reader's RSS.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import CorruptFileError


def pread_exact(fd: int, nbytes: int, offset: int, path: Path | str, into: bytearray | None = None) -> bytes | bytearray:
    """``nbytes`` at ``offset`` of the open file ``fd`` (``path`` names it in errors); ``into`` is
    filled in place when given (one buffer, no copy)."""
    if offset < 0 or nbytes < 0:
        raise CorruptFileError(f"{path}: read of {nbytes} bytes at offset {offset} is out of range")
    if into is not None:
        got = os.preadv(fd, [into], offset) if nbytes else 0
        data = into
    else:
        data = os.pread(fd, nbytes, offset)
        got = len(data)
    if got != nbytes:
        raise CorruptFileError(f"{path}: short read of {nbytes} bytes at offset {offset} (file truncated?)")
    return data


def read_range(path: Path | str, offset: int, nbytes: int, into: bytearray | None = None) -> bytes | bytearray:
    """Open, read exactly one range, close."""
    with open(path, "rb") as fh:
        return pread_exact(fh.fileno(), nbytes, offset, path, into)
