"""The one context a write runs in: made by the verb that writes (``api.frame``), handed down to every format,
conversion target, writer and reader of that write.  Nothing about a write lives in module state.

* ``storage`` - where the checkpoint's bytes are read (``formats.storage``: descriptors shared by threads).  A
  checkpoint in object storage still landing in its local view reads through ``io.remote.ArrivingStorage``,
  which waits for each range and offers no kernel-side copies.
* ``ledger`` - the CRC-32 of every source range read through user space is noted there, for the check after the
  write (``io.integrity``); None: nothing noted.
* ``streams`` - OUT goes to object storage while it is written (``io.stream``): which staged file streams to
  which key; None: every file is written locally.
* ``durable`` - the staged temps the commit will fsync: a writer filling a file under one starts its write-back
  as it goes (``io.writeback``).
* ``progress`` - told the bytes of each piece written (the verb's ``dsckpt.progress.Progress.advance``).

Call order: the verb makes the context once it knows OUT's staged temp (``Frame.context``); a block that changes
what reads see (a fill arriving from a bucket: ``parallel.transfer.fetching``) hands a ``replace``d copy down.
Whoever made ``storage`` closes it (``with WriteContext() as context`` for a context of one's own).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..formats.storage import LocalStorage
from . import writeback

if TYPE_CHECKING:
    from .integrity import Ledger
    from .multipart import Streams

Advance = Callable[[int], None]  # told the bytes of each piece done (``dsckpt.progress.Progress.advance``)


@dataclass(frozen=True)
class WriteContext:
    storage: LocalStorage = field(default_factory=LocalStorage)
    ledger: "Ledger | None" = None
    streams: "Streams | None" = None
    durable: tuple[Path, ...] = ()
    progress: Advance | None = None

    def stream_target(self, path: Path) -> "tuple[Streams, str] | None":
        """The streams and key the file staged at ``path`` goes to, or None: written locally."""
        if self.streams is None:
            return None
        key = self.streams.key(path)
        return None if key is None else (self.streams, key)

    def started(self, path: object, fd: int | None) -> writeback.Started:
        """What the writer of ``path`` (open as ``fd``) calls after each range it wrote (``io.writeback``)."""
        return writeback.for_output(path, fd, self.durable)

    def __enter__(self) -> "WriteContext":
        return self

    def __exit__(self, *exc: object) -> None:
        self.storage.close()
