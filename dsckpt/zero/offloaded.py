"""ZeRO-Infinity's offloaded optimizer state: the NVMe swap files DeepSpeed copies into a tag.

With ``offload_optimizer: {"device": "nvme"}`` (ZeRO-3), every sub-group whose partition on a rank reaches the swap
size (1 MiB) lives in that rank's swap folder, which ``save_checkpoint`` copies to ``<tag>/offloaded_tensors/rankNN/``;
the rank's optimizer file then holds empty masters and moments for it.  In the folder, per swapped sub-group:
* ``<first>_<last>.tensor.swp``: the fp32 masters of the rank's partition, raw, padded to the aio alignment;
* ``<state>-<first>_<last>.tensor.swp``: each per-element optimizer state (Adam's ``exp_avg``, ``exp_avg_sq``), the same.
``<first>``/``<last>`` are the ds_ids of the sub-group's first and last parameter, which no file records: a sub-group
is matched to the set of files whose padded size its partition fills exactly, ties broken by the set whose ids span
as many parameters as the sub-group holds, then by ascending ids (sub-groups are cut in parameter order, and ids are
handed out in the order the model builds its parameters).  Every rank's folder holds the same names.

``attach(ckpt, states)`` puts references into those files where the rank files hold empty partitions, so every
reader (consolidate, reshard, convert, verify, stats) sees the masters and moments as if the rank files held them.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .layout import inside
from ..errors import ByteRangeError, InconsistentCheckpointError, MissingRankError, UnsafeCheckpointError
from ..formats.pickle_policy import StorageRef, TensorRef
from ..formats.torchzip import StorageLocation

OFFLOADED_DIR = "offloaded_tensors"
MASTER = "fp32"  # the key the masters' file goes under among a set's files (the others: the state's name)
SWAP_FILE_RE = re.compile(r"^(?:(?P<state>[A-Za-z_]\w*)-)?(?P<first>\d+)_(?P<last>\d+)\.tensor\.swp$")
AIO_ALIGNED_BYTES = 1024  # DeepSpeed's swap files are whole multiples of this times the aio intra-op parallelism
FP32 = 4


def rank_folder(tag_dir: Path, rank: int) -> Path:
    return tag_dir / OFFLOADED_DIR / f"rank{rank:02d}"


def has_offloaded(tag_dir: Path) -> bool:
    return (tag_dir / OFFLOADED_DIR).is_dir()


@dataclass(frozen=True)
class SwapSet:
    """One swapped sub-group's files in one rank's folder: masters (``MASTER``) and each state, by key."""

    first: int
    last: int
    files: dict[str, Path]
    size: int  # bytes of the masters' file

    @property
    def name(self) -> str:
        return f"{self.first}_{self.last}"


class SwapFile:
    """A raw swap file seen as a torch file holding one storage: what ``TensorRef.file`` needs (``path``,
    ``locate``).  No CRC is recorded for these files, so none is checked."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size

    def locate(self, storage: StorageRef) -> StorageLocation:
        need = storage.numel * storage.itemsize
        if self.size < need:
            raise ByteRangeError(f"holds {self.size} bytes; its sub-group's partition needs {need} (truncated?)",
                                 at=self.path)
        return StorageLocation(0, self.size, 0)

    def ref(self, numel: int) -> TensorRef:
        # "cpu": what a copy's rank file records for it (torch.load knows no "nvme" device)
        storage = StorageRef(key=self.path.name, dtype="F32", itemsize=FP32, numel=numel, location="cpu")
        self.locate(storage)
        return TensorRef(self, storage, 0, (numel,), (1,))


def swap_sets(folder: Path, root: Path) -> list[SwapSet]:
    """The swapped sub-groups' file sets of one rank's folder, ascending by ids."""
    sets: dict[tuple[int, int], dict[str, Path]] = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        match = SWAP_FILE_RE.match(entry.name)
        if not match:
            continue
        path = Path(entry.path)
        if path.is_symlink() and not inside(path.resolve(), root):
            raise UnsafeCheckpointError(f"a symlink to {path.resolve()}, outside the checkpoint; not read", at=path)
        if not path.is_file():
            raise InconsistentCheckpointError("is not a regular file", at=path)
        key = (int(match.group("first")), int(match.group("last")))
        sets.setdefault(key, {})[match.group("state") or MASTER] = path
    out = []
    for (first, last), files in sorted(sets.items()):
        if MASTER not in files:
            raise InconsistentCheckpointError(f"holds the optimizer state of sub-group {first}_{last} but not its "
                                              f"masters ({first}_{last}.tensor.swp)", at=folder)
        out.append(SwapSet(first, last, files, files[MASTER].stat().st_size))
    return out


def padded_bytes(numel: int, ds_config: Any) -> int:
    """The size DeepSpeed's swapper gives a partition of ``numel`` fp32 elements (``_io_aligned_numel``)."""
    aio = ds_config.get("aio", {}) if isinstance(ds_config, dict) else {}
    parallel = aio.get("intra_op_parallelism", aio.get("thread_count", 1)) if isinstance(aio, dict) else 1
    unit = AIO_ALIGNED_BYTES * max(1, int(parallel) if isinstance(parallel, int) else 1) // FP32
    return math.ceil(numel / unit) * unit * FP32


def match(needs: dict[int, tuple[int, int]], sets: list[SwapSet], ds_config: Any, folder: Path) -> dict[int, SwapSet]:
    """Sub-group -> its file set.  ``needs``: each swapped sub-group's (partition elements, parameter count)."""
    if len(needs) != len(sets):
        raise InconsistentCheckpointError(f"{len(needs)} sub-groups keep their masters on NVMe, but the folder holds "
                                          f"{len(sets)} sets of swap files", at=folder)
    free, out = list(sets), {}
    for group, (numel, params) in sorted(needs.items()):
        size = padded_bytes(numel, ds_config)
        fits = [s for s in free if s.size == size]
        if not fits:
            raise InconsistentCheckpointError(
                f"no swap file holds sub-group {group}'s {numel} masters ({size} bytes padded); sizes there: "
                f"{', '.join(f'{s.name}: {s.size}' for s in free)}", at=folder)
        chosen = min(fits, key=lambda s: (s.last - s.first + 1 != params, s.first))
        free.remove(chosen)
        out[group] = chosen
    return out


def attach(ckpt: Any, states: list[Any]) -> list[Any]:
    """``states`` (``optim_state.RankState``s) with each empty sub-group partition read from its rank's swap files
    (``ckpt``: the checkpoint, ZeRO-3).  Unchanged when the tag holds no ``offloaded_tensors``."""
    tag_dir = ckpt.layout.tag_dir
    if ckpt.zero_stage != 3 or not has_offloaded(tag_dir):
        return states
    shapes = ckpt.param_groups
    numels = [sum(math.ceil(math.prod(s) / ckpt.world_size) for s in group.values()) for group in shapes]
    head = ckpt.model_files[0].obj
    ds_config = head.get("ds_config") if isinstance(head, dict) else None
    every = _rank_sets(ckpt, states)
    out = []
    for state in states:
        if len(state.groups) != len(numels):
            raise InconsistentCheckpointError(f"the optimizer holds {len(state.groups)} sub-groups, the model states "
                                              f"record {len(numels)}", at=state.path)
        swapped = {g: (numels[g], len(shapes[g])) for g, group in enumerate(state.groups)
                   if group.fp32.numel == 0 and numels[g] > 0}
        folder, sets = rank_folder(tag_dir, state.rank), every.get(state.rank)
        if sets is None:
            if swapped:
                raise MissingRankError(f"rank {state.rank}'s swap folder is missing: {len(swapped)} sub-groups keep "
                                       "their masters and moments there", at=folder)
            out.append(state)
            continue
        kinds = {k for s in sets for k in s.files} | {k for g in state.groups if g.fp32.numel for k in g.moments}
        for found in sets:
            missing = sorted(kinds - set(found.files) - {MASTER})
            if missing:
                raise MissingRankError(f"sub-group {found.name}'s {missing[0]} is missing "
                                       f"({missing[0]}-{found.name}.tensor.swp)", at=folder)
        groups = list(state.groups)
        for g, found in match(swapped, sets, ds_config, folder).items():
            moments = {key: SwapFile(path, path.stat().st_size).ref(numels[g])
                       for key, path in found.files.items() if key != MASTER}
            groups[g] = replace(groups[g], fp32=SwapFile(found.files[MASTER], found.size).ref(numels[g]),
                                moments=dict(sorted(moments.items(), key=lambda kv: (not kv[0].startswith("exp_avg"),
                                                                                       kv[0]))))  # Adam's first
        out.append(replace(state, groups=tuple(groups)))
    return out


def _rank_sets(ckpt: Any, states: list[Any]) -> dict[int, list[SwapSet]]:
    """Each rank's file sets, by rank (ranks without a folder left out); every rank must hold the same names."""
    every = {s.rank: swap_sets(rank_folder(ckpt.layout.tag_dir, s.rank), ckpt.layout.root) for s in states
             if rank_folder(ckpt.layout.tag_dir, s.rank).is_dir()}
    names = {s.name: rank for rank, sets in sorted(every.items(), reverse=True) for s in sets}
    for rank, sets in every.items():
        missing = sorted(set(names) - {s.name for s in sets})
        if missing:
            raise MissingRankError(f"the swap files of sub-group {missing[0]} ({missing[0]}.tensor.swp and its "
                                   f"state) are missing; rank {names[missing[0]]} has them",
                                   at=rank_folder(ckpt.layout.tag_dir, rank))
    return every


def offloaded_files(tag_dir: Path) -> list[Path]:
    """Every swap file under the tag's ``offloaded_tensors`` (rank folders in order), for sizes and listings."""
    root = tag_dir / OFFLOADED_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("rank*/*") if SWAP_FILE_RE.match(p.name) and p.is_file())


def kind_of(path: Path) -> str:
    """``fp32`` for a masters' file, else the optimizer state it holds (``exp_avg``...)."""
    found = SWAP_FILE_RE.match(path.name)
    return (found.group("state") if found else None) or MASTER


def describe(ckpt: Any) -> dict[str, Any] | None:
    """What ``inspect`` says of a ZeRO-Infinity checkpoint: sub-groups on NVMe, bytes per rank and kind, the recorded
    ``nvme_path`` (which reading never needs); None when the optimizer was not offloaded to NVMe."""
    tag_dir = ckpt.layout.tag_dir
    files = offloaded_files(tag_dir)
    config = (ckpt.model_files[0].obj.get("ds_config") if isinstance(ckpt.model_files[0].obj, dict) else None) or {}
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
    offload: dict[str, dict[str, Any]] = {k: v for k in ("offload_optimizer", "offload_param")
                                          if isinstance(v := zero.get(k), dict)}
    on_nvme = [k for k, v in offload.items() if v.get("device") == "nvme"]
    if not files and not on_nvme:
        return None
    per_rank: dict[str, dict[str, int]] = {}
    for path in files:
        kinds = per_rank.setdefault(path.parent.name, {})
        kinds[kind_of(path)] = kinds.get(kind_of(path), 0) + path.stat().st_size
    swapped = sum(isinstance(g.fp32.file, SwapFile) for g in ckpt.optimizer_states[0].groups) \
        if ckpt.optim_files else 0
    return {"folder": OFFLOADED_DIR, "offloaded": on_nvme, "swapped_sub_groups": swapped,
            "sub_groups": len(ckpt.param_groups), "bytes": sum(p.stat().st_size for p in files),
            "per_rank": per_rank, "files": len(files),
            "nvme_path": next((v.get("nvme_path") for v in offload.values() if v.get("nvme_path")), None)}
