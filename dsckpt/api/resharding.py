"""Reshard API: ``reshard(ckpt, out_dir, world_size)`` writes a native DeepSpeed checkpoint for another
data-parallel world size, optimizer state included; stock ``engine.load_checkpoint(out_dir)`` loads it.

Steps, the same on one process or every process of a torchrun run (``api.frame``; with ``group``, target rank r's
files are written on the host of the process that will run it, ``Placement``):
1. open the checkpoint's view (``parallel.view``) and build the plan (``plan.reshard``): no bytes read yet;
2. check OUT_DIR (not an input, not inside the checkpoint, not existing unless ``force``);
3. keep what is written to allowed classes (``carry_only_allowed``): a client-state entry naming any other
   class is left out with a note, anything else refused; links out of the checkpoint are refused
   (``trust`` keeps both, loudly);
4. write ``<tag>/`` rank files and ``latest`` into a temp folder beside OUT_DIR: each file's pickle
   from ``pickle_writer``, its storages streamed by ``io.read.Reader`` from their byte sources
   (unchanged tensors copied whole, partitions assembled from the ranks that held them), up to
   ``WRITE_THREADS`` files at once; every storage read CRC-checked (``Frame.checked_reads``);
5. copy the files beside the tag (``zero.companions``: a trainer's state, per-rank RNG files renumbered
   for M ranks, configs and tokenizers; pickles of foreign classes left out with a note);
6. re-open the result with dsckpt's reader (complete, world size M), then rename it into place (into an
   existing OUT_DIR with ``force``: ``latest``, the tag folder and the copied files replaced, everything
   else kept).
"""
from __future__ import annotations

import math
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from ..errors import InconsistentCheckpointError, UnsupportedCheckpointError
from ..formats.pickle_writer import StorageOut, dumps
from ..io.context import WriteContext
from ..io.output import check_output, write_errors
from ..io.read import Reader
from ..io.torch_writer import write_pickled, write_raw
from ..parallel.group import ONE_PROCESS, Group
from ..progress import Phase, begin
from .options import DEFAULTS, WriteOptions
from .frame import destination, writing
from ..parallel.outputs import GroupStaging, StorageGroups, storage_groups
from ..parallel.transfer import fetch, ranges_held_elsewhere
from ..parallel.view import View
from ..plan.consolidate import build_plan, master_pieces
from ..plan.moves import OutputFile, ReshardPlan
from ..plan.offload import TargetOffload, for_nvme, is_swap_file, require_stage3, swap_rank
from ..plan.reshard import build_reshard_plan
from ..plan.segments import Piece, written_source
from ..zero import layout as L
from ..zero.allowed import allowed_tree, dropped_notes, trusted_notes
from ..zero.companions import Copy, per_rank_file, plan_companions
from ..zero.reader import Checkpoint, open_checkpoint


Pickled = tuple[bytes, list[StorageOut]]  # a rank file's pickle and the storages it names (``dumps``)
# Rank files written at once, each by its own thread and Reader: one stream of writes cannot fill a large host's
# page cache, and on 2 cores too a thread's reads and writes wait in the kernel often enough to leave room for
# others (docs/dev/performance-log.md 17, 26).
WRITE_THREADS = 4


@dataclass(frozen=True)
class ReshardResult:
    """What ``reshard`` wrote; the same names as ``dsckpt reshard --json`` (docs/cli.md)."""
    out: Path
    tag: str
    zero_stage: int
    source_zero_stage: int
    world_size: int
    source_world_size: int
    files: tuple[str, ...]  # final paths (of this host's files, in a distributed run)
    bytes: int  # of tensor data
    notes: tuple[str, ...] = ()
    processes: int = 0  # the resumed job's ranks: world_size x tensor parallel x pipeline stages


def reshard(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], world_size: int, *,
            tag: str | None = None, stage: int | None = None, ep_size: int | None = None, gather: bool = False,
            offload: TargetOffload | str = TargetOffload.CPU, options: WriteOptions = DEFAULTS) -> ReshardResult:
    """Write ``checkpoint`` (one tag) as a DeepSpeed checkpoint at ``world_size`` (and ZeRO ``stage``, default
    its own: ``plan.restage``) into ``out_dir``; ``ep_size``: a mixture-of-experts run's new expert-parallel size
    (``plan.experts``).  ``offload``: the optimizer placement of the engine that will load it - ``"nvme"`` writes the
    sub-groups it swaps as ``offloaded_tensors/rankNN/`` swap files (``plan.offload``), ``"cpu"`` (also for an engine
    without offload) keeps every partition in the rank files.

    ``options`` (``WriteOptions``): ``trust`` copies pickled objects of any class as recorded and follows links
    out of the checkpoint (whoever loads OUT_DIR with DeepSpeed then runs that pickle code); ``group``: the
    processes of a torchrun run sharing the work (None: one process) - target rank r's files are written on the
    host of process ``r * N // M`` (torchrun numbers processes host by host), or all on rank 0's with ``gather``;
    ``progress``: a bucket's ``FETCH``, then the ``WRITE`` of the tensor bytes.
    """
    group, force, trust = options.group or ONE_PROCESS, options.force, options.trust
    offload = TargetOffload(offload)
    with destination(group, out_dir, force) as dest:
        if offload is TargetOffload.NVME and dest.url is not None:
            raise UnsupportedCheckpointError("--offload nvme writes the swap files an engine reads from its local "
                                             "disk; write OUT_DIR to a local folder", at=dest.url)
        out = dest.path
        with writing(group, checkpoint, tag, dest, trust) as frame:
            view = frame.view
            ckpt, prepared, masters = group.step(lambda: _prepare(view, world_size, stage, ep_size, offload, trust))
            plan = prepared.plan
            inputs = [view.real_path(f.path) for f in ckpt.layout.all_files]
            group.step(lambda: check_output(out, inputs, force, directory=True, tree=view.real_path(ckpt.layout.root)))
            groups = storage_groups(group, out)
            items = [(f"{plan.tag}/{f.name}", f) for f in plan.files] + [(c.name, c) for c in prepared.companions]
            place = Placement(world_size, group, groups, gather)
            receiving = {g for name, _ in items for g in place.destinations(name)}
            staged = frame.stage(GroupStaging(group, groups, out, directory=True, fsync=options.fsync,
                                              publishing=receiving))
            mine = []
            for leader in groups.leaders:  # each storage group's files dealt to its processes in turn
                members = groups.members(leader)
                here = [item for item in items if leader in place.destinations(item[0])]
                mine += [item for i, item in enumerate(here) if members[i % len(members)] == group.rank]
            files = [obj for _, obj in mine if not isinstance(obj, Copy)]
            copies = [obj for _, obj in mine if isinstance(obj, Copy)]
            wanted = ranges_held_elsewhere(view, _pieces(files, prepared.pickled), [c.source for c in copies])
            fetch(group, view, wanted, options.progress)
            begin(options.progress, Phase.WRITE, prepared.total)
            everyone = groups.members(staged.leader) == list(range(group.size))  # one group holds every rank's files
            with write_errors(out):
                with frame.checked_reads(_pieces(plan.files, prepared.pickled), options.check_crc,
                                         progress=options.progress, masters=masters) as (context, crc_notes):
                    group.step(lambda: write_files(plan, staged.tmp, files, copies, prepared.pickled, context)
                               if files or copies else None)
                group.step(lambda: _finish(staged.tmp, plan, everyone) if staged.leads else None)
                staged.publish()
        published = [name for name, _ in items if staged.leader in place.destinations(name)]
        result = ReshardResult(out, plan.tag, plan.stage, ckpt.zero_stage, plan.world_size, plan.source_world_size,
                               tuple(str(out / name) for name in published + [L.LATEST_FILE]), prepared.total,
                               prepared.notes + tuple(crc_notes), plan.world_size * ckpt.grid.tp * ckpt.grid.pp)
    return dest.named(result)


def _prepare(view: View, world_size: int, stage: int | None, ep_size: int | None, offload: TargetOffload,
             trust: bool) -> tuple[Checkpoint, PreparedReshard, list[Piece]]:
    """The checkpoint, its reshard and the byte ranges of its fp32 masters (scanned for NaN/Inf as they are read)."""
    ckpt = view.open(trust)
    with view.real_names():
        prepared = prepare_reshard(ckpt, world_size, stage, ep_size, trust, links_checked=not view.direct,
                                   offload=offload)
        return ckpt, prepared, master_pieces(build_plan(ckpt))


@dataclass(frozen=True)
class Placement:
    """Which storage groups get a written file: target rank r's on the group of process ``r * N // M`` (all on
    rank 0's with ``gather``); files every rank reads (``latest``, ZeRO-1/2 model states, shared companions) on
    every group that holds a target rank."""
    world_size: int
    group: Group
    groups: StorageGroups
    gather: bool

    def destinations(self, name: str) -> list[int]:
        """The storage groups (leaders) that get ``name``."""
        if self.gather:
            return [self.groups.of[0]]
        hosting = [self.groups.of[r * self.group.size // self.world_size] for r in range(self.world_size)]
        rank = target_rank(name)
        return [hosting[rank]] if rank is not None and rank < self.world_size else sorted(set(hosting))


def target_rank(name: str) -> int | None:
    """The target rank a written file belongs to (a rank file or per-rank companion), None when every rank
    reads it."""
    swapped = swap_rank(name)
    if swapped is not None:
        return swapped
    match = L.RANK_FILE_RE.match(Path(name).name)
    if match:
        return int(match.group("dp")) if match.group("dp") is not None else None
    found = per_rank_file(Path(name).name)
    return found[1] if found else None


def _pieces(files: Iterable[OutputFile], pickled: Mapping[str, Pickled]) -> list[Piece]:
    return [piece for f in files for storage in pickled[f.name][1] for piece in written_source(storage).pieces]


def _finish(tmp: Path, plan: ReshardPlan, complete: bool) -> None:
    """A leader's last word before publishing: ``latest``; a group holding every rank re-reads the result."""
    (tmp / L.LATEST_FILE).write_text(plan.tag)
    if complete:
        check_written(tmp, plan)


@dataclass(frozen=True)
class PreparedReshard:
    plan: ReshardPlan  # only allowed classes left in its trees
    companions: tuple[Copy, ...]  # the files beside the tag, as OUT_DIR gets them
    notes: tuple[str, ...]
    total: int  # bytes of tensor data to write
    pickled: Mapping[str, Pickled]  # file name -> its pickle and storages (``dumps``), made once


def prepare_reshard(ckpt: Checkpoint, world_size: int, stage: int | None, ep_size: int | None, trust: bool,
                    links_checked: bool = False, offload: TargetOffload = TargetOffload.CPU) -> PreparedReshard:
    """Everything decided before a byte is written (``links_checked``: the caller has refused links out of the
    checkpoint already, as the distributed run does on each host's own files)."""
    if offload is TargetOffload.NVME:
        require_stage3(stage or ckpt.zero_stage, ckpt)
    plan = build_reshard_plan(ckpt, world_size, stage, ep_size)
    if offload is TargetOffload.NVME:
        plan = for_nvme(plan, ckpt)
    plan, notes = carry_only_allowed(plan, trust)
    companions, companion_notes = plan_companions(ckpt.layout.root, ckpt.layout.tags, plan.source_world_size,
                                                  world_size, trust, follow_links=links_checked)
    pickled = {f.name: _pickle(f, trust) for f in plan.files}  # every tree writable before a byte moves
    total = sum(s.nbytes for _, storages in pickled.values() for s in storages)
    return PreparedReshard(plan, tuple(companions), notes + tuple(companion_notes), total, pickled)


def carry_only_allowed(plan: ReshardPlan, trust: bool = False) -> tuple[ReshardPlan, tuple[str, ...]]:
    """The plan with every client-state entry that names a class beyond DeepSpeed's own (and plain data,
    tensors) left out, and notes saying which.  Such a class in DeepSpeed's own entries or an optimizer
    file is refused: leaving it out would break the checkpoint.  ``trust``: everything kept, one warning."""
    if trust:
        return plan, trusted_notes([f.tree for f in plan.files], "DeepSpeed's load_checkpoint of OUT_DIR")
    dropped: dict[str, set[str]] = {}
    files = []
    for f in plan.files:
        tree = allowed_tree(f.tree, f.template, f.name.endswith(L.OPTIM_STATES_SUFFIX), dropped)
        files.append(replace(f, tree=tree))
    return replace(plan, files=tuple(files)), dropped_notes(dropped)


def _pickle(f: OutputFile, trust: bool) -> Pickled:
    """``dumps(f.tree)``, a value the pickle format cannot hold named as the file's; a swap file's one storage."""
    if is_swap_file(f.name):
        return b"", [StorageOut("0", f.tree.dtype, math.prod(f.tree.shape), f.tree)]
    try:
        return dumps(f.tree, allow_foreign=trust)
    except ValueError as exc:
        raise UnsupportedCheckpointError(f"{exc}; it cannot be written back", at=f.template) from None


def write_files(plan: ReshardPlan, root: Path, files: Sequence[OutputFile], companions: Sequence[Copy],
                pickled: Mapping[str, Pickled], context: WriteContext) -> None:
    """``files`` (of ``plan.files``, pickled as ``PreparedReshard.pickled``) under ``root/<tag>/`` and the
    ``companions`` beside it (root must exist), ``WRITE_THREADS`` files at once."""
    tag_dir = root / plan.tag
    tag_dir.mkdir(exist_ok=True)
    context = replace(context, progress=_serialized(context.progress))

    def write(f: OutputFile) -> None:
        with Reader(context) as reader:
            if is_swap_file(f.name):
                (tag_dir / f.name).parent.mkdir(parents=True, exist_ok=True)
                write_raw(tag_dir / f.name, pickled[f.name][1][0], reader, context)
            else:
                write_pickled(tag_dir / f.name, pickled[f.name], reader, context)
    biggest_first = sorted(files, key=lambda f: -sum(s.nbytes for s in pickled[f.name][1]))
    with ThreadPoolExecutor(WRITE_THREADS) as pool:
        for done in [pool.submit(write, f) for f in biggest_first]:
            done.result()
    for copy in companions:  # the trainer's files beside the tag (trainer_state.json, rng_state_{r}.pth, ...)
        (root / copy.name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(copy.source, root / copy.name)


def _serialized(progress: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """``progress``, called by one writer thread at a time."""
    if progress is None:
        return None
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            progress(n)
    return report


def check_written(root: Path, plan: ReshardPlan) -> None:
    """What DeepSpeed will look for: one complete tag at world size M (read back with dsckpt's reader)."""
    written = open_checkpoint(root)
    written.require_complete(tensor_parallel=True, pipeline=True)
    if written.world_size != plan.world_size or written.zero_stage != plan.stage:
        raise InconsistentCheckpointError(f"wrote stage {written.zero_stage} at world size "
                                          f"{written.world_size}, meant stage {plan.stage} at {plan.world_size}", at=root)
