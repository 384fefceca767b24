"""Safe output paths: refuse clobbering, never write over an input, write-to-temp then rename.

An interrupted or failed write leaves nothing at OUT: data goes to ``.<name>.dsckpt-tmp-<pid>-<id>``
in OUT's own folder and is renamed into place only when complete.  Temp files of processes that no
longer run are removed by the next run for the same OUT.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Iterable, Iterator

from .errors import OutputError

TEMP_MARK = ".dsckpt-tmp-"


def check_output(out: Path, inputs: Iterable[Path], force: bool) -> None:
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{out}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise OutputError(f"{out}: folder {parent} is not writable")
    resolved = out.resolve()
    for src in inputs:
        src = Path(src).resolve()
        if resolved == src or resolved in src.parents:
            raise OutputError(f"{out}: refusing to write over an input of this command ({src})")
    if out.exists() and not force:
        raise OutputError(f"{out}: already exists (use --force to replace it)")


def _temp_name(out: Path) -> Path:
    return out.parent / f".{out.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def clean_stale_temps(out: Path) -> list[Path]:
    """Remove temp files for ``out`` left by processes that are gone (kill -9, power loss)."""
    removed = []
    prefix = f".{out.name}{TEMP_MARK}"
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(out.parent if str(out.parent) else "."):
            if not entry.name.startswith(prefix):
                continue
            pid = entry.name[len(prefix):].split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                _remove(Path(entry.path))
                removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def fsync_path(path: Path, *, files: bool = True) -> None:
    """Flush a file, or a folder's entries (and, with ``files``, each file in it), to stable storage."""
    if files and path.is_dir() and not path.is_symlink():
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                fsync_path(Path(entry.path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(out: Path, *, directory: bool = False, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path beside ``out``; on success rename it to ``out``, on any error delete it.

    With ``fsync`` (trusted systems' rule: data durable before it is published) the temp output is
    flushed before the rename and the folder after it, so a power loss leaves the old OUT or the
    complete new one, never a renamed file whose data blocks were not written yet.
    """
    clean_stale_temps(out)
    tmp = _temp_name(out)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        if fsync:
            fsync_path(tmp)
        if directory and out.is_dir():
            old = _temp_name(out)
            os.replace(out, old)  # a directory cannot be replaced in one step; keep the old one until then
            os.replace(tmp, out)
            _remove(old)
        else:
            if out.is_dir():
                raise OutputError(f"{out}: is a directory; choose a file name or remove it")
            os.replace(tmp, out)
        if fsync:
            fsync_path(out.parent if str(out.parent) else Path("."))
    except BaseException:
        _remove(tmp)
        raise
