"""The one reader: a tensor's output bytes from its segments (``plan.segments``), for every writer.

``Reader.chunks(source)`` yields a ``ByteSource``'s bytes in order, at most ``chunk`` bytes at a time:
1. a source without a cast is read with a prefetch - the next chunk read on a helper thread into the
   second of two reused buffers while the caller writes the current one (pread, crc32 and write release
   the GIL), and with ``storage_chunks(storage, then)`` the next storage's first chunk while the caller
   writes this one's last; zero fills come from one zero buffer;
2. a source with a cast is read in whole elements and cast with numpy (``formats.cast``);
3. ``storage_chunks`` gives each chunk's CRC-32 with it, for the zip entry the caller writes: uncast, it is joined
   from the CRC-32 of each piece read, the same values the integrity check notes (``io.integrity``), so every
   byte is checksummed once, on the prefetch thread, for both;
4. ``copy_storage``: a local, uncast storage copied into the caller's file at its offset on the caller's thread
   (``io.filecopy.copy_pieces``), no prefetch hand-off, each buffer checksummed while in cache (a reshard's rank
   files are written this way: docs/dev/performance-log.md 27);
5. a row-parallel join (``plan.segments.Interleaved``: a tensor-parallel weight split along its rows' width) is
   read a chunk of rows at a time: each slice's run of those rows in one pass, the blocks interleaved by slice
   copies (by numpy where it is loaded already or the join has more than ``NUMPY_BLOCKS`` blocks: its import is a
   small run's largest cost, docs/dev/performance-log.md 29) - not one read per row and slice.
Bytes come from the write's context (``io.context.WriteContext``): its storage (``LocalStorage``: descriptors
opened once per file, shared by threads, positional reads) and its ledger, where what is read is noted.

A yielded chunk is valid until the next one is requested: copy it to keep it (``read`` does).  Reused buffers
and the prefetch replace a fresh ``bytes`` per chunk read in turn (docs/dev/performance-log.md 12).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from ..dtypes import ITEMSIZE, torch_dtype
from ..errors import InconsistentCheckpointError
from ..formats.crc import crc32, crc32_combine
from ..formats.pickle_policy import TensorRef
from ..formats.storage import LocalStorage
from .filecopy import copy_pieces
from .writeback import Started
from ..plan.segments import ByteSource, Interleaved, Segment, Zeros, joined_spans, read_pieces, storage_source

if TYPE_CHECKING:
    from .context import WriteContext
    from .integrity import Ledger

# Per read; two such buffers in flight: small enough to stay in cache for the write and the CRC that follow
# (docs/dev/performance-log.md 16).
CHUNK = 4 << 20
# Each source's ranges are announced to the kernel (POSIX_FADV_WILLNEED) before its first read: cold reads start
# sooner (docs/dev/performance-log.md 15).
ADVISE_GAP = 1 << 20  # ranges closer than this are advised as one
NUMPY_BLOCKS = 1 << 18  # a row-parallel join with more blocks is interleaved by numpy (step 5)
Chunk = bytes | bytearray | memoryview  # what a read hands a writer (a reused buffer's view, or new bytes)


class Reader:
    """Chunks of any ``ByteSource`` (see the module docstring); a context manager owning its files and thread."""

    def __init__(self, context: "WriteContext | None" = None, chunk: int = CHUNK):
        """``context``: the write's storage and ledger (None: a storage of its own, nothing noted)."""
        from concurrent.futures import ThreadPoolExecutor

        self.files = context.storage if context is not None else LocalStorage()
        self.ledger = context.ledger if context is not None else None
        self._own_files = context is None
        self.chunk = chunk
        self._buffers: tuple[bytearray, bytearray] | None = None  # (made at the first read: many Readers read nothing)
        self._zero_fill: memoryview | None = None
        self._pool = ThreadPoolExecutor(1)
        self._turn = 0  # the buffer the next read fills
        self._ahead: tuple | None = None  # (storage, jobs, first read) read ahead by ``storage_chunks(then=)``

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown()
        if self._own_files:
            self.files.close()

    def chunks(self, source: ByteSource) -> Iterator[Chunk]:
        return (chunk for chunk, _ in self._stream(source, source, None, crc=False))

    def storage_chunks(self, storage: Any, then: Any = None) -> Iterator[tuple[Chunk, int | None]]:
        """``chunks`` of a ``pickle_writer.StorageOut`` (a new tensor's source, or an unchanged storage), each with
        its CRC-32 (step 3).  ``then``: the storage with bytes the caller streams next (empty ones may come
        between) - its first chunk is read while the caller writes this one's last."""
        return self._stream(storage, _source_of(storage), then, crc=True)

    def copy_storage(self, storage: Any, fd: int, offset: int, started: Started,
                     progress: Callable[[int], None] | None = None) -> tuple[int, int] | None:
        """A ``pickle_writer.StorageOut``'s bytes written into the file ``fd`` from ``offset`` (step 4): (bytes,
        CRC-32).  None where it cannot be: a cast, a row-parallel join, a storage without kernel-side copies (a view
        still arriving from object storage) - the caller then streams ``storage_chunks``."""
        source = _source_of(storage)
        if (source.src_dtype != source.dtype or not self.files.kernel_copies
                or isinstance(source.pieces, Interleaved)):
            return None
        return copy_pieces(source.pieces, self.files.fd, fd, offset, started, progress, self.ledger)

    def _stream(self, key: Any, source: ByteSource, then: Any, crc: bool) -> Iterator[tuple[Any, int | None]]:
        if source.src_dtype != source.dtype:
            yield from self._cast_chunks(source, crc)
            return
        if _rows_joinable(source.pieces):
            yield from self._joined_chunks(source.pieces, crc)  # type: ignore[arg-type]
            return
        if not any(piece.nbytes for piece in source.pieces):  # (an empty storage leaves a read-ahead in place)
            return
        ahead, self._ahead = self._ahead, None
        started = ahead[1:] if ahead is not None and ahead[0] is key else self._start(source, crc)
        if started is None:
            return
        jobs, pending = started
        for i in range(len(jobs)):
            current = pending.result()
            if i + 1 < len(jobs):  # the other buffer: the caller is done with it
                pending = self._submit(jobs[i + 1], crc)
            elif then is not None:
                # Read ahead into the next storage: each one's first read waited on its own otherwise.
                following = self._start(_source_of(then), crc)
                self._ahead = (then, *following) if following else None
            yield current

    def _start(self, source: ByteSource, crc: bool) -> tuple[list, Any] | None:
        """The read jobs of an uncast ``source`` and the first one submitted (None: nothing to read)."""
        if source.src_dtype != source.dtype or _rows_joinable(source.pieces):
            return None
        jobs = list(self._batches(source))
        if not jobs:
            return None
        self._pool.submit(self._advise, source)  # on the prefetch thread, before the first read
        return jobs, self._submit(jobs[0], crc)

    def _submit(self, job, crc: bool) -> Any:
        """Read ``job`` into the buffer not read into last.  One worker runs reads in order, so a read left in
        flight by an abandoned stream finishes before the next read starts."""
        if self._buffers is None:
            self._buffers = (bytearray(self.chunk), bytearray(self.chunk))
        buffer = self._buffers[self._turn]
        self._turn ^= 1
        return self._pool.submit(self._read, job, buffer, crc)

    def _batches(self, source: ByteSource) -> Iterator[list[tuple[Segment | Zeros, int, int]]]:
        """The source's pieces cut to fill whole buffers: a resharded ZeRO-3 partition is one segment per
        parameter and source rank, often a few hundred KB; read one by one, the thread hand-offs would cost as
        much as the bytes."""
        batch: list[tuple[Segment | Zeros, int, int]] = []
        size = 0
        for piece in source.pieces:
            for start in range(0, piece.nbytes, self.chunk):
                n = min(self.chunk, piece.nbytes - start)
                if batch and size + n > self.chunk:
                    yield batch
                    batch, size = [], 0
                batch.append((piece, start, n))
                size += n
        if batch:
            yield batch

    def read(self, source: ByteSource) -> bytes:
        """The whole output bytes of one source (for checks and small tensors)."""
        return b"".join(bytes(c) for c in self.chunks(source))

    @property
    def _zeros(self) -> memoryview:
        if self._zero_fill is None:
            self._zero_fill = memoryview(bytes(self.chunk))
        return self._zero_fill

    def _advise(self, source: ByteSource) -> None:
        """Tell the kernel every range this source will read (``POSIX_FADV_WILLNEED``), each file's nearby ranges
        joined: a resharded ZeRO-3 partition is one piece per parameter from each source file in turn, and from a
        cold cache each piece read on its own waited for the disk (see ADVISE_GAP)."""
        spans: dict[Path, list[tuple[int, int]]] = {}
        for piece in getattr(source.pieces, "sources", source.pieces):  # (a row-parallel join: its slices whole)
            if isinstance(piece, Segment) and piece.nbytes:
                spans.setdefault(piece.path, []).append((piece.offset, piece.offset + piece.nbytes))
        for path, runs in spans.items():
            self.files.advise(path, [(start, end - start) for start, end in joined_spans(runs, ADVISE_GAP)])

    def _read(self, batch: list[tuple[Segment | Zeros, int, int]], buffer: bytearray,
              crc: bool) -> tuple[memoryview, int | None]:
        """The batch's bytes, and with ``crc`` their CRC-32 (joined from each piece's: step 3)."""
        view, pos, joined = memoryview(buffer), 0, 0
        for piece, start, n in batch:
            part = view[pos:pos + n]
            if isinstance(piece, Zeros):
                part[:] = self._zeros[:n]
                piece_crc = crc32(part) if crc else None
            else:
                self.files.pread(piece.path, n, piece.offset + start, into=part)
                piece_crc = crc32(part) if crc or self.ledger is not None else None
                if self.ledger is not None:
                    self.ledger.add(piece.path, piece.offset + start, part, piece_crc)
            if crc and piece_crc is not None:
                joined = crc32_combine(joined, piece_crc, n) if pos else piece_crc
            pos += n
        return view[:pos], joined if crc else None

    def _joined_chunks(self, joined: Interleaved, crc: bool) -> Iterator[tuple[Chunk, int | None]]:
        """Step 5: ``chunk`` bytes of joined rows at a time (at least one row)."""
        import sys

        width = sum(n for _, _, n in joined.blocks)
        rows = max(1, self.chunk // width)
        used = sorted({part for part, _, _ in joined.blocks})
        by_numpy = "numpy" in sys.modules or joined.count * len(joined.blocks) > NUMPY_BLOCKS
        for first in range(0, joined.count, rows):
            k = min(rows, joined.count - first)
            runs = {}
            for part in used:
                period = joined.periods[part]
                run = bytearray(k * period)
                span = (k - 1) * period + max(start + n for p, start, n in joined.blocks if p == part)
                self._fill(joined.parts[part].cut(first * period, span), memoryview(run)[:span])
                runs[part] = run
            flat = _interleave(runs, joined, k, width, by_numpy)
            yield flat, crc32(flat) if crc else None

    def _fill(self, pieces: Iterable[Segment | Zeros], into: memoryview) -> None:
        """``pieces`` read one after another into the fresh (zeroed) ``into``, each read noted in the ledger."""
        pos = 0
        for piece in pieces:
            part = into[pos:pos + piece.nbytes]
            if isinstance(piece, Segment):  # (a zero fill: already zeros)
                self.files.pread(piece.path, piece.nbytes, piece.offset, into=part)
                if self.ledger is not None:
                    self.ledger.add(piece.path, piece.offset, part)
            pos += piece.nbytes

    def _cast_chunks(self, source: ByteSource, crc: bool) -> Iterator[tuple[Chunk, int | None]]:
        from ..formats.cast import cast_bytes  # numpy only when a cast is needed

        src_size, dst_size = ITEMSIZE[source.src_dtype], ITEMSIZE[source.dtype]
        step = max(src_size, self.chunk - self.chunk % src_size)
        for piece in source.pieces:
            for start in range(0, piece.nbytes, step):
                n = min(step, piece.nbytes - start)
                out: Chunk
                if isinstance(piece, Zeros):
                    out = bytes(n // src_size * dst_size)
                else:
                    raw = self.files.pread(piece.path, n, piece.offset + start)
                    if self.ledger is not None:
                        self.ledger.add(piece.path, piece.offset + start, raw)
                    out = cast_bytes(raw, source.src_dtype, source.dtype)
                yield out, crc32(out) if crc else None


def check_plan(plan: Any, skip: bool = False) -> tuple[str, ...]:
    """Before a consolidation plan is read into memory: every storage it touches against its CRC-32
    (``integrity.check_sources``), and tensor parallel's replicated copies against each other."""
    from .integrity import check_sources

    sources = list(plan.tensors) + [r.source for r in plan.replicas]
    notes = check_sources([p for source in sources for p in read_pieces(source)], skip=skip)
    if not skip:
        check_replicas(plan.replicas)
    return notes


def check_replicas(replicas: Iterable[Any], reads: Callable[[Path], bool] = lambda path: True,
                   ledger: "Ledger | None" = None) -> None:
    """Tensor parallel: each TP rank's copy of a replicated parameter (``plan.tensor_plan.Replica``) equals the copy
    written - compared by CRC-32 of the bytes, for the copies whose files ``reads`` accepts (what is read: noted in
    ``ledger``)."""
    from ..formats.crc import crc32
    from .context import WriteContext

    def crc(reader: Reader, source: ByteSource) -> int:
        value = 0
        for chunk in reader.chunks(source):
            value = crc32(chunk, value)
        return value

    with WriteContext(ledger=ledger) as context, Reader(context) as reader:
        for replica in replicas:
            files = [p.path for src in (replica.source, replica.written) for p in src.pieces if isinstance(p, Segment)]
            if files and all(reads(f) for f in files) and crc(reader, replica.source) != crc(reader, replica.written):
                where = next(p.path for p in replica.source.pieces if isinstance(p, Segment))
                raise InconsistentCheckpointError(
                    f"{replica.axis} {replica.rank}'s copy of the replicated parameter {replica.name!r} "
                    f"differs from the one written", hint="the ranks drifted apart, or the files come from two runs", at=where)


def _interleave(runs: dict[int, bytearray], joined: Interleaved, k: int, width: int, by_numpy: bool) -> memoryview:
    """``k`` joined rows of ``width`` bytes from each slice's run of ``k`` periods."""
    if by_numpy:
        import numpy as np

        out: Any = np.empty((k, width), np.uint8)
        col = 0
        for part, start, n in joined.blocks:
            out[:, col:col + n] = np.frombuffer(runs[part], np.uint8).reshape(k, -1)[:, start:start + n]
            col += n
        return memoryview(out).cast("B")
    joined_rows = bytearray(k * width)
    view, pos = memoryview(joined_rows), 0
    blocks = [(memoryview(runs[part]), joined.periods[part], start, n) for part, start, n in joined.blocks]
    for row in range(k):
        for run, period, start, n in blocks:
            at = row * period + start
            view[pos:pos + n] = run[at:at + n]
            pos += n
    return view


def _rows_joinable(pieces: object) -> bool:
    """A row-parallel join read by ``_joined_chunks``: each block within its slice's period (a row of it)."""
    return isinstance(pieces, Interleaved) and pieces.count > 0 and any(n for _, _, n in pieces.blocks) and all(
        start + n <= pieces.periods[part] for part, start, n in pieces.blocks)


def _source_of(storage: Any) -> ByteSource:
    stored = storage.source
    return storage_source(stored) if isinstance(stored, TensorRef) else stored.source


def torch_tensor(reader: Reader, t) -> Any:
    """One planned tensor (``name``/``shape``/``dtype`` + its source) as a torch tensor."""
    import numpy as np
    import torch

    tensor = torch.empty(t.shape, dtype=torch_dtype(t.dtype))
    view = tensor.view(torch.uint16) if t.dtype == "BF16" else tensor
    flat = view.numpy().reshape(-1).view("uint8")
    pos = 0
    for data in reader.chunks(t) if t.numel else ():
        flat[pos:pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
        pos += len(data)
    return tensor


def torch_state_dict(plan, progress=None, only: set[str] | None = None) -> dict[str, Any]:
    """Materialize a consolidation plan as torch tensors (aliases share storage, as in the module)."""
    out = {}
    with Reader() as reader:
        for t in plan.tensors:
            if only is not None and t.name not in only:
                continue
            out[t.name] = torch_tensor(reader, t)
            if progress:
                progress(t.nbytes)
    for alias, target in plan.aliases.items():
        if target in out:
            out[alias] = out[target]
    return out
