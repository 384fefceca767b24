"""The frame every writing verb (``consolidate``, ``reshard``, ``convert``) runs its steps in, at 1 or N processes.

1. OUT's folder exists (before a distributed run makes its view there) and the input is a checkpoint, not a
   weights file (``paths.require_checkpoint``: the same verdict on every process);
2. the view of the checkpoint (``parallel.view``: the checkpoint itself for one process);
3. the verb's own steps, which stage OUT through ``Frame.stage`` and write inside ``Frame.checked_reads``;
4. on any error the staged output is abandoned; the view is closed either way.
A checkpoint in object storage is a view like any other; an OUT in object storage is staged and uploaded around
the verb, its safetensors files streamed to the store as they are written (``uploading``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from ..errors import InconsistentCheckpointError
from ..io.integrity import SKIPPED_NOTE, Ledger, check_sources, recording
from ..io.read import check_replicas
from ..io.output import check_parent
from ..parallel.group import Group
from ..parallel.outputs import Staged
from ..io.remote import is_url
from ..io.parts import streamable
from ..io.stream import Streams, streaming
from ..io.upload import Upload
from ..parallel.view import View, build_view
from .paths import require_checkpoint

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

R = TypeVar("R", bound="DataclassInstance")  # a verb's result: a dataclass whose paths ``uploading`` rewrites


@dataclass
class Frame:
    group: Group
    view: View
    staged: Staged | None = None

    @contextlib.contextmanager
    def checked_reads(self, pieces: list, enabled: bool, replicas: tuple = ()) -> Iterator[list[str]]:
        """The CRC-32 check of every storage ``pieces`` touch, around the block that writes (``io.integrity``):
        each process notes what its write reads; after it, processes that see the same files pool their notes and
        each checks its share of the storages, reading only what nobody read.  Processes that see different files
        (hosts with node-local disks) each check the files they hold, before writing.  Tensor parallel: the
        ``replicas`` compared with the copies written first.  Yields the notes to report."""
        if not enabled:
            yield [SKIPPED_NOTE]
            return
        pieces = list(pieces) + [p for r in replicas for p in r.source.pieces]
        if not (self.view.direct or self.view.shared):
            self.group.step(lambda: check_sources(pieces, self.view.owns))
            self.group.step(lambda: check_replicas(replicas, self.view.owns))
            yield []
            return
        ledger = Ledger()

        def replicas_agree() -> None:
            try:
                check_replicas(replicas, self.view.owns)
            except InconsistentCheckpointError:
                ledger.check(pieces)  # a damaged byte is the better answer, when it is one
                raise
        with recording(ledger):
            self.group.step(replicas_agree)
            yield []
        if self.group.size == 1:
            ledger.check(pieces)
            return
        for rank, spans in enumerate(self.group.gather(ledger.spans(self.view.rel))):
            if rank != self.group.rank:
                ledger.adopt(spans, self.view.path)
        self.group.step(lambda: ledger.check(pieces, share=(self.group.rank, self.group.size)))

    def stage(self, staged: Staged) -> Staged:
        """Create OUT's temp (every process agrees) and abandon it if the verb fails."""
        self.staged = staged
        staged.create()
        return staged


@contextlib.contextmanager
def writing(group: Group, checkpoint: str | os.PathLike, tag: str | None, out: Path, trust: bool) -> Iterator[Frame]:
    check_parent(out)
    group.step(lambda: require_checkpoint(checkpoint))
    frame = Frame(group, build_view(group, str(checkpoint) if is_url(checkpoint) else Path(checkpoint), tag, out.parent,
                                    trust))
    try:
        yield frame
    except BaseException:
        if frame.staged is not None:
            frame.staged.abort()
        raise
    finally:
        frame.view.close()


def uploading(group: Group, url: str, force: bool, run: Callable[[Path], R], stream: bool = True) -> R:
    """A verb whose OUT is a URL (``io.upload``): ``run(local)`` publishes into a staging folder as it would locally,
    then rank 0 uploads it (what a reader looks for last) and the result names the URLs.  With ``stream`` (and a
    store that takes parts: ``io.parts``) its safetensors files and zips go to the store as they are written
    (``io.stream``): every process's uploads are handed to rank 0, which completes them in that order."""
    def start() -> Upload | None:
        if group.rank != 0:
            return None
        upload = Upload(url, force)
        try:
            upload.check()  # an existing OUT without --force: before any work
        except BaseException:
            upload.close()
            raise
        return upload

    upload = group.step(start)
    streams: Streams | None = None
    try:
        local = Path(group.broadcast(str(upload.local) if upload else None, 0))
        local.parent.mkdir(parents=True, exist_ok=True)  # (another host's processes do not write; the folder is there)
        streams = Streams(url, local) if stream and streamable(url) else None
        with streaming(streams) if streams else contextlib.nullcontext():
            result = run(local)
        handed = group.gather(streams.handed_over() if streams else [])
        if upload and streams:
            streams.adopt([u for uploads in handed for u in uploads])
            upload.streams = streams
        files = group.broadcast(group.step(lambda: upload.publish() if upload else None), 0)
    finally:
        if streams:
            streams.close()  # (what no process completed: aborted)
        if upload:
            upload.close()
    changes: dict = {"out": url, "files": tuple(files)}
    if getattr(result, "client_state", None) is not None:
        changes["client_state"] = next((f for f in files if ".client_state." in f.rsplit("/", 1)[-1]), None)
    return dataclasses.replace(result, **changes)
