"""The frame every writing verb (``consolidate``, ``reshard``, ``convert``, ``into_deepspeed``) runs its steps in,
at 1 or N processes.

1. ``destination``: where OUT is written - OUT itself, or for a URL a local staging folder, uploaded (what a reader
   looks for last) when the verb's block ends without error, its safetensors files and zips streamed to the store
   as they are written (``io.stream``); ``Destination.named`` gives the verb's result the URLs;
2. ``writing``: OUT's folder exists (before a distributed run makes its view there) and the input is a checkpoint,
   not a weights file (``paths.require_checkpoint``: the same verdict on every process); the view of the
   checkpoint (``parallel.view``: the checkpoint itself for one process);
3. the verb's own steps, which stage OUT through ``Frame.stage`` and write inside ``Frame.checked_reads`` with the
   ``WriteContext`` it yields (``io.context``: the one context every format, target, writer and reader gets);
4. on any error the staged output is abandoned; the view is closed either way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, TypeVar

from ..errors import InconsistentCheckpointError
from ..formats.storage import LocalStorage
from ..io.context import WriteContext
from ..io.integrity import NONFINITE_NOTE, SKIPPED_NOTE, Finiteness, Ledger, check_sources
from ..io.read import check_replicas
from ..io.output import check_parent
from ..parallel.group import Group
from ..parallel.outputs import GroupStaging
from ..formats.backends import storage_for
from ..formats.storage import LocalStorage
from ..parallel.view import View, build_view
from ..plan.segments import read_pieces
from ..progress import Progress, advancing
from .paths import require_checkpoint

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from ..io.multipart import Streams
    from ..io.upload import Upload

R = TypeVar("R", bound="DataclassInstance")  # a verb's result: a dataclass whose paths ``Destination.named`` rewrites


@dataclass
class Destination:
    """Where a writing verb writes OUT (see the module docstring)."""
    path: Path  # OUT, or the local staging folder of a URL OUT
    url: str | None = None
    streams: Streams | None = None  # where OUT's files stream (a URL OUT in a store that takes parts)
    files: tuple[str, ...] = ()  # a URL OUT's objects, once uploaded

    def named(self, result: R) -> R:
        """The verb's result naming what the user typed: the URLs instead of the staging folder's paths."""
        if self.url is None:
            return result
        changes: dict[str, object] = {"out": self.url, "files": self.files}
        if getattr(result, "client_state", None) is not None:
            changes["client_state"] = next((f for f in self.files if ".client_state." in f.rsplit("/", 1)[-1]), None)
        return dataclasses.replace(result, **changes)


@dataclass
class Frame:
    group: Group
    view: View
    streams: Streams | None = None
    staged: GroupStaging | None = None
    storage: LocalStorage = dataclasses.field(default_factory=LocalStorage)  # the checkpoint's, for every read

    def context(self, ledger: Ledger | None = None, progress: Progress | None = None) -> WriteContext:
        """The write's context (``io.context``): the frame's storage and streams, OUT's staged temp as durable."""
        durable = self.staged.durable if self.staged is not None else ()
        return WriteContext(self.storage, ledger, self.streams, durable, advancing(progress))

    @contextlib.contextmanager
    def checked_reads(self, pieces: Sequence[object], enabled: bool, replicas: tuple[Any, ...] = (),
                      progress: Progress | None = None,
                      masters: Sequence[object] = ()) -> Iterator[tuple[WriteContext, list[str]]]:
        """The CRC-32 check of every storage ``pieces`` touch, around the block that writes (``io.integrity``):
        each process notes what its write reads (the context yielded carries the ledger); after it, processes that
        see the same files pool their notes and each checks its share of the storages, reading only what nobody
        read.  Processes that see different files (hosts with node-local disks) each check the files they hold,
        before writing.  Tensor parallel: the ``replicas`` compared with the copies written first.  The
        ``masters`` (the fp32 masters' pieces) are scanned for NaN/Inf in the same bytes: a note when any is.
        Yields the write's context and the notes to report (the list is filled in after the block)."""
        if not enabled:
            yield self.context(progress=progress), [SKIPPED_NOTE]
            return
        pieces = list(pieces) + [p for r in replicas for p in read_pieces(r.source)]
        finite = Finiteness(masters)
        notes: list[str] = []
        if not (self.view.direct or self.view.shared):
            self.group.step(lambda: check_sources(pieces, self.view.owns, finite=finite))
            self.group.step(lambda: check_replicas(replicas, self.view.owns))
            self._agree_finite(finite, notes)
            yield self.context(progress=progress), notes
            return
        ledger = Ledger(finite)

        def replicas_agree() -> None:
            try:
                check_replicas(replicas, self.view.owns, ledger)
            except InconsistentCheckpointError:
                ledger.check(pieces)  # a damaged byte is the better answer, when it is one
                raise
        self.group.step(replicas_agree)
        yield self.context(ledger, progress), notes
        if self.group.size == 1:
            ledger.check(pieces)
        else:
            for rank, spans in enumerate(self.group.gather(ledger.spans(self.view.rel))):
                if rank != self.group.rank:
                    ledger.adopt(spans, self.view.path)
            self.group.step(lambda: ledger.check(pieces, share=(self.group.rank, self.group.size)))
        self._agree_finite(finite, notes)

    def _agree_finite(self, finite: Finiteness, notes: list[str]) -> None:
        """Every process's scan joined (each saw its share of the bytes): the same note everywhere."""
        if any(self.group.gather(finite.nonfinite) if self.group.size > 1 else [finite.nonfinite]):
            notes.append(NONFINITE_NOTE)

    def stage(self, staged: GroupStaging) -> GroupStaging:
        """Create OUT's temp (every process agrees) and abandon it if the verb fails."""
        self.staged = staged
        staged.create()
        return staged


@contextlib.contextmanager
def writing(group: Group, checkpoint: str | os.PathLike[str], tag: str | None, out: Destination,
            trust: bool) -> Iterator[Frame]:
    check_parent(out.path)
    group.step(lambda: require_checkpoint(checkpoint))
    frame = Frame(group, build_view(group, checkpoint, tag, out.path.parent, trust), out.streams)
    try:
        yield frame
    except BaseException:
        if frame.staged is not None:
            frame.staged.abort()
        raise
    finally:
        frame.view.close()
        frame.storage.close()


@contextlib.contextmanager
def destination(group: Group, out: str | os.PathLike[str], force: bool, stream: bool = True) -> Iterator[Destination]:
    """OUT for the verb's block (see the module docstring).  A URL: rank 0 refuses an existing OUT without ``force``
    before any work, the block writes into a local staging folder, and when it ends without error rank 0 uploads
    it (``io.upload``).  With ``stream`` (and a store that takes parts: ``io.parts``) the block's safetensors files
    and zips go to the store as they are written: every process's uploads are handed to rank 0, which completes
    them in that order; whatever no process completed is aborted."""
    if isinstance(storage_for(out), LocalStorage):
        yield Destination(Path(out))
        return
    url = str(out)
    from ..io.multipart import Streams  # (a bucket's modules, imported for one only)
    from ..io.parts import streamable
    from ..io.upload import Upload

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
        place = Destination(local, url, streams)
        yield place
        handed = group.gather(streams.handed_over() if streams else [])
        if upload and streams:
            streams.adopt([u for uploads in handed for u in uploads])
            upload.streams = streams
        place.files = tuple(group.broadcast(group.step(lambda: upload.publish() if upload else None), 0))
    finally:
        if streams:
            streams.close()  # (what no process completed: aborted)
        if upload:
            upload.close()
