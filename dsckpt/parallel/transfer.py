"""Send each process the bytes it will read from files only other processes see (``view``).

``fetch(group, view, wanted)``: ``wanted`` is this process's list of byte ranges of view files (from the
plans of the outputs it writes).  Every process states its ranges of files it does not see; then all walk
one global list - receivers in rank order, their ranges in order, 16 MiB at a time - in which the owner
``send``s and the receiver ``recv``s and writes the bytes into its view file at the same offset.  Walking
one order with blocking point-to-point calls cannot deadlock: the first pending transfer in that order
always has both its ends waiting on it.  A failing read or write does not stop the walk (zeros are sent,
writes skipped); the error is raised after it, in ``Group.agree``, so no process is left waiting.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..formats.positional import pwrite_all
from ..io.context import WriteContext
from ..plan.segments import Segment, joined_spans
from ..progress import Progress
from .group import Group
from .view import Seen, View, zip_storages

CHUNK = 16 << 20


def merged_ranges(segments: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """(rel, offset, nbytes) ranges sorted, overlapping and adjacent ones joined (``plan.segments.joined_spans``)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for rel, offset, n in segments:
        if n:
            spans.setdefault(rel, []).append((offset, offset + n))
    return [(rel, start, end - start) for rel in sorted(spans) for start, end in joined_spans(spans[rel])]


def ranges_held_elsewhere(view: View, pieces: Iterable[object], whole_files: Iterable[Path] = ()) -> list[tuple[str, int, int]]:
    """The ranges of ``pieces`` (``Segment``s; anything else is ignored) and of ``whole_files`` that lie in
    files this process does not see."""
    if view.direct:
        return []
    found = []
    for piece in pieces:
        if isinstance(piece, Segment):
            rel = view.rel(piece.path)
            if rel is not None and rel not in view.local:
                found.append((rel, piece.offset, piece.nbytes))
    for path in whole_files:
        rel = view.rel(path)
        if rel is not None and rel not in view.local:
            found.append((rel, 0, view.path(rel).stat().st_size))
    return merged_ranges(found)


@contextlib.contextmanager
def fetching(group: Group, view: View, wanted: list[tuple[str, int, int]],
             context: WriteContext) -> Iterator[WriteContext]:
    """``fetch`` around a block, which writes with the context yielded; a checkpoint in object storage is filled on
    a thread while the block runs, and the block's reads wait for the ranges they need (``io.remote.ArrivingStorage``):
    a streamed write uploads its first parts while the rest arrive.  Only for blocks whose every read of the view
    goes through the yielded context's storage."""
    if view.seen is not Seen.BUCKET:
        fetch(group, view, wanted)
        yield context
        return
    store = view.bucket
    from ..io.remote import Arrivals, ArrivingStorage  # (a bucket's modules, imported for one only)

    everyone = group.gather(wanted)
    arrivals, failed = Arrivals(), []

    def fill() -> None:
        try:
            store.fill(view.root, wanted, lambda rel: zip_storages(view.path(rel)),
                       share=(group.rank, group.size), everyone=everyone, arrivals=arrivals)
        except BaseException as exc:  # (raised in the block by the read that waits for it, and agreed below)
            failed.append(exc)
        finally:
            arrivals.finish(failed[0] if failed else None)

    thread = threading.Thread(target=fill, name="dsckpt-fill", daemon=True)
    thread.start()
    try:
        with ArrivingStorage(arrivals) as storage:
            yield dataclasses.replace(context, storage=storage)
    except BaseException:
        arrivals.stopped = True
        raise
    finally:
        thread.join()

    def verdict() -> None:
        if failed:
            raise failed[0]
    group.step(verdict)


def fetch(group: Group, view: View, wanted: list[tuple[str, int, int]], progress: Progress | None = None) -> int:
    """Move every process's ``wanted`` ranges to it (see the module docstring); bytes received here.  A view of a
    checkpoint in object storage fetches them from there (``io.remote``; this process's share told to
    ``progress`` as a ``FETCH``)."""
    if view.seen is Seen.BUCKET:  # every process's ranges known to all: each storage is fetched and checked once
        everyone, store = group.gather(wanted), view.bucket
        return group.step(lambda: store.fill(view.root, wanted, lambda rel: zip_storages(view.path(rel)),
                                             share=(group.rank, group.size), everyone=everyone, progress=progress))
    if group.size == 1:
        return 0
    everyone = group.gather(wanted)
    if not any(everyone):  # every process sees every file (one host; always so under --nproc)
        return 0
    import torch
    import torch.distributed as dist

    from .transport import comm_errors

    received, error = 0, None
    buffer = torch.empty(CHUNK, dtype=torch.uint8)
    handles: dict[str, int] = {}
    try:
        for receiver, ranges in enumerate(everyone):
            for rel, offset, n in ranges:
                owner = view.owners[rel]
                for start in range(offset, offset + n, CHUNK):
                    size = min(CHUNK, offset + n - start)
                    chunk = buffer[:size]
                    if group.rank == owner:
                        error = error or _read_into(view.real / rel, start, chunk)
                        with comm_errors():
                            dist.send(chunk, receiver)
                    elif group.rank == receiver:
                        with comm_errors():
                            dist.recv(chunk, owner)
                        if error is None:
                            try:
                                fd = handles.get(rel) or handles.setdefault(rel, os.open(view.path(rel), os.O_WRONLY))
                                pwrite_all(fd, chunk.numpy(), start)
                                received += size
                            except OSError as exc:
                                error = exc
    finally:
        for fd in handles.values():
            os.close(fd)
    group.agree(error)
    return received


def _read_into(path: Path, offset: int, chunk: Any) -> OSError | None:
    try:
        with open(path, "rb") as fh:
            view = memoryview(chunk.numpy())
            got = os.preadv(fh.fileno(), [view], offset)
        if got != len(view):
            raise OSError(f"{path}: {got} of {len(view)} bytes at offset {offset} (truncated?)")
    except OSError as exc:
        chunk.zero_()
        return exc
    return None
