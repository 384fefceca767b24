"""The moves both reshard plans share (``plan.reshard``: another world size or expert-parallel size;
``plan.restage``: another ZeRO stage): which layouts a flat group has before and after, the segments of a target
rank's partition, the output file records and the checks that refuse what cannot be resharded.  Pure: the
checkpoint model in, plans out; no file is read.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ConfigError, InconsistentCheckpointError, UnsupportedCheckpointError
from ..formats.pickle_policy import Opaque, TensorRef, opaque_type
from ..formats.pickle_writer import NewTensor
from ..limits import limit
from ..zero import layout as L, slice_mappings
from ..zero.partitioning import GroupLayout, stage3_group
from ..zero.reader import Checkpoint
from ..zero.grid import BF16_PREFIX
from .groups import stage3_groups, stage12_groups
from .segments import FlatSpace, Piece, Segment, TensorSource, Zeros, merged

T = TypeVar("T")
FRAGMENT_ADDRESS = ("deepspeed.utils.tensor_fragment", "fragment_address")  # DeepSpeed's (numel, start) record


@dataclass(frozen=True)
class OutputFile:
    name: str  # file name inside the tag folder
    template: Path  # the source rank file whose tree this is
    tree: Any  # what to pickle: plain data, TensorRefs (copied whole) and NewTensors (source = segments)


@dataclass(frozen=True)
class GroupMove:
    """One flat group's layouts before and after (a group of experts: one per expert-parallel rank)."""
    names: tuple[str, ...]  # as the optimizer records them
    source: GroupLayout
    target: GroupLayout
    index: int = 0  # the optimizer's flat group
    source_ranks: tuple[int, ...] | None = None  # the ranks holding its partitions at N, in order (None: all)
    target_ranks: tuple[int, ...] | None = None  # ... at M
    source_params: tuple[int, ...] | None = None  # per target parameter, its index in ``source`` (None: the same)
    # ZeRO-3 sub-groups cut anew: the source sub-groups whose partitions, joined in order, ``source`` lays out (None:
    # the one at ``index``)
    source_groups: tuple[int, ...] | None = None

    def position(self, rank: int) -> int:
        """``rank``'s place among the target ranks (its partition of this group)."""
        return self.target_ranks.index(rank) if self.target_ranks is not None else rank


@dataclass(frozen=True)
class ReshardPlan:
    stage: int
    source_world_size: int
    world_size: int
    tag: str
    groups: tuple[GroupMove, ...]
    files: tuple[OutputFile, ...]


def check_reshardable(ckpt: Checkpoint, world_size: int, ep_size: int | None = None) -> None:
    where = ckpt.layout.tag_dir
    if ep_size is not None and not ckpt.experts:
        raise ConfigError(f"--ep-size {ep_size}: {where} is not a mixture-of-experts checkpoint")
    if type(world_size) is not int or not 1 <= world_size <= limit("MAX_WORLD_SIZE"):
        raise ConfigError(f"world size {world_size!r}: expected a whole number of data-parallel ranks, 1 to "
                          f"{limit('MAX_WORLD_SIZE'):,}")
    if ckpt.universal:
        raise UnsupportedCheckpointError("a universal checkpoint (ds_to_universal's output) is not split by "
                                         "world size", hint="DeepSpeed loads it at any world size with "
                                         "checkpoint.load_universal; dsckpt consolidate reads it", at=where)
    for layer in ckpt.experts.layers if ckpt.experts else ():
        new = ep_size or layer.ep_size
        if world_size % new or layer.num_experts % new or (type(new) is not int or new < 1):
            raise UnsupportedCheckpointError(
                f"MoE layer {layer.index} ({layer.prefix}) has {layer.num_experts} experts at ep_size {new}, "
                f"which world size {world_size} is not a multiple of (or which does not divide the experts)",
                hint="an ep_size must divide the world size and the number of experts (--ep-size changes it)", at=where)
    if ckpt.zero_stage == 0:
        raise UnsupportedCheckpointError("a ZeRO-0 checkpoint is not partitioned; DeepSpeed loads it "
                                         "at any world size as it is", hint="use it directly", at=where)
    if ckpt.zero_stage not in (1, 2, 3):
        raise UnsupportedCheckpointError(f"ZeRO stage {ckpt.zero_stage} is not one dsckpt can reshard", at=where)
    for tf in ckpt.optim_files:
        osd = tf.obj[L.OPTIMIZER_STATE_DICT]
        if ckpt.zero_stage != 3 and (not isinstance(osd.get(L.BASE_OPTIMIZER_STATE), dict)
                                     or L.ELASTIC_OPTIMIZER_STATE_STEP in osd):
            raise UnsupportedCheckpointError("elastic ZeRO optimizer state (zero_optimization."
                                             "elastic_checkpoint) is not supported by reshard yet", at=tf.path)


# --- step 2: layouts ------------------------------------------------------------------------------
def stage12_moves(ckpt: Checkpoint, world_size: int, ep_size: int | None = None) -> list[GroupMove]:
    moves, flat = [], stage12_groups(ckpt)
    for group in flat:
        problem = slice_mappings.mismatch(ckpt, group.index, list(group.recorded), group.layout, group.ranks)
        if problem:  # round_robin_gradients: its order at M differs from the one at N (see slice_mappings)
            raise UnsupportedCheckpointError(problem + "; the flat buffer is in round_robin_gradients order, which "
                                             "depends on the world size", hint="reshard does not support it yet; "
                                             "consolidate and a resume at the same world size do")
    for g in sorted({group.index for group in flat}):
        mine = [group for group in flat if group.index == g]
        experts = ckpt.experts
        if ep_size is not None and experts is not None and g in experts.groups and ep_size != experts.groups[g]:
            moves += _moved_experts(ckpt, mine, ep_size, world_size)
            continue
        moves += [GroupMove(group.recorded, group.layout, group.at(world_size), group.index, group.ranks,
                            group.ranks_at(world_size)) for group in mine]
    return moves


def _moved_experts(ckpt: Checkpoint, groups: list[Any], ep_size: int, world_size: int) -> list[GroupMove]:
    """One expert group at another ep_size (``plan.experts``): per new ep rank, its experts from wherever they were."""
    from .experts import joined_source, moved_expert_groups

    layers = {layer.prefix: layer.num_experts for layer in (ckpt.experts.layers if ckpt.experts else ())
              if layer.group == groups[0].index}
    source, source_ranks = joined_source(groups)
    return [GroupMove(names, source, target, groups[0].index, source_ranks, ranks, sources)
            for names, target, ranks, sources in moved_expert_groups(groups, layers, ep_size, world_size,
                                                                     ckpt.layout.tag_dir)]


def stage3_moves(ckpt: Checkpoint, world_size: int) -> list[GroupMove]:
    """The sub-groups at N laid out at M; where DeepSpeed cuts them differently at M (``sub_group_size`` counts a
    rank's elements), each new sub-group takes its parameters from the source sub-groups of its param group, joined:
    at ZeRO-3 every parameter is split on its own, so a joined partition is the parts of all of them in order."""
    groups = stage3_groups(ckpt)
    cut = _sub_groups_at(ckpt, [g.names for g in groups], world_size)
    if cut is None:
        return [GroupMove(g.names, g.layout, g.at(world_size), g.index) for g in groups]
    owner = [state.param_group for state in ckpt.optimizer_states[0].groups]
    moves: list[GroupMove] = []
    for param_group, names in cut:
        joined = [g for g in groups if owner[g.index] == param_group]
        order = [n for g in joined for n in g.names]
        shapes = {n: s for g in joined for n, s in zip(g.names, g.shapes)}
        source = stage3_group([math.prod(shapes[n]) for n in order], ckpt.world_size)
        target = stage3_group([math.prod(shapes[n]) for n in names], world_size)
        moves.append(GroupMove(names, source, target, len(moves), source_params=tuple(order.index(n) for n in names),
                               source_groups=tuple(g.index for g in joined)))
    return moves


DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default


def stage3_sub_groups(groups: list[dict[str, tuple[int, ...]]], world_size: int, sub_group_size: int
                      ) -> list[tuple[str, ...]]:
    """DeepSpeed's ZeRO-3 cut (``_create_fp16_sub_groups``), per optimizer param group: parameters in order
    until their *partition* sizes reach ``sub_group_size`` - so where it cuts depends on the world size."""
    out = []
    for shapes in groups:
        parts = {n: math.ceil(math.prod(s) / world_size) for n, s in shapes.items()}
        if sub_group_size >= sum(parts.values()):
            out.append(tuple(shapes))
            continue
        current, size, last = [], 0, next(reversed(shapes))
        for name in shapes:
            current.append(name)
            size += parts[name]
            if size >= sub_group_size or name == last:
                out.append(tuple(current))
                current, size = [], 0
    return out


def _sub_groups_at(ckpt: Checkpoint, source: list[tuple[str, ...]], world_size: int
                   ) -> list[tuple[int, tuple[str, ...]]] | None:
    """Where DeepSpeed cuts the sub-groups at ``world_size`` - (param group, names) each - when that differs from
    the checkpoint's cut; None when it does not (or the size recorded is none DeepSpeed would run with)."""
    config = ckpt.model_files[0].obj.get(L.DS_CONFIG)
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    size = zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE) if isinstance(zero, dict) else DEFAULT_SUB_GROUP_SIZE
    if not isinstance(size, (int, float)) or isinstance(size, bool) or size <= 0:
        return None  # not a size DeepSpeed would run with; the recovered groups stand
    # ZeRO-3 records param_shapes per sub-group; the optimizer's own param groups list their sub-groups
    torch_groups = ckpt.optim_files[0].obj[L.OPTIMIZER_STATE_DICT][L.OPTIMIZER_STATE_DICT]["param_groups"]
    groups = [{n: s for k in g["params"] for n, s in ckpt.param_groups[k].items()} for g in torch_groups]
    at_n = stage3_sub_groups(groups, ckpt.world_size, int(size))
    if at_n != source and len(source) > 1:
        raise UnsupportedCheckpointError(
            f"{len(source)} ZeRO-3 sub-groups, not where DeepSpeed 0.19.8 cuts them "
            f"(sub_group_size {int(size):,}: {len(at_n)}); not supported yet", at=ckpt.optim_files[0].path)
    if stage3_sub_groups(groups, world_size, int(size)) == at_n:
        return None
    return [(i, names) for i, group in enumerate(groups) for names in stage3_sub_groups([group], world_size, int(size))]


# --- step 3: segments -----------------------------------------------------------------------------
def partition_segments(move: GroupMove, rank: int, spaces: list[FlatSpace], length: int,
                       where: str) -> tuple[Piece, ...]:
    """Target ``rank``'s first ``length`` elements of the group: parameters' elements read from the
    source ranks' ``spaces``, padding between and after them as zeros."""
    itemsize = spaces[0].itemsize
    out: list[Piece] = []
    pos = 0
    for i, spans in enumerate(move.target.params):
        for span in spans:
            if span.rank != rank:
                continue
            if span.rank_start > pos:
                out.append(Zeros((span.rank_start - pos) * itemsize))
            source = move.source_params[i] if move.source_params is not None else i
            out += _param_range(move.source, source, span.param_start, span.count, spaces, where)
            pos = span.rank_start + span.count
    if pos > length:
        raise InconsistentCheckpointError(f"rank {rank} needs {pos} elements but keeps {length}", at=where)
    if length > pos:
        out.append(Zeros((length - pos) * itemsize))
    return merged(out)


def _param_range(source: GroupLayout, index: int, start: int, count: int, spaces: list[FlatSpace],
                 where: str) -> list[Segment]:
    """Elements ``[start, start + count)`` of parameter ``index``, from the source ranks holding them."""
    out = []
    for span in source.params[index]:
        lo, hi = max(start, span.param_start), min(start + count, span.param_start + span.count)
        if lo < hi:
            out += spaces[span.rank].pieces(span.rank_start + lo - span.param_start, hi - lo, where)
    return out


def new_tensor(like: TensorRef, numel: int, pieces: tuple[Piece, ...]) -> NewTensor:
    return NewTensor(like.dtype, (numel,), TensorSource(like.dtype, like.dtype, pieces), like.requires_grad,
                     like.storage.location)


# --- step 4: files ---------------------------------------------------------------------------------
def template_file(files: list[T], rank: int) -> T:
    """Source rank r for target rank r; ranks beyond the source's take the last one's non-partition state."""
    return files[min(rank, len(files) - 1)]


def is_bf16(path: Path) -> bool:
    """The source file carries the bf16 optimizer's prefix, so its rewrite does too."""
    return path.name.startswith(BF16_PREFIX)


def state_tensor(ckpt: Checkpoint, rank: int, group: int, key: str, move: GroupMove) -> TensorRef:
    numel = move.source.partition_numel if move.source_groups is None else \
        ckpt.optimizer_states[rank].groups[group].fp32.numel  # (one of the joined sub-groups: its own size)
    held = ckpt.optimizer_states[rank].groups[group].moments.get(key)  # (a ZeRO-Infinity run's: in its swap file)
    if isinstance(held, TensorRef) and held.numel == numel:
        return held
    osd = ckpt.optim_files[rank].obj[L.OPTIMIZER_STATE_DICT]
    torch_state = osd[L.OPTIMIZER_STATE_DICT] if ckpt.zero_stage == 3 else osd[L.BASE_OPTIMIZER_STATE]
    ref = torch_state["state"][group][key]
    if not isinstance(ref, TensorRef) or ref.numel != numel:
        raise UnsupportedCheckpointError(
            f"optimizer state {key!r} of group {group} is neither per element "
            f"({numel} elements) nor a scalar; dsckpt cannot split it", at=ckpt.optim_files[rank].path)
    return ref


def slice_mappings_at(move: GroupMove, rank: int, existing: list[Any]) -> dict[str, Any]:
    """``param_slice_mappings``: name -> fragment_address(numel, start) of each parameter piece on ``rank``."""
    kind = next((v for group in existing for v in group.values() if isinstance(v, Opaque)), None)
    cls = type(kind) if kind is not None else opaque_type(*FRAGMENT_ADDRESS)
    out = type(existing[0])() if existing else {}
    for name, spans in zip(move.names, move.target.params):
        for span in spans:
            if span.rank == rank and span.count:
                address = cls.__new__(cls)
                address.state = {"numel": span.count, "start": span.rank_start}
                out[name] = address
    return out


def copy_tree(tree: Any) -> Any:
    """Containers copied, leaves (TensorRefs, opaque records, scalars) shared: the source is never edited."""
    if type(tree) in (dict, OrderedDict):
        return type(tree)((k, copy_tree(v)) for k, v in tree.items())
    if type(tree) is list:
        return [copy_tree(v) for v in tree]
    if type(tree) is tuple:
        return tuple(copy_tree(v) for v in tree)
    return tree
