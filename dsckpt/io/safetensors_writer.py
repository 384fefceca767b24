"""Write safetensors files (single or sharded, Hugging Face's layout) from a plan's byte sources.

The header is computed from the plan before any data moves; the file is then sized and filled at known
offsets.  Same-dtype segments move with ``os.copy_file_range`` (kernel to kernel, no user copy) or, where
source and destination are out of step within a page, from a mapped window of the source (``io.filecopy``);
segments that need a cast go through bounded chunks on a few threads; zero fills are already there (the file
is sized with ``ftruncate``, which reads back as zeros).  Memory stays O(chunk), whatever the size.  The write's
context (``io.context``) gives the source storage, the CRC ledger, write-back and the streams of a bucket OUT.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

from ..dtypes import ITEMSIZE
from ..formats.positional import pwrite_all
from ..formats.safetensors_file import INDEX_NAME, encode_header, shard_name
from ..plan.segments import Interleaved, Segment
from .context import WriteContext
from .inflight import InFlight
from .filecopy import copy_range
from ..plan.consolidate import Plan, TensorPlan
from ..plan.deal import dealt
from .read import Reader

CAST_CHUNK_BYTES = 16 << 20  # casts run on a few threads at once; each holds ~3 chunk-sized buffers
CAST_THREADS = min(4, os.cpu_count() or 1)


def _chunks(t: TensorPlan, pos: int, chunk: int) -> Iterator[tuple[Path, int, int, int]]:
    """(source path, source offset, source bytes, output offset) of each chunk of a tensor, whose
    output starts at ``pos``; chunks hold whole elements."""
    src_size, dst_size = ITEMSIZE[t.src_dtype], ITEMSIZE[t.dtype]
    step = max(src_size, chunk - chunk % src_size)
    for piece in t.pieces:
        for start in range(0, piece.nbytes, step):
            n = min(step, piece.nbytes - start)
            if isinstance(piece, Segment):  # a zero fill is already zeros in the sized file
                yield piece.path, piece.offset + start, n, pos
            pos += n // src_size * dst_size


def safetensors_header(tensors: list[TensorPlan], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) and each tensor's data offset relative to the data start."""
    return encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], metadata)


def _cast_pool(needed: bool):
    if not needed:
        return contextlib.nullcontext()
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(CAST_THREADS)


def write_safetensors(tensors: list[TensorPlan], path: Path, metadata: dict[str, str],
                      context: WriteContext) -> None:
    upload_id = create_safetensors(tensors, path, metadata, context)
    fill_safetensors(tensors, path, metadata, context, upload_id=upload_id)


def create_safetensors(tensors: list[TensorPlan], path: Path, metadata: dict[str, str],
                       context: WriteContext) -> str | None:
    """The file at its final size: header written, data zeros until filled.  Its blocks are allocated up front
    where the filesystem can (several writers filling it out of order would otherwise scatter them).
    A file of a run streaming to object storage (``io.stream``): an empty placeholder, and the multipart upload
    started - its id is returned, for the writers that fill it."""
    streamed = context.stream_target(path)
    if streamed is not None:
        Path(path).touch()
        return streamed[0].start(streamed[1]).upload_id
    header, _ = safetensors_header(tensors, metadata)
    size = len(header) + sum(t.nbytes for t in tensors)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:  # (not every filesystem allocates ahead)
            pass
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return None


def fill_safetensors(tensors: list[TensorPlan], path: Path, metadata: dict[str, str], context: WriteContext,
                     part: tuple[int, int] = (0, 1), upload_id: str | None = None) -> None:
    """Write the data of a created file: every tensor, or with ``part=(k, n)`` writer k's share (``dealt``: processes
    of a distributed run each fill their part of one file).  Same-dtype tensors: ``copy_file_range`` in this
    thread.  Cast tensors: chunks handed to a few threads (numpy and pread/pwrite release the GIL), each
    writing at its precomputed offset.  Streamed (``upload_id``): writer k uploads the k-th run of the parts."""
    header, offsets = safetensors_header(tensors, metadata)
    k, n = part
    streamed = context.stream_target(path) if upload_id is not None else None
    if streamed is not None and upload_id is not None:
        from . import stream  # (a bucket's modules, imported for one only)

        streams, key = streamed
        parts = stream.my_parts(len(header) + sum(t.nbytes for t in tensors), k, n)
        stream.stream_safetensors(context, streams, streams.join(key, upload_id), header, tensors, offsets, parts)
        return
    owners = dealt([t.nbytes for t in tensors], n)
    mine = [(t, rel) for t, rel, owner in zip(tensors, offsets, owners) if owner == k]
    fd = os.open(path, os.O_WRONLY)
    started = context.started(path, fd)
    src, ledger, progress = context.storage, context.ledger, context.progress

    def cast_chunk(job, t: TensorPlan) -> int:
        from ..formats.cast import cast_bytes  # numpy only when a cast is needed

        src_path, src_off, n, dst_off = job
        raw = src.pread(src_path, n, src_off)
        if ledger is not None:
            ledger.add(src_path, src_off, raw)
        written = pwrite_all(fd, cast_bytes(raw, t.src_dtype, t.dtype), dst_off)
        started(dst_off, written)
        return n // ITEMSIZE[t.src_dtype] * ITEMSIZE[t.dtype]

    try:
        with _cast_pool(any(t.src_dtype != t.dtype for t, _ in mine)) as pool, Reader(context) as reader:
            casts = InFlight(pool, 2 * CAST_THREADS, progress)  # bounded memory: a few chunks in flight
            for t, rel in mine:
                pos = len(header) + rel
                if t.src_dtype == t.dtype and (isinstance(t.pieces, Interleaved) or not src.kernel_copies):
                    # a row-parallel join (a run per row and TP rank, too small to copy one by one) or a storage
                    # without kernel-side copies: read into the reader's buffers, written a buffer at a time
                    start = pos
                    for chunk in reader.chunks(t):
                        pos += pwrite_all(fd, chunk, pos)
                    started(start, pos - start)
                    if progress:
                        progress(t.nbytes)
                elif t.src_dtype == t.dtype:
                    for p in t.pieces:
                        if isinstance(p, Segment):  # (zero fills: see the module docstring)
                            copy_range(src.fd(p.path), fd, p.nbytes, p.offset, pos, p.path, started, ledger)
                        pos += p.nbytes
                    if progress:
                        progress(t.nbytes)
                else:
                    for job in _chunks(t, pos, CAST_CHUNK_BYTES):
                        casts.submit(cast_chunk, job, t)
            casts.drain()
    finally:
        os.close(fd)


def shard(tensors: tuple[TensorPlan, ...], max_bytes: int) -> list[list[TensorPlan]]:
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_sharded(plan: Plan, folder: Path, max_bytes: int, context: WriteContext,
                  part: tuple[int, int] = (0, 1)) -> list[str]:
    """Hugging Face layout: model-0000i-of-0000N.safetensors + model.safetensors.index.json.  With
    ``part=(k, n)`` (a distributed run's writer k of n): writer k's shards (``dealt``), and the index if k == 0."""
    groups = shard(plan.tensors, max_bytes)
    n = len(groups)
    owners = dealt([sum(t.nbytes for t in group) for group in groups], part[1])
    weight_map, names = {}, []
    for i, group in enumerate(groups, 1):
        name = shard_name(i, n)
        if owners[i - 1] == part[0]:
            write_safetensors(group, folder / name, plan.metadata, context)
        weight_map.update({t.name: name for t in group})
        names.append(name)
    if part[0] == 0:
        index = {"metadata": {"total_size": plan.nbytes, **plan.metadata}, "weight_map": weight_map}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names
