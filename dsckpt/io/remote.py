"""Checkpoints in object storage (``s3://``, ``gs://``, ``az://``) read through a local view, over
``formats.bucket.BucketStorage`` (every call to the store goes through it).

Reading: a checkpoint in a bucket opens as a view (``parallel.view.View`` with a ``store``), the way a distributed
run sees files other hosts hold:
1. list: the objects under the URL, top level and one folder down, with their sizes (nothing outside the prefix
   is ever read);
2. skeleton: a sparse local file of each wanted object's size, holding what every reader parses - a small object
   whole; of a torch zip its directory, every entry's local header and the records that are not storages
   (ranged GETs, ``THREADS`` in flight);
3. fill: before a command writes, the storages its plan reads arrive in ``CHUNK`` ranged GETs, ``THREADS`` in
   flight, each storage checked against its zip CRC-32 as it lands (``transfer.fetch`` calls it), so a truncated
   or damaged object is a typed error naming its URL before anything is published.
Scratch disk: the bytes the command reads (sparse files, removed at the end); memory: ``THREADS`` x ``CHUNK``.

Writing to a URL: ``io.upload`` (a command's OUT) and ``checkpoint_engine.commit.BucketTarget`` (the engine's saves),
both publishing through ``BucketStorage``.
"""
from __future__ import annotations

import bisect
import builtins
import functools
import os
import threading
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from ..errors import CheckpointNotFoundError, CorruptFileError, Interrupted
from ..formats.bucket import BucketStorage
from ..formats.crc import crc32
from ..formats.positional import pwrite_all
from ..formats.storage import LocalStorage
from ..plan.deal import dealt
from ..plan.segments import joined_spans
from .skeleton import skeleton
from ..progress import Phase, Progress

CHUNK = 8 << 20
THREADS = 8
SCRATCH_ENV = "DSCKPT_SCRATCH"  # where the views and staged outputs of remote runs go (default: the temp folder)



def scratch_folder(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get(SCRATCH_ENV)))


class RemoteStore(BucketStorage):
    """The objects under one URL prefix (a checkpoint folder in a bucket), read into a local view."""

    def object_url(self, rel: str) -> str:
        return self.shown(rel)

    def objects(self) -> dict[str, int]:
        """Relative name -> size of the objects at the top level and one folder down (some, or an error)."""
        out = {entry.name.as_posix(): entry.size for entry in self.list()}
        if not out:
            raise CheckpointNotFoundError("no such object or prefix (nothing listed under it)", at=self.url)
        return out

    def read_many(self, jobs: Iterable[tuple[str, int, int]]) -> builtins.list[bytes]:
        jobs = list(jobs)
        with ThreadPoolExecutor(max(1, min(THREADS, len(jobs)))) as pool:
            return list(pool.map(lambda job: self.read(*job), jobs))

    # 2. skeleton
    def skeleton(self, rel: str, size: int) -> builtins.list[tuple[int, bytes]]:
        """The ranges of object ``rel`` a reader parses before any storage (``io.skeleton``'s rule, in ranged
        GETs: its first and last 64 KiB at once, then the entries' headers and records)."""
        return skeleton(lambda spans: self.read_many([(rel, start, end) for start, end in spans]), size)

    # 3. fill
    def fill(self, local_root: Path, ranges: builtins.list[tuple[str, int, int]], storages, check: bool = True,
             share: tuple[int, int] = (0, 1), everyone: builtins.list[builtins.list[tuple[str, int, int]]] | None = None,
             arrivals: "Arrivals | None" = None, progress: Progress | None = None) -> int:
        """Fetch ``ranges`` into the sparse files under ``local_root``: the storages they overlap whole and
        CRC-checked, any other range as it is; bytes fetched.  ``storages(rel)``: that file's ``StorageLocation``s.
        Process ``k`` of ``n`` (``share``; ``everyone``: every process's ranges) fetches whole the storages it is
        dealt among those any process reads, and of the others only its own ranges (their owner checks them).
        ``check=False`` (``verify``, which reports each damaged storage itself): no CRC check, a short object
        fetched as far as it goes.  ``arrivals``: told of each range as it lands (the files' ranges are fetched in
        offset order, all files abreast, so a streamed write's first parts can start early).  ``progress``: a ``FETCH``
        of this process's bytes, told each range landed (from the fetching threads, one at a time)."""
        storages = functools.cache(storages)  # (parses a zip's directory: once per file)

        def touched(wanted) -> dict[tuple[str, int], tuple[int, int]]:
            found = {}
            for rel, offset, nbytes in wanted:
                for loc in storages(rel):
                    if loc.offset < offset + nbytes and offset < loc.offset + loc.nbytes:
                        found[(rel, loc.offset)] = (loc.nbytes, loc.crc32)
            return found

        everything = touched(r for process in (everyone or [ranges]) for r in process)
        keys = sorted(everything)
        owners = dealt([everything[key][0] for key in keys], share[1])
        spans = {key: everything[key] for key, owner in zip(keys, owners) if owner == share[0]}  # (rel, start) -> (nbytes, crc): fetched whole, checked
        by_file: dict[str, list[tuple[int, int]]] = {}
        for (rel, start), (n, _) in everything.items():
            by_file.setdefault(rel, []).append((start, n))
        loose: dict[tuple[str, int], int] = {}  # ranges fetched as they are
        for rel, offset, nbytes in ranges:
            hit = [(start, n) for start, n in by_file.get(rel, ()) if start < offset + nbytes and offset < start + n]
            for start, n in hit:
                if (rel, start) not in spans:  # another process's storage: only this process's bytes of it
                    lo, hi = max(offset, start), min(offset + nbytes, start + n)
                    loose[(rel, lo)] = max(loose.get((rel, lo), 0), hi - lo)
            if not hit:
                loose[(rel, offset)] = max(loose.get((rel, offset), 0), nbytes)
        jobs: builtins.list[tuple[tuple[str, int] | None, str, int, int]] = [
            (key, key[0], key[1] + k, min(CHUNK, n - k)) for key, (n, _) in sorted(spans.items())
            for k in range(0, n, CHUNK)]
        jobs += [(None, rel, start + k, min(CHUNK, n - k)) for (rel, start), n in sorted(loose.items())
                 for k in range(0, n, CHUNK)]
        jobs.sort(key=lambda job: (job[2], job[1]))  # (each storage's chunks stay in order: their CRCs join in it)
        handles: dict[str, int] = {}
        told = threading.Lock()
        if progress is not None and jobs:
            progress.begin(Phase.FETCH, sum(job[3] for job in jobs))

        def one(job) -> tuple[Any, int, int]:
            key, rel, offset, n = job
            if arrivals is not None and arrivals.stopped:
                raise Interrupted
            data = self.read(rel, offset, offset + n, exact=check)
            pwrite_all(handles[rel], data, offset)
            if arrivals is not None:
                arrivals.landed(local_root / rel, offset, len(data))
            if progress is not None:
                with told:
                    progress.advance(len(data))
            return key, crc32(data), len(data)

        try:
            for rel in {job[1] for job in jobs}:
                handles[rel] = os.open(local_root / rel, os.O_WRONLY)
            with ThreadPoolExecutor(THREADS) as pool:
                results = list(pool.map(one, jobs))  # in order, THREADS in flight
        finally:
            for fd in handles.values():
                os.close(fd)
        from ..formats.crc import crc32_combine

        crcs: dict[tuple[str, int], int] = {}
        for key, part, n in results:
            if key is not None:
                crcs[key] = part if key not in crcs else crc32_combine(crcs[key], part, n)
        for (rel, start), (nbytes, crc) in spans.items():
            if check and crcs.get((rel, start), 0) != crc:
                raise CorruptFileError(f"the storage at byte {start:,} ({nbytes:,} bytes) "
                                       "fails its CRC-32 check: the object is damaged", at=self.object_url(rel))
        return sum(n for _, _, n in results)


class Arrivals:
    """The ranges of view files a fill running on another thread has landed; ``wait`` blocks until a range has
    (or raises what stopped the fill).  A range the fill never fetches is there once it is ``finish``ed."""

    def __init__(self) -> None:
        self._spans: dict[str, list[tuple[int, int]]] = {}
        self._cond = threading.Condition()
        self._finished = False
        self._error: BaseException | None = None
        self.stopped = False  # the reader gave up: the fill stops at its next chunk

    def landed(self, path: Path, offset: int, nbytes: int) -> None:
        with self._cond:
            self._spans[str(path)] = joined_spans(self._spans.get(str(path), []) + [(offset, offset + nbytes)])
            self._cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._finished, self._error = True, error
            self._cond.notify_all()

    def _there(self, path: str, offset: int, nbytes: int) -> bool:
        spans = self._spans.get(path, ())
        i = bisect.bisect_right(spans, (offset, float("inf"))) - 1
        return i >= 0 and spans[i][1] >= offset + nbytes

    def wait(self, path: Path, offset: int, nbytes: int) -> None:
        with self._cond:
            while not (self._finished or self._there(str(path), offset, nbytes)):
                self._cond.wait()
            if self._error is not None:
                raise self._error


class ArrivingStorage(LocalStorage):
    """A view's files while a fill lands them: each read first waits for its range (``Arrivals.wait``); no
    kernel-side copies (they would not wait)."""

    kernel_copies = False

    def __init__(self, arrivals: Arrivals) -> None:
        super().__init__()
        self.arrivals = arrivals

    def pread(self, name: Path, nbytes: int, offset: int, into: Any = None) -> bytes | bytearray:
        self.arrivals.wait(name, offset, nbytes)
        return super().pread(name, nbytes, offset, into)
