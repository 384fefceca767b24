"""Safe output paths: refuse clobbering, never write over an input, write-to-temp then rename.

An interrupted or failed write leaves nothing at OUT: data goes to ``.<name>.dsckpt-tmp-<pid>-<id>``
in OUT's own folder and is renamed into place only when complete; OUT and its sidecars are staged
together (``staged``) and published together.  Temp files of processes that no
longer run are removed by the next run for the same OUT.

A folder output that already exists (``--force``) is never removed: each entry dsckpt wrote is moved
into it by name, replacing only entries of the same name, and everything else there stays (a model
repo's ``.git/``, ``README.md``, other checkpoint tags), as ``save_pretrained`` writes beside them.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shlex
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import CorruptFileError, OutputError
from ..formats.safetensors_file import INDEX_SUFFIX
from ..formats.storage import TEMP_MARK, LocalStorage, Storage


def check_output(out: Path, inputs: Iterable[Path], force: bool, *, directory: bool = False,
                 tree: Path | None = None) -> None:
    """Refuse an OUT that cannot be written, would clobber, or would land in an input.

    ``directory``: OUT will be a folder (sharded output).  ``tree``: the checkpoint root, which OUT
    may not be inside (a file in a tag folder pollutes the checkpoint) nor be.
    """
    check_parent(out)
    resolved = out.resolve()
    inputs = [Path(src).resolve() for src in inputs]
    if resolved in inputs:
        raise OutputError("refusing to write over an input of this command", at=out)
    if tree is not None:
        root = tree.resolve()
        if resolved == root:
            raise OutputError("is the checkpoint folder itself; write the output elsewhere", at=out)
        if root in resolved.parents:
            raise OutputError(f"inside the checkpoint {tree}; write the output elsewhere", at=out)
    for src in inputs:
        if resolved in src.parents:
            raise OutputError(f"refusing to write over a folder holding an input of this command ({src})", at=out)
    if os.path.lexists(out):
        if not force:
            raise OutputError("already exists", hint="--force replaces it (force=True in the API)", at=out)
        if directory and not out.is_dir():
            raise OutputError("is a file, and a sharded output is a folder; choose another name", at=out)
        if not directory and out.is_dir():
            raise OutputError("is a directory; choose a file name or remove it", at=out)


def check_parent(out: Path) -> None:
    """OUT's folder exists and is writable (checked before anything - a distributed run's view - goes there)."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"folder {parent} does not exist",
                          hint=f"create it first (mkdir -p {shlex.quote(str(parent))}): a typo in OUT should not make "
                               "folders", at=out)
    if not os.access(parent, os.W_OK):
        raise OutputError(f"folder {parent} is not writable", at=out)


def _temp_name(out: Path) -> Path:
    return out.parent / f".{out.name}{TEMP_MARK}{os.getpid()}-{os.urandom(4).hex()}"


def clean_stale_temps(out: Path, keep: Path | None = None) -> list[Path]:
    """Remove temp files for ``out`` left by processes that are gone (kill -9, power loss); ``keep``: this run's."""
    prefix = f".{out.name}{TEMP_MARK}"
    removed = [p for p in dead_temps(out.parent if str(out.parent) else Path("."))
               if p.name.startswith(prefix) and (keep is None or p.name != keep.name)]
    for path in removed:
        remove_path(path)
    return removed


def dead_temps(folder: Path) -> list[Path]:
    """The temps in ``folder`` (``.<name>.dsckpt-tmp-<pid>-<id>``, files or folders) whose process is gone."""
    found = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(folder):
            if entry.name.startswith(".") and TEMP_MARK in entry.name:
                pid = entry.name.rsplit(TEMP_MARK, 1)[1].split("-")[0]
                if pid.isdigit() and not _alive(int(pid)):
                    found.append(Path(entry.path))
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


LOCAL = LocalStorage()  # outputs are written to local paths (the writers' kernel-side copies need them)


def remove_path(path: Path) -> None:
    """A file, link or folder, gone (already gone is fine)."""
    LOCAL.remove(path)


# What points at the rest, in the order it goes up last: indexes, `latest` / `latest_universal`, a DCP folder's
# `.metadata` - the one rule of every commit (a local folder merged entry by entry, a bucket's upload).
POINTERS = (re.compile(r"(^|/)[^/]*" + re.escape(INDEX_SUFFIX) + "$"), re.compile(r"^latest[^/]*$"),
            re.compile(r"^\.metadata$"))


def pointer_rank(name: str) -> int:
    """0 for data; for what points at data, 1 + its rule's place in ``POINTERS`` (``name``: relative to OUT)."""
    tail = name.split("/", 1)[-1]
    return next((i + 1 for i, rule in enumerate(POINTERS) if rule.search(tail)), 0)


def publish_order(names: list[str]) -> list[str]:
    """Data first, then what points at it (``POINTERS``), so a reader never sees a pointer name a missing file."""
    return sorted(names, key=lambda name: (pointer_rank(name), name))


def fsync_path(path: Path, *, files: bool = True) -> None:
    """Flush a file, or a folder's entries (with ``files``: everything below it too), to stable storage."""
    LOCAL.flush(path, files=files)


class Staging:
    """Outputs written to temp paths beside their destinations and published together: the one commit
    protocol, for one process (``staged``) and for each storage group's leader of a distributed run
    (``parallel.outputs.GroupStaging``, which agrees between the phases).

    ``temp_for(final)`` hands out a temp path; ``flush()`` flushes every temp (with ``fsync``);
    ``publish()`` renames each temp to its destination (a folder into an existing one: merged), the first
    one staged last (OUT after its sidecars), deletes the ``remove_on_commit`` paths, then flushes the
    folders.  ``abort()`` deletes every temp: nothing at a destination changes.
    """

    def __init__(self, fsync: bool = True, storage: Storage = LOCAL):
        self.fsync, self.storage = fsync, storage
        self._items: list[tuple[Path, Path, bool]] = []  # (temp, destination, is a directory)
        self._stale: list[Path] = []

    def temp_for(self, final: Path, directory: bool = False, tmp: Path | None = None) -> Path:
        """A temp path for ``final`` (a folder made for ``directory``), after the temps of dead processes are
        removed; ``tmp``: the name, chosen by the caller (a distributed run's, the same on every process)."""
        clean_stale_temps(final, keep=tmp)  # at any number of processes (a distributed run names its temp itself)
        if tmp is None:
            tmp = _temp_name(final)
        if directory:
            tmp.mkdir()
        self._items.append((tmp, final, directory))
        return tmp

    def remove_on_commit(self, paths: Iterable[Path]) -> None:
        self._stale.extend(paths)

    def flush(self) -> None:
        if self.fsync:
            for tmp, _, _ in self._items:
                self.storage.flush(tmp)

    def publish(self) -> None:
        for tmp, final, directory in reversed(self._items):
            if directory and final.is_dir() and not final.is_symlink():
                self.storage.merge_into(tmp, final, order=publish_order)
            else:
                self.storage.replace(tmp, final)
        for path in self._stale:  # after: what replaces them is in place first
            self.storage.remove(path)
        if self.fsync:
            folders = {final.parent if str(final.parent) else Path(".") for _, final, _ in self._items}
            folders |= {final for _, final, directory in self._items if directory}  # merged entries live there
            for folder in folders:
                self.storage.flush(folder, files=False)

    def abort(self) -> None:
        for tmp, _, _ in self._items:
            self.storage.remove(tmp)


@contextlib.contextmanager
def staged(fsync: bool = True) -> Iterator[Staging]:
    """A ``Staging`` that is flushed and published when the block succeeds, aborted when it raises."""
    stage = Staging(fsync)
    try:
        yield stage
        stage.flush()
        stage.publish()
    except BaseException:
        stage.abort()
        raise


@contextlib.contextmanager
def write_errors(out: Path) -> Iterator[None]:
    """A failing write (disk full, file too large, I/O error) is a typed error naming OUT; a failing read
    (the error names a file that is not one of our temps) names that input."""
    try:
        yield
    except OSError as exc:
        if exc.filename and TEMP_MARK not in Path(exc.filename).name:  # not ours: an input
            raise CorruptFileError(f"reading failed ({exc.strerror or exc}); nothing was left at {out}", at=exc.filename) from None
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
            raise OutputError(f"writing failed ({exc.strerror or exc}); nothing was left at OUT", at=out) from None
        raise OutputError(f"copying into OUT failed ({exc.strerror or exc}: a source or the destination); "
                          "nothing was left at OUT", at=out) from None
