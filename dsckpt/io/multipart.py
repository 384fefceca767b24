"""The multipart uploads one output streams to object storage: which staged file becomes which object (``Streams``),
the uploads started and not yet completed (``Pending``), and the part size (``chunksize``).

Kept apart from the writers (``io.stream``) so that the write's context (``io.context``) can name its ``Streams``
without importing a reader.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..errors import Interrupted
from ..formats.storage import TEMP_MARK
from .parts import BACKENDS
from ..formats.bucket import filesystem

PART = 8 << 20
PART_ENV = "DSCKPT_MULTIPART_CHUNKSIZE"  # bytes per part (aws s3's multipart_chunksize; S3 takes 5 MiB or more)
PARTS_IN_FLIGHT = 8


def chunksize() -> int:
    return int(os.environ.get(PART_ENV) or PART)


@contextlib.contextmanager
def signals_deferred() -> Iterator[Callable[[], None]]:
    """Ctrl-C (SIGINT, SIGTERM) in the block lands after it (``Interrupted``; in the block: the ``stop()`` it yields):
    a request in flight on fsspec's own thread would otherwise finish after the clean-up that should undo it."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}

    def stop() -> None:
        if caught:
            raise Interrupted

    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stop()


@dataclass
class Pending:
    """One started multipart upload: its key, id, and the ETag of each part uploaded so far."""
    key: str
    upload_id: str
    parts: dict[int, str] = field(default_factory=dict)


class Streams:
    """Where this process streams the safetensors files and zips a run stages under ``local`` (OUT's staging
    path), and the uploads it started that nobody completed yet (aborted by ``close``)."""

    def __init__(self, url: str, local: Path):
        self.fs, root = filesystem(url)
        self.parts = BACKENDS[url.split("://", 1)[0].lower()](self.fs)
        self.parent = root.rstrip("/").rsplit("/", 1)[0]
        self.scratch = local.parent
        self.pending: dict[str, Pending] = {}
        self._lock = threading.Lock()

    def key(self, path: Path) -> str | None:
        """The object a staged file becomes once published (its temp names undone), None outside the staging."""
        try:
            rel = Path(path).relative_to(self.scratch)
        except ValueError:
            return None
        parts = [p[1:p.index(TEMP_MARK)] if TEMP_MARK in p else p for p in rel.parts]
        return "/".join([self.parent, *parts])

    def start(self, key: str) -> Pending:
        with signals_deferred():  # an upload the store started is known here before Ctrl-C can land
            upload = Pending(key, self.parts.start(key))
            with self._lock:
                self.pending[key] = upload
        return upload

    def join(self, key: str, upload_id: str) -> Pending:
        """An upload another process started (this process uploads some of its parts)."""
        with self._lock:
            return self.pending.setdefault(key, Pending(key, upload_id))

    def put(self, upload: Pending, number: int, data: bytearray) -> None:
        etag = self.parts.put(upload.key, upload.upload_id, number, data)
        with self._lock:
            upload.parts[number] = etag

    def adopt(self, uploads: list[Pending]) -> None:
        """Another process's uploads (its parts of one file joined): completed or aborted from here."""
        for upload in uploads:
            mine = self.pending.setdefault(upload.key, Pending(upload.key, upload.upload_id))
            mine.parts.update(upload.parts)

    def handed_over(self) -> list[Pending]:
        """This process's uploads, given to the process that completes them (no longer aborted here)."""
        with self._lock:
            out, self.pending = list(self.pending.values()), {}
        return out

    def complete(self, key: str) -> None:
        upload = self.pending.pop(key)
        self.parts.complete(key, upload.upload_id, upload.parts)

    def close(self) -> None:
        """Abort every upload not completed (best effort: the error that brought us here is the one to report)."""
        for upload in self.handed_over():
            with contextlib.suppress(Exception):
                self.parts.abort(upload.key, upload.upload_id)
