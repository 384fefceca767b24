"""DeepSpeed-MoE checkpoints: which files and optimizer groups hold the experts, and how their ids map.

``deepspeed.moe.layer.MoE(hidden, expert, num_experts=N, ep_size=E)`` at data-parallel world size W, in
DeepSpeed's default E + D topology (``groups._create_expert_and_data_parallel``; measured with 0.19.8):
* rank r is expert-parallel rank ``r % E`` and expert-data-parallel (edp) rank ``r // E``; an edp group is
  the W / E ranks of one ep rank;
* a layer's N experts are split over the ep ranks: ep rank e holds global ids ``e * N/E ... (e+1) * N/E - 1``,
  named by *local* ids ``...deepspeed_experts.{0..N/E-1}...`` inside its module;
* the model-states file's ``module`` leaves the experts out; ``layer_{L}_expert_{G}_mp_rank_00_model_states.pt``
  holds expert G of the L-th MoE layer (global names, the trained dtype);
* ZeRO-0 writes the optimizer of each ep rank's experts to ``expp_rank_{e}_mp_rank_00_optim_states.pt``;
* the optimizer keeps experts in param groups of their own (``moe: True``, named ``ep_size_{E}``),
  partitioned over the edp group (``partition_count`` W / E for those groups); ``param_shapes`` - rank 0's -
  names them by rank 0's local ids.
The same model built at ``ep_size=1`` names every expert by its global id: that is what dsckpt writes.
(DeepSpeed's other topology, ``use_data_before_expert_parallel_``, is not recorded in the checkpoint and
would place experts differently; it is not supported.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UnsupportedCheckpointError
from . import layout as L

EXPERTS_MARK = ".deepspeed_moe.experts.deepspeed_experts."  # between a layer's path and an expert's local id
LOCAL_ID = re.compile(re.escape(EXPERTS_MARK) + r"(\d+)\.")
EP_GROUP_NAME = re.compile(r"^ep_size_(\d+)$")  # the optimizer param group DeepSpeed builds for one ep_size
NUM_EXPERTS = "num_experts"  # model-states key: experts per MoE layer, in layer order


@dataclass(frozen=True)
class MoeLayer:
    index: int  # L in layer_{L}_expert_{G}
    prefix: str  # the layer's module path ("blocks.3.moe")
    num_experts: int
    ep_size: int
    files: tuple[Path, ...]  # by global expert id
    group: int | None  # the optimizer param group holding its experts' fp32 masters

    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expert 0's parameters (every expert of a layer has the same), read from its file's header."""
        from ..formats.pickle_policy import TensorRef
        from ..formats.torchzip import TorchFile

        obj = TorchFile(self.files[0]).obj
        return {str(k): v.shape for k, v in obj.items() if isinstance(v, TensorRef)} if isinstance(obj, dict) else {}

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size


@dataclass(frozen=True)
class Experts:
    layers: tuple[MoeLayer, ...]
    groups: dict[int, int]  # optimizer param group index -> ep_size

    def layer_of(self, name: str) -> MoeLayer | None:
        prefix = name.split(EXPERTS_MARK, 1)[0] if EXPERTS_MARK in name else None
        return next((layer for layer in self.layers if layer.prefix == prefix), None)

    def global_name(self, local_name: str, ep_rank: int) -> str:
        """``local_name`` as ep rank ``ep_rank`` names it, under the expert's global id."""
        layer = self.layer_of(local_name)
        match = LOCAL_ID.search(local_name)
        if layer is None or match is None:
            raise ValueError(f"{local_name!r} is no expert parameter of this checkpoint")
        global_id = ep_rank * layer.local_experts + int(match.group(1))
        return f"{local_name[:match.start(1)]}{global_id}{local_name[match.end(1):]}"


def is_expert(name: str) -> bool:
    return EXPERTS_MARK in name


def read_experts(tag_dir: Path, expert_files: tuple[Path, ...], head: dict[str, Any], param_groups: list[dict[str, Any]],
                 optimizer_groups: list[dict[str, Any]], world_size: int) -> Experts:
    """The experts of a DeepSpeed-MoE checkpoint, checked against each other; an unsupported shape of run
    is a typed error naming what differs."""
    where = tag_dir
    files: dict[int, dict[int, Path]] = {}
    for path in expert_files:
        if L.EXPERT_OPTIM_FILE_RE.match(path.name):
            continue  # ZeRO-0's optimizer of one ep rank's experts (the weights are in the expert files)
        match = L.EXPERT_MODEL_FILE_RE.match(path.name)
        if not match or match.group("layer") is None:
            raise UnsupportedCheckpointError("an expert file of an older DeepSpeed layout; not supported", at=path)
        files.setdefault(int(match.group("layer")), {})[int(match.group("expert"))] = path
    counts = head.get(NUM_EXPERTS)
    if not isinstance(counts, list) or not all(isinstance(c, int) and c > 0 for c in counts):
        raise UnsupportedCheckpointError(f"expert files but no '{NUM_EXPERTS}' list in the model states", at=where)
    groups: dict[int, int] = {}
    for g, group in enumerate(optimizer_groups):
        if isinstance(group, dict) and group.get("moe"):
            match = EP_GROUP_NAME.match(str(group.get("name", "")))
            if not match:
                raise UnsupportedCheckpointError(f"optimizer group {g} holds experts under the name "
                                                 f"{group.get('name')!r}, not DeepSpeed's ep_size_<E>", at=where)
            groups[g] = int(match.group(1))
    prefixes: dict[str, tuple[int, int | None]] = {}  # layer path -> (ep_size, optimizer group), in module order
    for g, shapes in enumerate(param_groups):
        for name in shapes:
            if is_expert(name):
                if g not in groups:
                    raise UnsupportedCheckpointError(f"expert parameter {name!r} sits in optimizer group {g}, "
                                                     "which is not an expert group (moe: True)", at=where)
                prefixes.setdefault(name.split(EXPERTS_MARK, 1)[0], (groups[g], g))
    if not prefixes and not any(param_groups):  # ZeRO-0 records no param_shapes: the expert files name their layer
        prefixes = _prefixes_from_files(where, files, groups)
    if len(prefixes) != len(counts) or sorted(files) != list(range(len(counts))):
        raise UnsupportedCheckpointError(
            f"{len(counts)} MoE layers recorded, {len(prefixes)} with trainable experts in the optimizer, "
            f"expert files for {len(files)}; frozen or untrained experts are not supported", at=where)
    layers = []
    for index, ((prefix, (ep_size, owner)), n) in enumerate(zip(prefixes.items(), counts)):
        if n % ep_size or world_size % ep_size or sorted(files[index]) != list(range(n)):
            raise UnsupportedCheckpointError(
                f"MoE layer {index} ({prefix}): {n} experts, ep_size {ep_size}, world size {world_size}, "
                f"expert files {sorted(files[index])}: not a layout DeepSpeed writes", at=where)
        layers.append(MoeLayer(index, prefix, n, ep_size, tuple(files[index][e] for e in range(n)), owner))
    return Experts(tuple(layers), groups)


def _prefixes_from_files(where: Path, files: dict[int, dict[int, Path]],
                         groups: dict[int, int]) -> dict[str, tuple[int, int | None]]:
    from ..formats.torchzip import TorchFile

    sizes = set(groups.values()) or {1}
    if len(sizes) > 1:
        raise UnsupportedCheckpointError(f"expert groups of several ep_sizes ({sorted(sizes)}) and no "
                                         "param_shapes to tell which layer uses which; not supported", at=where)
    prefixes = {}
    for index in sorted(files):
        first = next(iter(files[index].values()))
        obj = TorchFile(first).obj
        name = next((str(k) for k in obj if is_expert(str(k))), None) if isinstance(obj, dict) else None
        if name is None:
            raise UnsupportedCheckpointError("holds no expert parameter names", at=first)
        prefixes[name.split(EXPERTS_MARK, 1)[0]] = (next(iter(sizes)), next(iter(groups), None))
    return prefixes


def edp_ranks(ep: int, ep_size: int, world_size: int) -> tuple[int, ...]:
    """The ranks of ep rank ``ep``'s expert-data-parallel group, in edp-rank order."""
    return tuple(range(ep, world_size, ep_size))


def check_stage(stage: int, precision: str, where: Path) -> None:
    if stage == 3:
        raise UnsupportedCheckpointError("a ZeRO-3 mixture-of-experts checkpoint; not supported yet", at=where)
    if stage == 0 and precision != "fp32":
        raise UnsupportedCheckpointError(f"a ZeRO-0 {precision} mixture-of-experts checkpoint (its fp32 "
                                         "masters of experts sit in the optimizer's own record); not supported yet", at=where)

