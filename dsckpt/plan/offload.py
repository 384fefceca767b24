"""A reshard plan for an engine that keeps its optimizer on NVMe (``reshard --offload nvme``): pure bookkeeping.

DeepSpeed's own NVMe load copies ``<tag>/offloaded_tensors/rankNN/`` into the engine's swap folder, where the
swapper looks for each sub-group it swaps under ``<first>_<last>.tensor.swp`` (and ``<state>-<first>_<last>``):
the ds_ids of the sub-group's first and last parameter, raw fp32 padded to the aio alignment (``zero.offloaded``).
``for_nvme(plan, ckpt)`` turns the plan's ZeRO-3 optimizer files into that layout:
1. per target sub-group, whether DeepSpeed swaps it at the new world size: its partition reaches
   ``max(MIN_AIO_BYTES, aio.block_size)`` (``swap_threshold``);
2. its files' name: ds_ids are the live engine's, and a checkpoint records them only in its own swap files' names,
   so a swapped sub-group is named when it holds exactly the parameters of a sub-group the source swapped
   (the same cut), and refused otherwise;
3. per target rank, the masters and every per-element state of each swapped sub-group become ``OutputFile``s of
   their own (``is_swap_file``), padded with zeros; the rank file keeps them empty, as DeepSpeed saves them.
"""
from __future__ import annotations

import enum
import math
from dataclasses import replace
from typing import Any

from ..errors import UnsupportedCheckpointError
from ..formats.pickle_writer import NewTensor
from ..zero import layout as L
from ..zero.offloaded import OFFLOADED_DIR, SwapFile, padded_bytes
from ..zero.reader import Checkpoint
from .groups import stage3_groups
from .moves import OutputFile, ReshardPlan, copy_tree
from .segments import TensorSource, Zeros



class TargetOffload(str, enum.Enum):
    """Where the engine that loads a written copy keeps its optimizer state (CPU: also an engine without offload)."""
    CPU = "cpu"
    NVME = "nvme"


MIN_AIO_BYTES = 1 << 20  # DeepSpeed's swapper swaps no partition below this (optimizer_utils.MIN_AIO_BYTES)
SWAP_SUFFIX = ".tensor.swp"


def is_swap_file(name: str) -> bool:
    """A plan file written raw (a swap file), not pickled."""
    return name.endswith(SWAP_SUFFIX)


def swap_rank(name: str) -> int | None:
    """The target rank whose swap folder holds ``name`` (``[<tag>/]offloaded_tensors/rankNN/<file>``), else None."""
    parts = name.split("/")[-3:]
    if len(parts) == 3 and parts[0] == OFFLOADED_DIR and parts[1].startswith("rank") and parts[1][4:].isdigit():
        return int(parts[1][4:])
    return None


def swap_threshold(ckpt: Checkpoint) -> int:
    """The partition bytes from which the engine swaps a sub-group; a source that swapped a smaller partition ran
    with DeepSpeed's MIN_AIO_BYTES lowered, leaving the aio block size as the bound."""
    aio = _config(ckpt).get("aio")
    block = aio.get("block_size", MIN_AIO_BYTES) if isinstance(aio, dict) else MIN_AIO_BYTES
    block = block if isinstance(block, int) and block > 0 else MIN_AIO_BYTES
    swapped = [g.fp32.numel * 4 for g in ckpt.optimizer_states[0].groups if isinstance(g.fp32.file, SwapFile)]
    return block if swapped and min(swapped) < MIN_AIO_BYTES else max(MIN_AIO_BYTES, block)


def require_stage3(stage: int, ckpt: Checkpoint) -> None:
    if stage != 3:
        raise UnsupportedCheckpointError(f"--offload nvme: DeepSpeed keeps the optimizer on NVMe at ZeRO-3 only, and "
                                         f"the copy is ZeRO-{stage}", at=ckpt.layout.tag_dir)


def for_nvme(plan: ReshardPlan, ckpt: Checkpoint, threshold: int | None = None) -> ReshardPlan:
    """``plan`` (ZeRO-3) with every sub-group the target engine swaps moved into its swap files (module docstring);
    ``threshold``: the partition bytes from which it swaps (default: ``swap_threshold``)."""
    require_stage3(plan.stage, ckpt)
    names = _source_names(ckpt)
    cut = {g.names for g in stage3_groups(ckpt)}
    threshold, config = threshold or swap_threshold(ckpt), _config(ckpt)
    swapped: dict[int, str] = {}
    for g, move in enumerate(plan.groups):
        if move.target.partition_numel * 4 < threshold:
            continue
        name = names.get(move.names)
        if name is None:
            ranks = f"{plan.world_size} rank" + "s" * (plan.world_size != 1)
            why = f"is cut differently at {ranks}" if move.names not in cut else \
                f"was kept in memory at {plan.source_world_size}"
            raise UnsupportedCheckpointError(
                f"--offload nvme: at {ranks} DeepSpeed swaps sub-group {g} ({move.names[0]} to {move.names[-1]}, "
                f"{len(move.names)} parameters) to NVMe, in files named after the ds_ids of its first and last "
                f"parameter; the live engine hands those out, and this checkpoint names only the sub-groups it swapped "
                f"itself - this one {why}", at=ckpt.layout.tag_dir,
                hint="reshard without --offload and load the copy with dsckpt (enable_async_save(engine)."
                     "load_checkpoint, or dsckpt resume), which fills the engine's swap files itself")
        swapped[g] = name
    if not swapped:
        return plan
    files: list[OutputFile] = []
    for f in plan.files:
        if not f.name.endswith(L.OPTIM_STATES_SUFFIX):
            files.append(f)
            continue
        rank, tree = _rank_of(f.name), copy_tree(f.tree)
        osd = tree[L.OPTIMIZER_STATE_DICT]
        flats, states = list(osd[L.FP32_FLAT_GROUPS]), osd[L.OPTIMIZER_STATE_DICT].get("state", {})
        folder = f"{OFFLOADED_DIR}/rank{rank:02d}"
        for g, name in swapped.items():
            numel = plan.groups[g].target.partition_numel
            files.append(OutputFile(f"{folder}/{name}{SWAP_SUFFIX}", f.template, _padded(flats[g], numel, config)))
            flats[g] = _empty(flats[g])
            for key, value in list(states.get(g, {}).items()):
                if isinstance(value, NewTensor) and math.prod(value.shape) == numel:
                    files.append(OutputFile(f"{folder}/{key}-{name}{SWAP_SUFFIX}", f.template,
                                            _padded(value, numel, config)))
                    states[g][key] = _empty(value)
        osd[L.FP32_FLAT_GROUPS] = flats
        files.append(replace(f, tree=tree))
    return replace(plan, files=tuple(files))


def _source_names(ckpt: Checkpoint) -> dict[tuple[str, ...], str]:
    """The parameters of each sub-group the source swapped -> its swap files' name (``<first>_<last>``)."""
    groups = ckpt.optimizer_states[0].groups
    return {g.names: groups[g.index].fp32.file.path.name[:-len(SWAP_SUFFIX)] for g in stage3_groups(ckpt)
            if isinstance(groups[g.index].fp32.file, SwapFile)}


def _padded(value: Any, numel: int, config: dict[str, Any]) -> NewTensor:
    if value.dtype != "F32":
        raise UnsupportedCheckpointError(f"--offload nvme: DeepSpeed swaps fp32 optimizer state; this holds "
                                         f"{value.dtype}")
    padded = padded_bytes(numel, config) // 4
    pieces = tuple(value.source.pieces) + ((Zeros((padded - numel) * 4),) if padded > numel else ())
    return NewTensor("F32", (padded,), TensorSource("F32", "F32", pieces))


def _empty(value: Any) -> NewTensor:
    return NewTensor(value.dtype, (0,), TensorSource(value.dtype, value.dtype, ()), value.requires_grad,
                     value.location)


def _rank_of(name: str) -> int:
    match = L.RANK_FILE_RE.match(name)
    if match is None or match.group("dp") is None:
        raise ValueError(f"not a rank file: {name}")
    return int(match.group("dp"))


def _config(ckpt: Checkpoint) -> dict[str, Any]:
    config = ckpt.model_files[0].obj.get(L.DS_CONFIG) if isinstance(ckpt.model_files[0].obj, dict) else None
    return config if isinstance(config, dict) else {}
