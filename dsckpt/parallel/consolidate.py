"""``consolidate`` on every process of a torchrun (or ``--nproc``) run: OUT on rank 0's host, the same bytes as
one process writes.

Steps (each ends with all processes agreeing):
1. the view and the plan, the same everywhere (``view``; ``api.consolidation``'s format choice and prepare);
2. writers: the processes of rank 0's storage group (``outputs``).  A single ``.safetensors`` file is split
   by tensors: the leader creates it at its final size with its header, each writer fills every n-th tensor
   at its offset; a sharded folder's shards are dealt out (the leader writes the index).  Any other format
   (``.pt``, ``--hf``, Lightning) is written whole by rank 0 (its zip CRCs run in one order);
3. each writer receives the source bytes it lacks (``transfer.fetch``) - the other hosts' processes only send;
4. rank 0 writes the client-state sidecar; leaders publish once every part is written and flushed.
"""
from __future__ import annotations

import os
from dataclasses import fields, is_dataclass
from pathlib import Path

from ..api.consolidation import Result, parse_size
from ..export.registry import Request, for_output
from ..export.sidecar import sidecar_paths, write_sidecar
from ..formats.pickle_policy import TensorRef
from ..io.output import check_output, staged as local_staging
from ..export.sharded import INDEX_NAME
from ..io.writer import create_safetensors, fill_safetensors, shard, write_sharded
from ..plan.consolidate import build_plan, duplicate_aliases
from ..plan.segments import ref_segments
from ..zero.reader import open_checkpoint
from .group import Group
from .outputs import Staged, storage_groups
from .transfer import fetch, remote_ranges
from .view import build_view

SPLIT_FORMATS = ("safetensors", "sharded")  # one file filled in parts; a folder's shards dealt out


def consolidate_distributed(group: Group, checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                            tag: str | None = None, dtype: str | None = None, exclude_frozen: bool = False,
                            duplicate_tied: bool = False, strip_prefixes: tuple[str, ...] = (),
                            max_shard_size: str = "5GB", client_state: bool = True, force: bool = False,
                            fsync: bool = True, form: str | None = None, config: str | None = None,
                            trust: bool = False, progress=None) -> Result:
    out = Path(out).absolute()
    view = build_view(group, Path(checkpoint).absolute(), tag, out.parent, trust)
    staged = None
    try:
        request = Request(parse_size(max_shard_size), Path(config) if config else None, strip_prefixes, duplicate_tied,
                          True)  # links out of the checkpoint: refused by each host on its own files (view)
        ckpt, prepared = group.step(lambda: _plan(view, out, form, dtype, exclude_frozen, request))
        fmt, plan = prepared.format, prepared.plan
        group.step(lambda: check_output(out, [], force, directory=fmt.directory, tree=view.real)
                   if group.rank == 0 else None)
        groups = storage_groups(group, out)
        staged = Staged(group, groups, out, directory=fmt.directory, fsync=fsync, publishing={groups.of[0]})
        staged.create()
        writers = groups.members(groups.of[0])
        split = fmt.name in SPLIT_FORMATS and len(writers) > 1
        if split and group.rank in writers:
            mine = _tensors_to_write(plan, fmt, prepared, writers, group.rank)
        else:  # not split: rank 0 writes it all
            mine = list(plan.tensors) if group.rank == 0 else []
        extra = _paths(prepared.companions) if group.rank == 0 else []
        clients = [p for ref in _tensors(ckpt.client_state) for p in ref_segments(ref)] if group.rank == 0 else []
        fetch(group, view, remote_ranges(view, [p for t in mine for p in t.pieces] + clients, extra))
        part = (writers.index(group.rank), len(writers)) if group.rank in writers else None
        if split and fmt.name == "sharded":
            max_bytes = prepared.request.max_shard_bytes
            names = group.step(lambda: write_sharded(plan, staged.tmp, max_bytes, progress, part) if part else None)
            names = group.broadcast(names, 0) + [INDEX_NAME]
        elif split:
            group.step(lambda: create_safetensors(list(plan.tensors), staged.tmp, plan.metadata)
                       if group.rank == 0 else None)
            group.step(lambda: fill_safetensors(list(plan.tensors), staged.tmp, plan.metadata, progress, part)
                       if part else None)
            names = [out.name]
        else:
            names = group.broadcast(group.step(lambda: fmt.write(prepared, staged.tmp, progress)
                                               if group.rank == 0 else None), 0)
        sidecar = bool(client_state and ckpt.client_state) and not fmt.stores_client_state
        group.step(lambda: _sidecar(ckpt.client_state, out, fsync) if sidecar and group.rank == 0 else None)
        replaced = fmt.replaced_files(out) if group.rank == 0 else ()  # as the single-process path: the shards
        staged.publish([out / name for name in replaced if name not in names])  # an old index named, not ours
    except BaseException:
        if staged is not None:
            staged.abort()
        if group.rank == 0:
            for path in sidecar_paths(out) if not os.path.lexists(out) else ():
                path.unlink(missing_ok=True)
        raise
    finally:
        view.close()
    written = [out / n for n in names] if fmt.directory else [out]
    files = tuple(str(p) for p in written + ([sidecar_paths(out)[0]] if sidecar else []))
    return Result(out, fmt.name, len(plan.tensors), plan.nbytes, files, sidecar_paths(out)[0] if sidecar else None,
                  None, prepared.notes)


def _tensors_to_write(plan, fmt, prepared, writers: list[int], rank: int) -> list:
    """The tensors writer ``rank`` writes: every n-th tensor of one file, or the tensors of every n-th shard."""
    k, n = writers.index(rank), len(writers)
    if fmt.name == "sharded":
        shards = shard(plan.tensors, prepared.request.max_shard_bytes)
        return [t for i, group in enumerate(shards) if i % n == k for t in group]
    return [t for i, t in enumerate(plan.tensors) if i % n == k]


def _plan(view, out: Path, form, dtype, exclude_frozen, request: Request):
    """As ``api.consolidation.consolidate`` plans, on the view."""
    fmt = for_output(out, form)
    with view.real_names():
        ckpt = open_checkpoint(view.root, view.tag)
        fmt = fmt.resolve(ckpt.layout.root, request)
        plan = build_plan(ckpt, dtype, exclude_frozen=exclude_frozen or fmt.exclude_frozen,
                          strip_prefixes=request.strip_prefixes)
        if request.duplicate_tied and fmt.duplicates_tied:
            plan = duplicate_aliases(plan)
        return ckpt, fmt.prepare(ckpt, plan, request)


def _sidecar(client_state, out: Path, fsync: bool) -> None:
    """Written beside OUT before OUT is published (a sidecar without its OUT is harmless; OUT without its
    sidecar would lose the counters)."""
    with local_staging(fsync) as stage:
        write_sidecar(client_state, out, stage)


def _tensors(value) -> list[TensorRef]:
    if isinstance(value, TensorRef):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _paths(record) -> list[Path]:
    """The files a format's companion record names (an hf export's config and tokenizer files)."""
    if isinstance(record, Path):
        return [record]
    if isinstance(record, (list, tuple)):
        return [p for r in record for p in _paths(r)]
    if is_dataclass(record):
        return [p for f in fields(record) for p in _paths(getattr(record, f.name))]
    return []
