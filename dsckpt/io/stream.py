"""Outputs written straight into object storage: multipart parts assembled from the plan, or as a zip is written.

A command whose OUT is an ``s3://``, ``gs://`` or ``az://`` URL (``io.parts``) stages OUT locally (``io.upload``),
but its safetensors files and torch zips are not written there: the write's context names the ``Streams``
(``io.context.WriteContext.streams``), ``io.safetensors_writer`` and ``io.torch_writer`` hand such files here, and the
staging folder keeps a placeholder under each name.  A safetensors file:
1. layout: the header, then each tensor's bytes at the offset the header gives; the file cut into parts of
   ``part_size`` bytes, numbered from its start (so the writers of one file each upload their own parts);
2. a part's bytes: the header's slice and each overlapping tensor's range cut from its pieces
   (``plan.segments.clip``), read through the one reader (casts, zero fills and CRC notes as for a local file);
   ``PARTS_IN_FLIGHT`` parts are assembled and uploaded at once: memory ``PARTS_IN_FLIGHT`` x (part + reader);
3. nothing is visible yet: the upload is only started.  ``Upload.publish`` completes it after every check passed,
   in the order a reader looks for files (an index, ``latest``, a single file's final key last); a failure anywhere
   aborts it (``abort``: the parts are dropped by the store).
A torch zip (a DCP data file too): ``ZipSink`` (its docstring), parts uploaded as the writer fills them.
Other files (small ones: ``latest``, sidecars, DCP's ``.metadata``; files copied whole) are staged whole and
uploaded after (``io.upload``).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..dtypes import ITEMSIZE
from ..plan.consolidate import TensorPlan
from ..plan.segments import TensorSource, clip
from .context import WriteContext
from .inflight import InFlight
from .multipart import PARTS_IN_FLIGHT, Pending, Streams, chunksize
from .read import Reader

MAX_PARTS = 10_000  # S3's limit per upload
READ_CHUNK = 1 << 20  # each part's reader: two such buffers


def part_size(total: int) -> int:
    """``chunksize()``, or larger (whole MiB) where the file needs more than MAX_PARTS of them."""
    size = chunksize()
    if total <= size * MAX_PARTS:
        return size
    need = -(-total // MAX_PARTS)
    return -(-need // (1 << 20)) << 20


def part_bytes(header: bytes, tensors: list[TensorPlan], offsets: list[int], lo: int, hi: int,
               context: WriteContext) -> bytearray:
    """The file's bytes ``[lo, hi)``: the header's slice, then each overlapping tensor's range, read and cast."""
    out = bytearray(header[lo:hi])
    base = len(header)
    with Reader(context, READ_CHUNK) as reader:
        for t, rel in zip(tensors, offsets):
            start, end = base + rel, base + rel + t.nbytes
            if end <= lo or start >= hi or not t.nbytes:
                continue
            a, b = max(lo, start) - start, min(hi, end) - start  # the tensor's output bytes wanted
            src_size, dst_size = ITEMSIZE[t.src_dtype], ITEMSIZE[t.dtype]
            first, last = a // dst_size, -(-b // dst_size)  # whole elements around them
            source = TensorSource(t.src_dtype, t.dtype, clip(t.pieces, first * src_size, (last - first) * src_size))
            skip, need = a - first * dst_size, b - a
            for chunk in reader.chunks(source):
                if skip >= len(chunk):
                    skip -= len(chunk)
                    continue
                piece = chunk[skip:skip + need]
                out += piece
                skip, need = 0, need - len(piece)
    return out


def stream_safetensors(context: WriteContext, streams: Streams, upload: Pending, header: bytes,
                       tensors: list[TensorPlan], offsets: list[int], parts: range | None = None) -> None:
    """Upload the file's parts (``parts``: part indexes from 0, default all), ``PARTS_IN_FLIGHT`` at once."""
    total = len(header) + sum(t.nbytes for t in tensors)
    size = part_size(total)
    count = max(1, -(-total // size))
    parts = range(count) if parts is None else parts

    def one(index: int) -> int:
        lo, hi = index * size, min(total, (index + 1) * size)
        streams.put(upload, index + 1, part_bytes(header, tensors, offsets, lo, hi, context))
        return max(0, hi - max(lo, len(header)))  # (progress counts tensor bytes)

    with ThreadPoolExecutor(PARTS_IN_FLIGHT) as pool:
        flying = InFlight(pool, PARTS_IN_FLIGHT, context.progress)
        try:
            for index in parts:
                flying.submit(one, index)
            flying.drain()
        finally:
            flying.cancel()


HEADER_SPAN = 1024  # a zip entry's local header (short names, alignment padding, zip64 extra) ends within this
TIER_PARTS = 1000  # a streamed zip's size is unknown up front: every 1,000 parts the part size doubles


def tiered_part(pos: int) -> tuple[int, int, int]:
    """(index, start, size) of the part of a zip streamed through ``ZipSink`` that holds byte ``pos``: 1,000 parts of
    ``chunksize()``, then 1,000 of twice that, ... (10,000 parts reach 1,000 times 8 GiB)."""
    size, start, index = chunksize(), 0, 0
    while pos >= start + TIER_PARTS * size:
        start, index, size = start + TIER_PARTS * size, index + TIER_PARTS, size * 2
    return index + (pos - start) // size, start + (pos - start) // size * size, size


class ZipSink:
    """A write-only, seekable file the zip writer (``io.torch_writer``) writes into, going up as parts of one
    multipart upload: a part is uploaded once written to its end, unless ``hold`` keeps it (zipfile seeks back to
    an entry's local header to write its CRC when the entry closes); ``release`` lets it go.  Everything but the
    storages' data (``mirror`` off while they stream) is also written at the same offsets into ``local``, a sparse
    placeholder of the final size, so that the run's own read-back of the structure works as on a local file.
    Memory: the parts being written, held or in flight (``PARTS_IN_FLIGHT`` at most)."""

    def __init__(self, streams: Streams, key: str, local: Path):
        self.streams, self.upload = streams, streams.start(key)
        self.local = open(local, "wb")
        self.pos = self.end = 0
        self.mirror = True
        self._parts: dict[int, tuple[int, bytearray, list[int]]] = {}  # index -> (start, buffer, [bytes written])
        self._holds: list[int] = []
        self._pool = ThreadPoolExecutor(PARTS_IN_FLIGHT)
        self._flying = InFlight(self._pool, PARTS_IN_FLIGHT)

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.end + pos}[whence]
        return self.pos

    def flush(self) -> None:
        pass

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.mirror:
            self.local.seek(self.pos)
            self.local.write(view)
        done = 0
        while done < len(view):
            index, start, size = tiered_part(self.pos + done)
            if index not in self._parts:
                if start < self.end:  # (begun before, so uploaded: a seek back that no hold covered)
                    raise OSError(f"a streamed zip rewrote byte {self.pos + done:,} after its part went up")
                self._parts[index] = (start, bytearray(size), [0])
            _, buffer, written = self._parts[index]
            at = self.pos + done - start
            n = min(len(view) - done, size - at)
            buffer[at:at + n] = view[done:done + n]
            written[0] = max(written[0], at + n)
            done += n
        self.pos += done
        self.end = max(self.end, self.pos)
        self._send(final=False)
        return done

    def hold(self, pos: int) -> None:
        self._holds.append(pos)

    def release(self, pos: int) -> None:
        self._holds.remove(pos)
        self._send(final=False)

    def _send(self, final: bool) -> None:
        """Upload each part written to its end (every part left, when ``final``) that no hold keeps."""
        held = {index for pos in self._holds
                for index in range(tiered_part(pos)[0], tiered_part(pos + HEADER_SPAN)[0] + 1)}
        for index in sorted(self._parts):
            start, buffer, written = self._parts[index]
            if index in held or not (final or written[0] == len(buffer)):
                continue
            del self._parts[index]
            del buffer[written[0]:]  # (the last part: as long as it is)
            self._flying.submit(self.streams.put, self.upload, index + 1, buffer)

    def close(self) -> None:
        """Every part up (the last one as long as it is); the placeholder at the zip's size."""
        try:
            self._send(final=True)
            self._flying.drain()
            self.local.truncate(self.end)
        finally:
            self._pool.shutdown(cancel_futures=True)
            self.local.close()

    def __enter__(self) -> "ZipSink":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.close()
        else:  # (the upload is aborted with the run's others: Streams.close)
            self._pool.shutdown(cancel_futures=True)
            self.local.close()


def part_count(total: int) -> int:
    return max(1, -(-total // part_size(total)))


def my_parts(total: int, k: int, n: int) -> range:
    """Writer ``k`` of ``n``'s parts of a file: a contiguous run (its reads stay in order)."""
    count = part_count(total)
    return range(k * count // n, (k + 1) * count // n)


def tensors_in(header: bytes, tensors: list[TensorPlan], offsets: list[int], parts: range) -> list[TensorPlan]:
    """The tensors whose bytes lie (partly) in ``parts``: what their writer reads."""
    total = len(header) + sum(t.nbytes for t in tensors)
    size = part_size(total)
    lo, hi = parts.start * size, min(total, parts.stop * size)
    return [t for t, rel in zip(tensors, offsets) if len(header) + rel < hi and lo < len(header) + rel + t.nbytes]
