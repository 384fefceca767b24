"""Integrity on every read: each zip storage a command reads is checked against the CRC-32 in its zip record.

A byte overwritten inside a rank file leaves the zip's structure intact; only the storage's CRC-32 tells.
Consolidation copies storages kernel to kernel and reshard streams them, so neither would notice on its own.
Two ways, one verdict (a ``CorruptFileError`` naming the file and the storage, before anything is published):
* ``check_sources(pieces)``: the storages the pieces overlap (a piece of a ZeRO-1/2 flat partition checks the whole
  partition), each read once more into a reused buffer and checksummed (``formats.crc``: ISA-L where installed),
  files on a few threads.  Before writing: a distributed run's processes check the files they hold this way.
* ``Ledger``: while a write runs, the one reader and the copies note there the CRC-32 of each range they pass
  through user space (the write's context names the ledger: ``io.context``); ``Ledger.check`` then joins those
  per storage (``crc32_combine``, in offset order) and reads only what nobody read (partition padding, ranges
  copied kernel to kernel).  Several processes that see the same files pool what they noted (``spans``/``adopt``)
  and share the storages out (``share``), so the checkpoint is checked once, not once per process, and mostly
  from CRCs the writes computed anyway.
``--skip-crc-check`` skips both (a note says so).

``Finiteness`` rides on the same bytes: the ranges it watches (the fp32 masters' pieces) are scanned for NaN/Inf
wherever the check or the write has them in user space, so a write of non-finite masters gets a note at no extra
read.  Elements are 4-byte aligned in the file (torch zips align each storage to 64 bytes), and every range noted
or read starts and ends on such a boundary.
"""
from __future__ import annotations

import bisect
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from ..errors import CorruptFileError
from ..formats.crc import crc32, crc32_combine
from ..formats.backends import storage_for
from ..formats.torchzip import StorageIndex, StorageLocation, is_torch_zip
from ..plan.deal import dealt
from ..plan.segments import Segment

BUFFER = 8 << 20
THREADS = 4
SKIPPED_NOTE = ("CRC-32 checks skipped (--skip-crc-check): a damaged byte in the checkpoint would go into the "
                "output unnoticed")


NONFINITE_NOTE = ("the fp32 masters hold non-finite values (NaN or Inf), and so does what was written: "
                  "`dsckpt check-finite` names the tensors; `dsckpt list` shows the run's other tags")


class Finiteness:
    """Whether any watched fp32 range held a NaN or Inf among the bytes ``scan`` was shown; safe from threads."""

    def __init__(self, watched: Iterable[object] = ()):
        spans: dict[str, list[tuple[int, int]]] = {}
        for piece in watched:
            if isinstance(piece, Segment) and piece.nbytes:
                spans.setdefault(os.fspath(piece.path), []).append((piece.offset, piece.nbytes))
        self._spans = {path: sorted(s) for path, s in spans.items()}  # (by the path's string: no Path per buffer)
        self._starts = {path: [o for o, _ in s] for path, s in self._spans.items()}
        self.nonfinite = False

    def scan(self, path: Path | str, offset: int, data) -> None:
        key = os.fspath(path)
        spans = self._spans.get(key)
        if not spans or self.nonfinite:
            return
        end = offset + len(data)
        i = max(0, bisect.bisect_right(self._starts[key], offset) - 1)
        for start, n in spans[i:]:
            if start >= end:
                break
            lo, hi = max(start, offset), min(start + n, end)
            lo += -lo % 4
            hi -= hi % 4
            if hi > lo and not _finite(data, lo - offset, (hi - lo) // 4):
                self.nonfinite = True
                return


SMALL_SCAN = 1 << 14  # elements checked in Python: a small checkpoint's command does not import numpy for them


def _finite(data, start: int, count: int) -> bool:
    """Whether ``count`` fp32 values at byte ``start`` of ``data`` are all finite."""
    if count < SMALL_SCAN:
        return all(map(math.isfinite, memoryview(data).cast("B")[start:start + 4 * count].cast("f")))
    import numpy as np

    values = np.frombuffer(data, dtype=np.float32, count=count, offset=start)
    with np.errstate(over="ignore", invalid="ignore"):  # a NaN or Inf makes the dot product one (one BLAS pass)
        square_sum = np.dot(values, values)
    return bool(np.isfinite(square_sum) or np.isfinite(values).all())  # (an overflow of finite values ruled out)


def check_sources(pieces: Iterable[object], reads: Callable[[Path], bool] = lambda path: True,
                  skip: bool = False, finite: Finiteness | None = None) -> tuple[str, ...]:
    """Check every storage the ``Segment``s among ``pieces`` overlap, in the files ``reads`` accepts (a distributed
    run: those this process holds); notes to print (the skip's).  ``finite``: shown every byte read."""
    if skip:
        return (SKIPPED_NOTE,)
    ranges: dict[Path, list[tuple[int, int]]] = {}
    for piece in pieces:
        if isinstance(piece, Segment) and reads(piece.path):
            ranges.setdefault(piece.path, []).append((piece.offset, piece.nbytes))
    failures = _run(ranges, stop_at_first=True, finite=finite)
    if failures:
        raise failures[0]
    return ()


class Ledger:
    """CRC-32s of source ranges as a write read them (see the module docstring); safe from several threads."""

    def __init__(self, finite: Finiteness | None = None) -> None:
        self._spans: dict[Path, list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()
        self.finite = finite or Finiteness()  # shown what is noted here and what the check reads

    def add(self, path: Path, offset: int, data, crc: int | None = None, scanned: bool = False) -> None:
        """``data`` read at ``offset`` of ``path`` (``crc``: its CRC-32, where the reader computed it already;
        ``scanned``: ``finite`` was shown it already)."""
        crc = crc32(data) if crc is None else crc
        if not scanned:
            self.finite.scan(path, offset, data)
        with self._lock:
            self._spans.setdefault(path if isinstance(path, Path) else Path(path), []).append((offset, len(data), crc))

    def spans(self, name: Callable[[Path], str | None]) -> dict[str, list[tuple[int, int, int]]]:
        """What was noted, by each file's ``name`` (a process's own paths differ from another's: its view's)."""
        with self._lock:
            return {key: list(spans) for path, spans in self._spans.items() if (key := name(path)) is not None}

    def adopt(self, spans: dict[str, list[tuple[int, int, int]]], path: Callable[[str], Path]) -> None:
        """Another process's ``spans``, under this process's ``path`` for each name."""
        with self._lock:
            for key, more in spans.items():
                self._spans.setdefault(path(key), []).extend(more)

    def check(self, pieces: Iterable[object], share: tuple[int, int] = (0, 1)) -> None:
        """Every storage the ``Segment``s among ``pieces`` overlap, from the noted CRCs and what is left to read.
        ``share=(k, n)``: only process ``k`` of ``n``'s part of those storages (the others check the rest)."""
        ranges: dict[Path, list[tuple[int, int]]] = {}
        for piece in pieces:
            if isinstance(piece, Segment):
                ranges.setdefault(piece.path, []).append((piece.offset, piece.nbytes))
        failures = _run(ranges, stop_at_first=True, noted=self._spans, share=share, finite=self.finite)
        if failures:
            raise failures[0]


def check_files(paths: Iterable[Path]) -> None:
    """Every storage of every torch zip in ``paths`` (a sharded resume's preflight)."""
    check_sources(_whole(paths))


def crc_failures(paths: Iterable[Path], progress: Callable[[int], None] | None = None) -> list[CorruptFileError]:
    """Every storage of every torch zip in ``paths`` checked; each one that fails (``dsckpt verify``).  ``progress``:
    told the bytes of each storage checked."""
    ranges: dict[Path, list[tuple[int, int]]] = {}
    for piece in _whole(paths):
        ranges.setdefault(piece.path, []).append((piece.offset, piece.nbytes))
    return _run(ranges, stop_at_first=False, progress=progress)


def _whole(paths: Iterable[Path]) -> list[Segment]:
    return [Segment(Path(p), 0, Path(p).stat().st_size) for p in paths]


def _run(ranges: dict[Path, list[tuple[int, int]]], stop_at_first: bool,
         noted: dict[Path, list[tuple[int, int, int]]] | None = None,
         share: tuple[int, int] = (0, 1), progress: Callable[[int], None] | None = None,
         finite: Finiteness | None = None) -> list[CorruptFileError]:
    work = [(path, loc, key, (noted or {}).get(path, ()), finite) for path, spans in sorted(ranges.items())
            if is_torch_zip(path) for key, loc in _overlapping(path, spans)]
    work = _share(work, *share)
    failures: list[CorruptFileError] = []
    with ThreadPoolExecutor(max(1, min(THREADS, len(work)))) as pool:
        for item, done in [(item, pool.submit(_check, *item)) for item in work]:
            try:
                done.result()
                if progress:
                    progress(item[1].nbytes)
            except CorruptFileError as exc:
                failures.append(exc)
                if stop_at_first:
                    break
    return failures


def _share(work: list, k: int, n: int) -> list:
    """Process ``k`` of ``n``'s storages (``plan.deal.dealt`` by bytes; every process computes the same split)."""
    if n == 1:
        return work
    work = sorted(work, key=lambda item: (str(item[0]), item[2]))
    return [item for item, owner in zip(work, dealt([item[1].nbytes for item in work], n)) if owner == k]


def _read_crc(storage, path: Path, offset: int, nbytes: int, crc: int, finite: Finiteness | None = None) -> int:
    """``crc`` extended over ``nbytes`` read at ``offset`` (a reused buffer), each buffer shown to ``finite``."""
    buffer = bytearray(min(BUFFER, nbytes))
    storage.advise(path, [(offset, nbytes)])
    done = 0
    while done < nbytes:
        n = min(len(buffer), nbytes - done)
        view = memoryview(buffer)[:n]
        storage.pread(path, n, offset + done, view)
        if finite is not None:
            finite.scan(path, offset + done, view)
        crc, done = crc32(view, crc), done + n
    return crc


def _overlapping(path: Path, spans: list[tuple[int, int]]) -> list[tuple[str, StorageLocation]]:
    spans = sorted(spans)
    out = []
    for key, loc in StorageIndex(path).storages.items():
        if loc.nbytes and any(o < loc.offset + loc.nbytes and loc.offset < o + n for o, n in spans):
            out.append((key, loc))
    return out


def _check(path: Path, loc: StorageLocation, key: str, noted=(), finite: Finiteness | None = None) -> None:
    """The storage's CRC: noted ranges inside it joined in offset order, the rest read (a range overlapping one
    already counted is left for the read)."""
    end = loc.offset + loc.nbytes
    crc, pos = 0, loc.offset
    with storage_for(path) as storage:
        for start, n, span_crc in sorted(s for s in noted if loc.offset <= s[0] and s[0] + s[1] <= end):
            if start < pos or not n:
                continue
            if start > pos:
                crc = _read_crc(storage, path, pos, start - pos, crc, finite)
            crc, pos = crc32_combine(crc, span_crc, n), start + n
        if pos < end:
            crc = _read_crc(storage, path, pos, end - pos, crc, finite)
    if crc != loc.crc32:
        raise CorruptFileError(f"storage {key!r} fails its CRC-32 check (data damaged)",
                               hint="restore this file from a copy; --skip-crc-check reads it anyway", at=path)
