"""What a reading command opens (``inspect``, ``diff``, ``verify``, ``check-finite``, ``load_state_dict``...): PATH
itself, or for a URL a local view of it (``parallel.view``), imported only then - a local read starts without the
view's, the transport's or the object store's modules.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, NamedTuple

from ..formats.backends import storage_for
from ..formats.storage import SAME_NAMES, Alias, LocalStorage
from ..plan.segments import Segment
from ..saves_in_flight import settle

if TYPE_CHECKING:
    from ..progress import Progress
    from .group import Group


class Readable(NamedTuple):
    """What ``readable`` hands a reader: the path and tag to open, and how to get the bytes of a plan's pieces
    (nothing to do for a local path), and the alias that names what it holds as the user typed it (a report's
    values: ``alias.renamed``)."""
    path: str
    tag: str | None
    fetch: Callable[[Iterable[object]], None]
    fetch_all: Callable[[], None]
    alias: Alias = SAME_NAMES


def _segments(pieces: Iterable[object]) -> Iterator[Segment]:
    """The byte ranges among ``pieces`` (``plan.segments.read_pieces`` of each tensor: a join's slices whole)."""
    return (piece for piece in pieces if isinstance(piece, Segment))


@contextlib.contextmanager
def readable(path: str | os.PathLike[str], tag: str | None, whole: bool = False, every_tag: bool = False,
             check: bool = True, progress: Progress | None = None) -> Iterator[Readable]:
    """What a reading command opens: PATH itself, or for a URL a local view of it - a checkpoint folder's objects
    or one file - holding what readers parse (every byte, fetched and CRC-checked, when ``whole``; a plan's pieces
    through ``fetch``); removed afterwards; errors name the URL.  ``check=False``: fetched without the CRC checks
    (``verify`` makes its own).  ``progress``: the fetch, a ``FETCH``."""
    settle()  # a save of this process still in flight (a bucket's objects too): read once it has finished
    if isinstance(storage_for(path), LocalStorage):
        yield Readable(str(path), tag, lambda pieces: None, lambda: None)
        return
    from ..io.remote import RemoteStore, scratch_folder
    from .group import ONE_PROCESS
    from .view import View, remote_view, write_skeletons, zip_storages

    path = str(path)
    scratch = scratch_folder(".dsckpt-read-")
    try:
        parent, name = path.rstrip("/").rsplit("/", 1)
        size = RemoteStore(path).object_size()
        if size is not None:  # one object (a consolidated file, a weights file) and its client-state sidecars
            store = RemoteStore(parent)
            sizes = {name: size, **store.starting_with(f"{name}.client_state.")}
            view = View(scratch, None, scratch, scratch, dict.fromkeys(sizes, 0), set(), 0, store)
        else:
            view = remote_view(ONE_PROCESS, path, tag, scratch, every_tag)
            sizes = {rel: view.path(rel).stat().st_size for rel in view.owners}
        storages = lambda rel: zip_storages(view.path(rel))  # noqa: E731

        def fetch_all() -> None:
            view.bucket.fill(view.root, [(rel, 0, n) for rel, n in sizes.items()], storages, check, progress=progress)

        def fetch(pieces: Iterable[object]) -> None:
            wanted = [(rel, p.offset, p.nbytes) for p in _segments(pieces) for rel in [view.rel(p.path)] if rel is not None]
            view.bucket.fill(view.root, wanted, storages, check)

        with view.real_names():
            if size is not None:
                write_skeletons(view.bucket, view, sizes)
            if whole:
                fetch_all()
            yield Readable(str(view.path(name) if size is not None else view.root),
                           tag if size is not None else view.tag, fetch, fetch_all, view.alias)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def local_copy(path: str | os.PathLike[str], group: "Group", progress: "Progress | None" = None) -> Iterator[Path]:
    """A source read whole by a converter (a DCP or universal folder, a weights file or folder): PATH itself, or a
    URL's objects in a scratch folder of this host, which the first of its processes fills (the bytes told to
    ``progress`` as a ``FETCH``); removed afterwards, also on failure."""
    source = storage_for(path)
    if isinstance(source, LocalStorage):
        yield Path(path)
        return
    from ..io.remote import scratch_folder

    url = str(path)
    scratch = group.broadcast(str(scratch_folder(".dsckpt-read-")) if group.rank == 0 else None, 0)
    local = Path(scratch) / url.rstrip("/").rsplit("/", 1)[-1]
    try:
        def get() -> None:
            Path(scratch).mkdir(parents=True, exist_ok=True)
            if not local.exists():
                source.fetch("", local, progress)
        for turn in range(group.size):  # one process at a time: the first on each host fetches, the others find it
            group.step(get if group.rank == turn else lambda: None)
        yield local
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
