"""The bytes of a file that every process needs to read its metadata - its skeleton - by one rule, whoever holds it.

A distributed run's view of files another host holds (``parallel.view``) and a bucket's view (``io.remote``) both
lay each file out as a sparse local file holding its skeleton.  ``skeleton(read_many, size)`` says which bytes,
given a reader of byte ranges (``os.pread`` on the host that holds the file, ranged GETs of an object):
1. a file up to ``SMALL``: whole;
2. else its first ``EDGE`` and last ``TAIL`` bytes together (one round trip).  Of a safetensors file, that is its
   JSON header.  Of a torch zip, the end records name the central directory, fetched whole when it starts earlier;
3. of a zip, each entry's local header (``HEADER_WINDOW``) and every record that is not a storage, nearby ranges
   in one request (``MERGE_GAP``).
A file that cannot be read this way gives the bytes at hand: its reader refuses it in its own words.
"""
from __future__ import annotations

import zipfile
from typing import Callable

from ..errors import CorruptFileError
from ..plan.segments import joined_spans

SMALL = 1 << 20  # read whole: `latest`, configs, trainer state
HEADER_WINDOW = 1024  # a zip local header, its name and torch's alignment padding fit in this
EDGE = 1 << 16  # the first bytes, fetched with the last: a zip's first records, a safetensors header
TAIL = 1 << 16  # the last bytes (a zip's directory and end records), fetched with the first
MERGE_GAP = 1 << 20  # skeleton ranges closer than this come in one request

ReadMany = Callable[[list[tuple[int, int]]], list[bytes]]  # [(start, end), ...] -> the bytes of each


def skeleton(read_many: ReadMany, size: int) -> list[tuple[int, bytes]]:
    """The file's skeleton as (offset, bytes) ranges (the module docstring's rule)."""
    if size <= SMALL:
        return [(0, read_many([(0, size)])[0])] if size else []
    tail_start = max(0, size - TAIL - 22)
    head, tail = read_many([(0, min(size, EDGE)), (tail_start, size)])
    if head[:4] != b"PK\x03\x04":
        header = 8 + int.from_bytes(head[:8], "little")  # a safetensors file: its JSON header
        if len(head) < header < min(size, 1 << 27):
            head += read_many([(len(head), header)])[0]
        return [(0, head)]  # (anything else: its reader refuses it in its own words)
    try:
        directory = _directory_offset(tail, tail_start)
        if directory < tail_start:  # a directory larger than the tail: the rest of it
            tail, tail_start = read_many([(directory, tail_start)])[0] + tail, directory
        entries = _entries(_Tail(tail, tail_start, size))
    except Exception:  # damaged or truncated: the bytes at hand, for the reader to refuse in its words
        return [(0, head), (tail_start, tail)]
    wanted = [(e.header_offset, min(size, e.header_offset + HEADER_WINDOW +
                                    (0 if "/data/" in e.filename else e.compress_size))) for e in entries]
    spans = [(start, end) for start, end in joined_spans(wanted, gap=MERGE_GAP)
             if not (end <= len(head) or start >= tail_start)]
    return [(0, head), (tail_start, tail)] + [(span[0], data) for span, data in zip(spans, read_many(spans))]


class _Tail:
    """A file-like over the last bytes of a file: what ``zipfile`` reads to list the entries."""

    def __init__(self, data: bytes, start: int, size: int):
        self.data, self.start, self.size, self.pos = data, start, size, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        if self.pos < self.start:
            raise CorruptFileError(f"zip structure at byte {self.pos:,}, before the directory")
        end = self.size if n < 0 else min(self.size, self.pos + n)
        out = self.data[self.pos - self.start:end - self.start]
        self.pos += len(out)
        return out


def _entries(tail: _Tail) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(tail) as zf:  # (a file-like over the tail)
        return zf.infolist()


def _directory_offset(tail: bytes, tail_start: int) -> int:
    """Where the zip's central directory starts, from its end record (zip64's when the plain one says so)."""
    end = tail.rfind(b"PK\x05\x06")
    if end < 0:
        raise CorruptFileError("no end-of-directory record in the file's last 64 KiB")
    offset = int.from_bytes(tail[end + 16:end + 20], "little")
    if offset != 0xFFFFFFFF:
        return offset
    locator = tail.rfind(b"PK\x06\x07", 0, end)
    record = int.from_bytes(tail[locator + 8:locator + 16], "little") - tail_start
    if locator < 0 or not 0 <= record < len(tail) - 56 or tail[record:record + 4] != b"PK\x06\x06":
        raise CorruptFileError("a zip64 end record outside the file's last 64 KiB")
    return int.from_bytes(tail[record + 48:record + 56], "little")
