"""Start the disk on what a durable output has just written, so its closing fsync finds little left.

1. Written pages wait in the page cache until the kernel's dirty limits, or the fsync at publish, push them
   out: an output below those limits was copied first and reached the disk after, one stage after the other.
2. The write's context (``io.context.WriteContext.durable``) names the staged temps its commit will fsync.
3. ``for_output(path, fd, durable)``: a writer's ``started(offset, nbytes)`` for the file it fills - under one of
   the ``durable`` temps, Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which begins writing that range and
   does not wait, so the copy and the disk overlap; elsewhere (``--no-fsync``: it would only compete with the copy; not Linux)
   nothing.  It makes nothing durable (the fsync still does), and a failure is ignored: it is advice.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import Callable, Collection, Iterator

Started = Callable[[int, int], None]
_SYNC_FILE_RANGE_WRITE = 2
_call: Callable[[int, int, int, int], int] | None = None
_bound = False


def skip(offset: int, nbytes: int) -> None:
    """The ``Started`` of an output that is not flushed: nothing to start."""


def for_output(path: object, fd: int | None, durable: Collection[Path]) -> Started:
    """What the writer of ``path`` (open as ``fd``) calls after each range it wrote."""
    if fd is None or not isinstance(path, (str, Path)) or not durable:
        return skip
    path = Path(path)
    if not any(p in durable for p in (path, *path.parents)):
        return skip
    call = _bind()
    if call is None:
        return skip

    def started(offset: int, nbytes: int) -> None:
        if nbytes > 0:
            call(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
    return started


@contextlib.contextmanager
def following(path: Path, step: int = 32 << 20, every: float = 0.02) -> Iterator[None]:
    """Around a writer dsckpt does not drive (``torch.save`` in the background engine): a thread starts the
    write-back of each ``step`` bytes the file at ``path`` has grown by, so the fsync after the block finds little
    left.  Advice only: where ``sync_file_range`` is missing, or the file cannot be opened, nothing happens."""
    call = _bind()
    if call is None:
        yield
        return
    stop = threading.Event()

    def follow() -> None:
        fd, done = None, 0
        try:
            while not stop.wait(every):
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError:
                        continue  # (not created yet)
                size = os.fstat(fd).st_size
                if size - done >= step:
                    call(fd, done, size - done, _SYNC_FILE_RANGE_WRITE)
                    done = size
        finally:
            if fd is not None:
                os.close(fd)
    thread = threading.Thread(target=follow, name="dsckpt-writeback", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _bind() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range``, looked up once (None: not Linux, or no such symbol)."""
    global _call, _bound
    if not _bound:
        _bound = True
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            except (OSError, AttributeError):
                return None
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _call = fn
    return _call
