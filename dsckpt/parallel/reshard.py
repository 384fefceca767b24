"""``reshard`` on every process of a torchrun (or ``--nproc``) run: the same bytes as one process writes.

Steps (each ends with all processes agreeing, ``group``):
1. the view: every process sees every file of the tag, its own or a sparse copy (``view``);
2. the plan, the same everywhere (``api.resharding.prepare_reshard`` on the view);
3. where outputs go (``outputs.storage_groups``): target rank r's files go to the storage group of process
   ``r * N // M`` (N processes: target ranks in host order, as torchrun numbers processes host by host), or
   all to rank 0's with ``gather``; files every rank reads (``latest``, the ZeRO-1/2 model states, shared
   companions) to every group that holds a target rank.  In a group, files are dealt to its processes in turn;
4. each process receives the source bytes it lacks (``transfer.fetch``) and writes its files into its group's
   temp folder; 5. leaders write ``latest``, flush, and publish once every part everywhere is written.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..api.resharding import ReshardResult, check_written, prepare_reshard, write_files
from ..formats.pickle_writer import NewTensor
from ..io.output import check_output
from ..plan.segments import storage_source
from ..zero import layout as L
from ..zero.companions import per_rank_file
from ..zero.reader import open_checkpoint
from .group import Group
from .outputs import Staged, StorageGroups, storage_groups
from .transfer import fetch, remote_ranges
from .view import build_view


def target_rank(name: str) -> int | None:
    """The target rank a written file belongs to (a rank file or per-rank companion), None when every rank
    reads it."""
    match = L.RANK_FILE_RE.match(Path(name).name)
    if match:
        return int(match.group("dp")) if match.group("dp") is not None else None
    found = per_rank_file(Path(name).name)
    return found[1] if found else None


def destinations(name: str, world_size: int, group: Group, groups: StorageGroups, gather: bool) -> list[int]:
    """The storage groups (leaders) that get ``name``."""
    if gather:
        return [groups.of[0]]
    hosting = [groups.of[r * group.size // world_size] for r in range(world_size)]
    rank = target_rank(name)
    return [hosting[rank]] if rank is not None and rank < world_size else sorted(set(hosting))


def reshard_distributed(group: Group, checkpoint: str | os.PathLike, out_dir: str | os.PathLike, world_size: int, *,
                        tag: str | None = None, stage: int | None = None, ep_size: int | None = None,
                        force: bool = False, fsync: bool = True, trust: bool = False, gather: bool = False,
                        progress=None) -> ReshardResult:
    out = Path(out_dir).absolute()
    view = build_view(group, Path(checkpoint).absolute(), tag, out.parent, trust)
    staged = None
    try:
        ckpt, prepared = group.step(lambda: _plan(view, world_size, stage, ep_size, trust))
        plan = prepared.plan
        group.step(lambda: check_output(out, [], force, directory=True, tree=view.real))
        groups = storage_groups(group, out)
        items = [(f"{plan.tag}/{f.name}", f) for f in plan.files] + [(c.name, c) for c in prepared.companions]
        receiving = {g for name, _ in items for g in destinations(name, world_size, group, groups, gather)}
        staged = Staged(group, groups, out, directory=True, fsync=fsync, publishing=receiving)
        staged.create()
        mine = []
        for leader in groups.leaders:
            members = groups.members(leader)
            here = [item for item in items if leader in destinations(item[0], world_size, group, groups, gather)]
            mine += [item for i, item in enumerate(here) if members[i % len(members)] == group.rank]
        files = [obj for _, obj in mine if not hasattr(obj, "source")]
        copies = [obj for _, obj in mine if hasattr(obj, "source")]
        fetch(group, view, remote_ranges(view, _pieces(files, prepared.pickled), [c.source for c in copies]))
        group.step(lambda: write_files(plan, staged.tmp, files, copies, prepared.pickled, progress)
                   if files or copies else None)
        everyone = groups.members(staged.leader) == list(range(group.size))  # one group holds every rank's files
        group.step(lambda: _finish(staged.tmp, plan, everyone) if staged.leads else None)
        staged.publish()
    except BaseException:
        if staged is not None:
            staged.abort()
        raise
    finally:
        view.close()
    here = [name for name, _ in items if staged.leader in destinations(name, world_size, group, groups, gather)]
    return ReshardResult(out, plan.tag, plan.stage, plan.source_world_size, plan.world_size,
                         tuple(str(out / name) for name in here + [L.LATEST_FILE]), prepared.total, prepared.notes, ckpt.zero_stage)


def _plan(view, world_size, stage, ep_size, trust):
    with view.real_names():
        ckpt = open_checkpoint(view.root, view.tag)
        return ckpt, prepare_reshard(ckpt, world_size, stage, ep_size, trust, links_checked=True)


def _pieces(files, pickled) -> list:
    out = []
    for f in files:
        for storage in pickled[f.name][1]:
            source = storage.source
            out += list(source.source.pieces if isinstance(source, NewTensor) else storage_source(source).pieces)
    return out


def _finish(tmp: Path, plan, complete: bool) -> None:
    """A leader's last word before publishing: ``latest``; one group holding every rank re-reads the result."""
    (tmp / L.LATEST_FILE).write_text(plan.tag)
    if complete:
        check_written(tmp, plan)
