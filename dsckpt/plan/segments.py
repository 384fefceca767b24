"""Where a tensor's bytes are: the one byte-source model every plan produces and every writer reads.

A tensor is a list of segments - ``Segment(path, offset, nbytes)`` of a file, or ``Zeros(nbytes)`` of
padding - in a source dtype, cast to an output dtype when read (``TensorSource``).  Consolidating a ZeRO-3
parameter is one segment per rank; a ZeRO-1/2 parameter one per partition it spans; a reshard target
partition is segments of the ranks that held its elements plus zero fills; an unchanged tensor is its
storage's byte range.  Writers never ask which kind of source they hold: ``io.read`` turns any of them
into chunks of output bytes.

A tensor joined from tensor-parallel slices along a later dimension (a row-parallel weight: each row is a run
of every slice in turn) is an ``Interleaved`` sequence: the periodic pattern is stored, and the segments are
made as a reader walks it, so a 7B model's rows never sit in memory as a list.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Protocol, Sequence

from ..dtypes import ITEMSIZE
from ..errors import InconsistentCheckpointError
from ..formats.pickle_policy import TensorRef
from ..formats.pickle_tree import tensor_refs
from ..formats.pickle_writer import NewTensor, StorageOut
from ..formats.torchzip import tensor_byte_range


class Segment(NamedTuple):
    """``nbytes`` bytes at absolute ``offset`` of ``path`` (a NamedTuple: ``path, offset, n = seg`` reads it)."""
    path: Path
    offset: int
    nbytes: int


class Zeros(NamedTuple):
    """``nbytes`` zero bytes (partition padding)."""
    nbytes: int


Piece = Segment | Zeros


class ByteSource(Protocol):
    """What a writer needs from a tensor: its segments, in ``src_dtype``, written as ``dtype``."""
    @property
    def src_dtype(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def pieces(self) -> "tuple[Piece, ...] | Interleaved": ...


class Window:
    """Byte ranges of a piece sequence, cut out as pieces (a slice's rows within its ZeRO partitions)."""

    def __init__(self, pieces: Sequence[Piece]):
        self.pieces = tuple(pieces)
        self.starts = [0, *accumulate(p.nbytes for p in self.pieces)]

    @property
    def nbytes(self) -> int:
        return self.starts[-1]

    def cut(self, start: int, nbytes: int) -> Iterator[Piece]:
        i = bisect.bisect_right(self.starts, start) - 1
        end = start + nbytes
        while start < end:
            piece, lo = self.pieces[i], start - self.starts[i]
            n = min(piece.nbytes - lo, end - start)
            yield Zeros(n) if isinstance(piece, Zeros) else Segment(piece.path, piece.offset + lo, n)
            start += n
            i += 1


class Interleaved:
    """Pieces joined by a periodic pattern: for each of ``count`` periods, each block ``(part, start, nbytes)`` -
    ``nbytes`` of ``parts[part]`` at ``start + period * periods[part]``.  Iterating yields the segments in order."""

    __slots__ = ("parts", "blocks", "periods", "count")

    def __init__(self, parts: Sequence[Sequence[Piece]], blocks: Sequence[tuple[int, int, int]],
                 periods: Sequence[int], count: int):
        self.parts = tuple(Window(p) for p in parts)
        self.blocks, self.periods, self.count = tuple(blocks), tuple(periods), count
        for part, start, n in self.blocks:
            if (count - 1) * self.periods[part] + start + n > self.parts[part].nbytes:
                raise InconsistentCheckpointError(f"a joined tensor needs {count} periods of {self.periods[part]} bytes "
                                                  f"from a slice of {self.parts[part].nbytes} bytes")

    @property
    def sources(self) -> tuple[Piece, ...]:
        """Every piece of every part (what the joined tensor reads, in no particular order): for read-ahead."""
        return tuple(p for part in self.parts for p in part.pieces)

    def __iter__(self) -> Iterator[Piece]:
        whole = [part.pieces[0] if len(part.pieces) == 1 and isinstance(part.pieces[0], Segment) else None
                 for part in self.parts]
        for i in range(self.count):
            for part, start, n in self.blocks:
                at = i * self.periods[part] + start
                one = whole[part]
                if one is not None:  # the slice is one byte range: no search (a ZeRO-1/2 slice within one partition)
                    yield Segment(one.path, one.offset + at, n)
                else:
                    yield from self.parts[part].cut(at, n)


class Pieced(Protocol):
    """Anything made of pieces (a ``ByteSource``, an analysis ``Source``)."""
    @property
    def pieces(self) -> "Sequence[Piece] | Interleaved": ...


def read_pieces(source: Pieced) -> tuple[Piece, ...]:
    """The pieces ``source`` reads, for checks and fetches: a row-parallel join's slices whole (every byte of them is
    read), not its rows one by one."""
    pieces = source.pieces
    return pieces.sources if isinstance(pieces, Interleaved) else tuple(pieces)


@dataclass(frozen=True)
class TensorSource:
    """A nameless tensor's bytes (a reshard partition, an unchanged storage): segments + cast."""
    src_dtype: str
    dtype: str
    pieces: tuple[Piece, ...]


def ref_segments(ref: TensorRef) -> tuple[Segment, ...]:
    """A stored tensor's elements as one byte range (none for an empty tensor)."""
    path, offset, nbytes = tensor_byte_range(ref)
    return (Segment(path, offset, nbytes),) if nbytes else ()


def tree_pieces(tree: object) -> list[Piece]:
    """The byte pieces of every tensor in a parsed tree (a client state's tensors, as stored)."""
    return [piece for ref in tensor_refs(tree) for piece in ref_segments(ref)]


def planned_pieces(tree: object) -> list[Piece]:
    """Every byte piece a planned file's tree reads: its stored tensors' ranges and its new tensors' sources (a
    reshard plan's partitions)."""
    if isinstance(tree, NewTensor):
        return list(read_pieces(tree.source))
    if isinstance(tree, TensorRef):
        return list(ref_segments(tree))
    if isinstance(tree, dict):
        return [piece for value in tree.values() for piece in planned_pieces(value)]
    if isinstance(tree, (list, tuple)):
        return [piece for value in tree for piece in planned_pieces(value)]
    return []


def written_source(storage: StorageOut) -> TensorSource:
    """Where a storage written into a torch zip (``pickle_writer.dumps``) takes its bytes from: a new tensor's
    pieces, or an unchanged tensor's whole stored storage."""
    source = storage.source
    return source.source if isinstance(source, NewTensor) else storage_source(source)


def storage_source(ref: TensorRef) -> TensorSource:
    """A tensor's whole storage as it is stored (what a rewritten file copies for an unchanged tensor)."""
    loc = ref.file.locate(ref.storage)
    return TensorSource(ref.dtype, ref.dtype, (Segment(ref.file.path, loc.offset, loc.nbytes),) if loc.nbytes else ())


class FlatSpace:
    """Several contiguous 1-D tensors seen as one flat element range (a rank's partitions of a group)."""

    def __init__(self, refs: list[TensorRef]):
        self.dtype = refs[0].dtype if refs else "F32"
        self.itemsize = ITEMSIZE[self.dtype]
        self.spans = []  # (start element, numel, path, byte offset)
        start = 0
        for ref in refs:
            path, offset, _ = tensor_byte_range(ref)
            self.spans.append((start, ref.numel, path, offset))
            start += ref.numel
        self.numel = start

    def pieces(self, start: int, count: int, where: str) -> list[Segment]:
        if start < 0 or start + count > self.numel:
            raise InconsistentCheckpointError(f"needs elements [{start}, {start + count}) "
                                              f"but the partition holds {self.numel}", at=where)
        out = []
        for span_start, span_numel, path, offset in self.spans:
            lo, hi = max(start, span_start), min(start + count, span_start + span_numel)
            if lo < hi:
                out.append(Segment(path, offset + (lo - span_start) * self.itemsize, (hi - lo) * self.itemsize))
        return out


def clip(pieces: Iterable[Piece], start: int, nbytes: int) -> tuple[Piece, ...]:
    """The pieces of bytes ``[start, start + nbytes)`` of a piece sequence (a part of a streamed file); walks
    ``pieces`` lazily, so a row-parallel join is never listed whole."""
    out: list[Piece] = []
    pos, end = 0, start + nbytes
    for piece in pieces:
        if pos >= end:
            break
        lo, hi = max(start, pos), min(end, pos + piece.nbytes)
        if lo < hi:
            out.append(Zeros(hi - lo) if isinstance(piece, Zeros) else Segment(piece.path, piece.offset + lo - pos, hi - lo))
        pos += piece.nbytes
    return tuple(out)


def joined_spans(spans: Iterable[tuple[int, int]], gap: int = 0) -> list[tuple[int, int]]:
    """``(start, end)`` byte spans sorted, those overlapping or at most ``gap`` bytes apart joined: the one range
    merge (a fetch's requests, a transfer's, the kernel's read-ahead advice, a fill's arrivals)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def merged(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Adjacent byte ranges of one file and adjacent zero fills become one (fewer, larger reads)."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if piece.nbytes == 0:
            continue
        if isinstance(piece, Zeros) and isinstance(last, Zeros):
            out[-1] = Zeros(last.nbytes + piece.nbytes)
        elif (isinstance(piece, Segment) and isinstance(last, Segment) and last.path == piece.path
              and last.offset + last.nbytes == piece.offset):
            out[-1] = Segment(last.path, last.offset, last.nbytes + piece.nbytes)
        else:
            out.append(piece)
    return tuple(out)

