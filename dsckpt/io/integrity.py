"""Integrity on every read: each zip storage a command reads is checked against the CRC-32 in its zip record.

A byte overwritten inside a rank file leaves the zip's structure intact; only the storage's CRC-32 tells.
Consolidation copies storages kernel to kernel and reshard streams them, so neither would notice on its own.
``check_sources(pieces)`` runs before anything is published:
1. the storages the pieces overlap, per file (a piece of a ZeRO-1/2 flat partition checks the whole partition);
2. each storage read once into a reused buffer and checksummed (``formats.crc``: ISA-L where installed), files
   on a few threads (``pread`` and the CRC release the GIL);
3. the first mismatch is a ``CorruptFileError`` naming the file and the storage.
``skip=True`` (``--skip-crc-check``) returns a note to print instead: the cost is one more read of those bytes
(docs/performance.md).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from ..errors import CorruptFileError
from ..formats.crc import crc32
from ..formats.storage import storage_for
from ..formats.torchzip import StorageLocation, TorchFile, is_torch_zip
from ..plan.segments import Segment

BUFFER = 8 << 20
THREADS = 4
SKIPPED_NOTE = ("CRC-32 checks skipped (--skip-crc-check): a damaged byte in the checkpoint would go into the "
                "output unnoticed")


def check_sources(pieces: Iterable[object], reads: Callable[[Path], bool] = lambda path: True,
                  skip: bool = False) -> tuple[str, ...]:
    """Check every storage the ``Segment``s among ``pieces`` overlap, in the files ``reads`` accepts (a distributed
    run: those this process holds); notes to print (the skip's)."""
    if skip:
        return (SKIPPED_NOTE,)
    ranges: dict[Path, list[tuple[int, int]]] = {}
    for piece in pieces:
        if isinstance(piece, Segment) and reads(piece.path):
            ranges.setdefault(piece.path, []).append((piece.offset, piece.nbytes))
    failures = _run(ranges, stop_at_first=True)
    if failures:
        raise failures[0]
    return ()


def check_files(paths: Iterable[Path]) -> None:
    """Every storage of every torch zip in ``paths`` (a sharded resume's preflight)."""
    check_sources(_whole(paths))


def crc_failures(paths: Iterable[Path]) -> list[CorruptFileError]:
    """Every storage of every torch zip in ``paths`` checked; each one that fails (``dsckpt verify``)."""
    ranges: dict[Path, list[tuple[int, int]]] = {}
    for piece in _whole(paths):
        ranges.setdefault(piece.path, []).append((piece.offset, piece.nbytes))
    return _run(ranges, stop_at_first=False)


def _whole(paths: Iterable[Path]) -> list[Segment]:
    return [Segment(Path(p), 0, Path(p).stat().st_size) for p in paths]


def _run(ranges: dict[Path, list[tuple[int, int]]], stop_at_first: bool) -> list[CorruptFileError]:
    work = [(path, loc, key) for path, spans in ranges.items() if is_torch_zip(path)
            for key, loc in _overlapping(path, spans)]
    failures: list[CorruptFileError] = []
    with ThreadPoolExecutor(max(1, min(THREADS, len(work)))) as pool:
        for done in [pool.submit(_check, *item) for item in work]:
            try:
                done.result()
            except CorruptFileError as exc:
                failures.append(exc)
                if stop_at_first:
                    break
    return failures


def _overlapping(path: Path, spans: list[tuple[int, int]]) -> list[tuple[str, StorageLocation]]:
    spans = sorted(spans)
    out = []
    for key, loc in TorchFile(path).storages.items():
        if loc.nbytes and any(o < loc.offset + loc.nbytes and loc.offset < o + n for o, n in spans):
            out.append((key, loc))
    return out


def _check(path: Path, loc: StorageLocation, key: str) -> None:
    buffer = bytearray(min(BUFFER, loc.nbytes))
    with storage_for(path) as storage:
        storage.advise(path, [(loc.offset, loc.nbytes)])
        crc, pos = 0, 0
        while pos < loc.nbytes:
            n = min(len(buffer), loc.nbytes - pos)
            view = memoryview(buffer)[:n]
            storage.pread(path, n, loc.offset + pos, view)
            crc, pos = crc32(view, crc), pos + n
    if crc != loc.crc32:
        raise CorruptFileError(f"{path}: storage {key!r} fails its CRC-32 check (data damaged)",
                               hint="restore this file from a copy; --skip-crc-check reads it anyway")
