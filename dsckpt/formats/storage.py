"""Where bytes live: the storage protocol every read of a checkpoint and every publish of an output goes through.

The plans name bytes as (path, offset, length) - ``plan.segments.Segment`` - and stay as they are; a ``Storage``
turns such names into bytes and staged outputs into published ones.  ``LocalStorage`` is today's fast path:
descriptors opened once per file and shared by threads (positional reads need no seek), ``pread``/``preadv``
into reused buffers, ``posix_fadvise`` read-ahead, ``os.replace`` + directory fsync to publish.  Kernel-side
copies (``copy_file_range``, a mapped window's ``pwrite``: ``io.filecopy``) are a capability a backend offers
(``kernel_copies``, through ``fd``).  A URL's objects are ``formats.bucket.BucketStorage``; ``formats.backends.storage_for``
chooses between the two from the path.  Checkpoints in object storage reach the readers as local views that
storage fills by ranged GETs (``io.remote``; ``ArrivingStorage`` while the fill runs); outputs in object storage
are staged here and published into it, their safetensors files streamed (``io.stream``).
"""
from __future__ import annotations

import builtins
import contextlib
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Protocol

from .positional import pread_exact

URL_RE = re.compile(r"^(s3|gs|gcs|az|abfs|abfss)://", re.IGNORECASE)  # object stores (io.remote, through fsspec)
TEMP_MARK = ".dsckpt-tmp-"  # in every staged name: `.<name>.dsckpt-tmp-<pid>-<id>` (a run's, until published)


@dataclass(frozen=True)
class Entry:
    name: Path
    size: int


class Storage(Protocol):
    """The operations a backend implements (paths are the names plans carry).

    Order of calls in a writing command (the reads through ``io.context.WriteContext.storage``, the commit through
    ``io.output.Staging``):
    1. every process: ``list``, ``size``, ``open`` while the checkpoint is surveyed and parsed (``parallel.survey``,
       ``zero.reader``);
    2. every process that writes a part: ``advise``, then ``pread`` from several threads at once for the bytes its
       part reads; a backend with ``kernel_copies`` also hands out ``fd`` for copies that never reach user space;
    3. each storage group's leader, once every process agreed its part is written: ``flush`` of each staged temp,
       ``replace`` or ``merge_into`` in ``io.output.publish_order`` (what points at others last), ``flush`` of the
       folders; on a failure anywhere, ``remove`` of every temp instead;
    4. whoever made it: ``close``.
    """

    kernel_copies: bool  # its files may be copied kernel-side through a descriptor (``io.filecopy``)

    def list(self, prefix: Path) -> list[Entry]:
        """Regular files directly below ``prefix`` and one folder down, with their sizes."""

    def size(self, name: Path) -> int: ...

    def open(self, name: Path) -> BinaryIO:
        """A seekable, read-only stream (a zip's directory, a pickle, a JSON file)."""

    def pread(self, name: Path, nbytes: int, offset: int, into: Any = None) -> bytes | bytearray:
        """Exactly ``nbytes`` at ``offset`` (into ``into`` when given), or a ``CorruptFileError`` naming ``name``;
        safe to call from several threads at once (many reads in flight)."""

    def advise(self, name: Path, ranges: Iterable[tuple[int, int]]) -> None:
        """Ranges about to be read (read-ahead); a hint, may do nothing."""

    def create(self, name: Path) -> BinaryIO:
        """A stream writing ``name`` (a staged temp name: nothing is visible at the final name yet)."""

    def flush(self, name: Path, files: bool = True) -> None:
        """Make ``name`` durable: a file, or a folder's entries (with ``files``: everything below it too)."""

    def replace(self, temp: Path, final: Path) -> None:
        """Publish a staged file or folder under its final name, in one step a reader cannot see half done."""

    def merge_into(self, temp: Path, final: Path, order: Callable[[builtins.list[str]], builtins.list[str]] = sorted) -> None:
        """Publish a staged folder into an existing one entry by entry, in ``order`` (what points at others last)."""

    def remove(self, name: Path) -> None:
        """Delete a file or folder dsckpt wrote (absent is fine)."""

    def close(self) -> None: ...


class LocalStorage:
    """A POSIX file system (see the module docstring); one instance may be shared by threads."""

    kernel_copies = True  # its files may be copied kernel-side through ``fd`` (``io.filecopy``)

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    # reading
    def list(self, prefix: Path) -> list[Entry]:
        out = []
        for entry in sorted(os.scandir(prefix), key=lambda e: e.name):
            inner = sorted(os.scandir(entry.path), key=lambda e: e.name) if entry.is_dir() else [entry]
            out += [Entry(Path(e.path), e.stat().st_size) for e in inner if e.is_file()]
        return out

    def size(self, name: Path) -> int:
        return os.stat(name).st_size

    def open(self, name: Path) -> BinaryIO:
        return open(name, "rb")

    def fd(self, name: Path) -> int:
        """The shared read-only descriptor of ``name`` (the local fast path's handle)."""
        with self._lock:
            if name not in self._fds:
                self._fds[name] = os.open(name, os.O_RDONLY)
            return self._fds[name]

    def pread(self, name: Path, nbytes: int, offset: int, into: Any = None) -> bytes | bytearray:
        return pread_exact(self.fd(name), nbytes, offset, name, into)

    def advise(self, name: Path, ranges: Iterable[tuple[int, int]]) -> None:
        if not hasattr(os, "posix_fadvise"):
            return
        for offset, nbytes in ranges:
            try:
                os.posix_fadvise(self.fd(name), offset, nbytes, os.POSIX_FADV_WILLNEED)
            except OSError:  # advice only: a file system without it reads on demand
                return

    # writing and publishing
    def create(self, name: Path) -> BinaryIO:
        return open(name, "wb")

    def flush(self, name: Path, files: bool = True) -> None:
        """fsync a file, or a folder's entries (and with ``files`` everything below it: a reshard output's rank
        files sit in its tag folder)."""
        if files and name.is_dir() and not name.is_symlink():
            for entry in os.scandir(name):
                if entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False):
                    self.flush(Path(entry.path))
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, temp: Path, final: Path) -> None:
        os.replace(temp, final)

    def merge_into(self, temp: Path, final: Path, order: Callable[[builtins.list[str]], builtins.list[str]] = sorted) -> None:
        for name in order(os.listdir(temp)):
            self._replace_entry(temp / name, final / name)
        os.rmdir(temp)

    def swap_in(self, src: Path, dst: Path) -> None:
        """Folder ``src`` becomes ``dst``; an existing ``dst`` is replaced whole, never seen mixed or missing where
        the file system exchanges two names in one step (Linux ``renameat2``), else kept aside until ``src`` is in."""
        if not (dst.is_dir() and not dst.is_symlink()):
            os.replace(src, dst)
            return
        if _exchange(src, dst):
            self.remove(src)  # (now the old folder)
            return
        old = dst.with_name(f".{dst.name}{TEMP_MARK}{os.getpid()}-{os.urandom(4).hex()}")
        os.replace(dst, old)
        os.replace(src, dst)
        self.remove(old)

    def _replace_entry(self, src: Path, dst: Path) -> None:
        """A folder over a folder is swapped (``swap_in``)."""
        if src.is_dir() and dst.is_dir() and not dst.is_symlink():
            self.swap_in(src, dst)
        elif dst.is_dir() and not dst.is_symlink():
            raise OSError(f"{dst}: is a folder where dsckpt writes a file; nothing there was changed")
        else:
            os.replace(src, dst)

    def remove(self, name: Path) -> None:
        if name.is_dir() and not name.is_symlink():
            shutil.rmtree(name, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                name.unlink()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> "LocalStorage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_url(path: object) -> bool:
    """Whether ``path`` names objects in a store (``s3://``, ``gs://``, ``az://``...; any case) rather than a file."""
    return bool(URL_RE.match(str(path)))


def local_only(path: str | os.PathLike[str], refusal: Exception) -> Path:
    """``path`` for a verb that works on local files only; ``refusal`` raised where it names objects in a store."""
    if is_url(path):
        raise refusal
    return Path(path)


@dataclass(frozen=True)
class Alias:
    """Local folders standing for names the user typed (a bucket's local view, a folder of copies another host
    sent), as ``(local, given)`` pairs, the first that holds a name wins.  Applied to data only - an error's ``at``
    (``DsckptError.named``), a report's values (``renamed``) - never searched for in prose: a value is renamed
    when it is a local folder's path or starts with it followed by ``/``."""

    pairs: tuple[tuple[str, str], ...] = ()

    def __call__(self, name: object) -> object:
        text = os.fspath(name) if isinstance(name, os.PathLike) else name
        if not isinstance(text, str):
            return name
        for local, given in self.pairs:
            if text == local:
                return given
            if text.startswith(local + "/"):
                return given.rstrip("/") + text[len(local):]
        return name

    def renamed(self, doc: Any) -> Any:
        """A report (dicts, lists and scalars) with every value this alias holds renamed; keys stay."""
        if not self.pairs:
            return doc
        if isinstance(doc, dict):
            return {key: self.renamed(value) for key, value in doc.items()}
        if isinstance(doc, (list, tuple)):
            return [self.renamed(value) for value in doc]
        return self(doc)


SAME_NAMES = Alias()  # a path read as the user typed it


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing names in one step; False where the C library or the file system has no such rename."""
    import ctypes
    import ctypes.util
    import errno

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        rename = libc.renameat2
    except (OSError, AttributeError):
        return False
    if rename(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))
