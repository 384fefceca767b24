"""The reshard plan: every file of a native DeepSpeed checkpoint for another data-parallel world size.

``build_reshard_plan(ckpt, M)`` is pure bookkeeping over the checkpoint model (no file access): it
returns, per output file, the object tree to pickle - the matching source rank file's tree with its
partitions swapped for ``NewTensor``s whose bytes are lists of source byte ranges and zero fills.
Steps:
1. refuse what cannot be resharded (stage 0, elastic optimizer state, a world size out of range);
2. per flat group, the source layout at N and the target layout at M (``partitioning``): stage 1/2
   per param group; stage 3 per sub-group, each parameter split on its own;
3. per target rank r and group: the segments of the fp32 partition and of every per-element optimizer
   state (Adam's ``exp_avg`` / ``exp_avg_sq``, any optimizer's like them), zero padding included;
   stage 3 frozen parameters' fragments the same way;
4. per target file (named for its TP rank or pipeline stage: such a checkpoint is planned one rank's or
   stage's files at a time, a pipeline's layer files copied as they are): the tree of source rank ``min(r, N - 1)`` (its client state, loss scaler, step
   counts, hyper-parameters, config) with the partitions, ``partition_count``, ``group_paddings``,
   ``param_slice_mappings`` and ``dp_world_size`` rewritten for M.

What DeepSpeed 0.19.8 checks on load, and what this plan therefore makes exact: the fp32 partition
sizes (the last rank's trimmed by its ``group_paddings`` at stage 1/2), moment sizes equal to the
partition, ``dp_world_size`` equal to the loading job's, and one optimizer file per rank.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

from ..errors import UnsupportedCheckpointError
from ..formats.pickle_policy import TensorRef
from ..formats.pickle_writer import NewTensor
from ..formats.torchzip import TorchFile
from ..zero import layout as L
from ..zero.partitioning import stage3_group, stage12_trimmed
from ..zero.reader import Checkpoint
from ..zero.grid import Coord, rank_file_name
from .groups import structure_errors
from .moves import (GroupMove, OutputFile, ReshardPlan, check_reshardable, copy_tree, is_bf16,
                    new_tensor, partition_segments, slice_mappings_at, stage3_moves, stage12_moves, state_tensor,
                    template_file)
from .joins import outermost
from .restage import restaged
from .segments import FlatSpace


def build_reshard_plan(ckpt: Checkpoint, world_size: int, stage: int | None = None,
                       ep_size: int | None = None) -> ReshardPlan:
    """The one reshard plan: ``ckpt`` at data-parallel ``world_size`` (see the module docstring), at ZeRO ``stage``
    (default its own; another one: ``plan.restage``) and, for a mixture-of-experts run, expert-parallel size
    ``ep_size`` (``plan.experts``; default its own, same stage only)."""
    ckpt.require_complete(tensor_parallel=True, pipeline=True)
    if ckpt.pp_slices and stage not in (None, 0, 1):
        raise UnsupportedCheckpointError(f"a pipeline run at ZeRO-{stage}: DeepSpeed's "
                                         "pipeline engine runs ZeRO 0 and 1 only", at=ckpt.layout.tag_dir)
    join = outermost(ckpt)
    if join is not None:  # each slice's files moved on their own (plan.joins): the split is the same at any DP size
        plans = [build_reshard_plan(s, world_size, stage, ep_size) for s in join.slices(ckpt)]
        layers = [OutputFile(path.name, path, copy_tree(TorchFile(path).obj)) for path in ckpt.layout.pipeline_files]
        return replace(plans[0], groups=tuple(g for p in plans for g in p.groups),
                       files=tuple(f for p in plans for f in p.files) + tuple(layers))
    if stage is None or stage == ckpt.zero_stage:
        return _same_stage(ckpt, world_size, ep_size)
    same = _same_stage(ckpt, world_size, None) if ckpt.zero_stage in (1, 2) and stage in (1, 2) else None
    return restaged(ckpt, world_size, stage, same)


def _same_stage(ckpt: Checkpoint, world_size: int, ep_size: int | None) -> ReshardPlan:
    check_reshardable(ckpt, world_size, ep_size)
    with structure_errors(ckpt):
        groups = stage3_moves(ckpt, world_size) if ckpt.zero_stage == 3 else \
            stage12_moves(ckpt, world_size, ep_size)
        files = [_model_file(ckpt, world_size, r, groups) for r in range(world_size if ckpt.zero_stage == 3 else 1)]
        files += [_optim_file(ckpt, groups, world_size, r) for r in range(world_size)]
        files += _expert_files(ckpt)
    return ReshardPlan(ckpt.zero_stage, ckpt.world_size, world_size, ckpt.layout.tag, tuple(groups), tuple(files))


def _model_file(ckpt: Checkpoint, world_size: int, rank: int, moves: Sequence[GroupMove] = ()) -> OutputFile:
    tf = template_file(ckpt.model_files, rank)
    tree = copy_tree(tf.obj)
    tree[L.DP_WORLD_SIZE] = world_size
    moved = {m.index: m.names for m in moves if m.source_params is not None and 0 in (m.target_ranks or ())}
    if moved:  # experts at another ep_size: rank 0's param_shapes name ep rank 0's new local experts
        from .experts import rewritten_shapes

        tree[L.PARAM_SHAPES] = rewritten_shapes(tree[L.PARAM_SHAPES], moved, ckpt.trainable)
    if any(m.source_groups is not None for m in moves):  # ZeRO-3 records the shapes per sub-group
        kind = type(tree[L.PARAM_SHAPES][0]) if tree[L.PARAM_SHAPES] else dict
        tree[L.PARAM_SHAPES] = [kind((n, ckpt.trainable[n]) for n in m.names) for m in moves]
    if ckpt.zero_stage == 3:
        name = rank_file_name("model", Coord(tp=ckpt.tp_rank, dp=rank))
        fragments = ckpt.frozen_fragments
        if fragments:
            tree[L.FROZEN_PARAM_FRAGMENTS] = type(tree[L.FROZEN_PARAM_FRAGMENTS])(
                (n, _frozen_fragment(ckpt, fragments, n, world_size, rank)) for n in ckpt.frozen)
    else:
        name = tf.path.name
    return OutputFile(name, tf.path, tree)


def _expert_files(ckpt: Checkpoint) -> list[OutputFile]:
    """A mixture-of-experts run's expert files: named by global id, so the same at any world size (same ep_size)."""
    return [OutputFile(path.name, path, copy_tree(TorchFile(path).obj))
            for layer in (ckpt.experts.layers if ckpt.experts else ()) for path in layer.files]


def _frozen_fragment(ckpt: Checkpoint, fragments: Any, name: str, world_size: int, rank: int) -> NewTensor:
    n = math.prod(ckpt.frozen[name])
    move = GroupMove((name,), stage3_group([n], ckpt.world_size), stage3_group([n], world_size))
    spaces = [FlatSpace([f[name]]) for f in fragments]
    where = f"{ckpt.layout.tag_dir}: frozen {name!r}"
    return new_tensor(fragments[0][name], move.target.partition_numel,
                       partition_segments(move, rank, spaces, move.target.partition_numel, where))


def _optim_file(ckpt: Checkpoint, moves: list[GroupMove], world_size: int, rank: int) -> OutputFile:
    tf = template_file(ckpt.optim_files, rank)
    tree = copy_tree(tf.obj)
    osd = tree[L.OPTIMIZER_STATE_DICT]
    stage3 = ckpt.zero_stage == 3
    torch_state = osd[L.OPTIMIZER_STATE_DICT] if stage3 else osd[L.BASE_OPTIMIZER_STATE]
    flats = []
    mine = [next(m for m in moves if m.index == g and (m.target_ranks is None or rank in m.target_ranks))
            for g in sorted({m.index for m in moves})]  # per flat group, the move this rank takes part in
    recut = any(m.source_groups is not None for m in mine)  # ZeRO-3 sub-groups cut anew (moves.stage3_moves)
    states = torch_state.get("state", {})
    originals = dict(states)  # (re-cut: each new sub-group's scalars from its first source's, as saved)
    for g, move in enumerate(mine):
        where = f"{ckpt.layout.tag_dir}: group {g}"
        pos = move.position(rank)
        source_ranks = move.source_ranks if move.source_ranks is not None else range(ckpt.world_size)
        joined = move.source_groups or (g,)
        sources = [[ckpt.optimizer_states[r].groups[k] for k in joined] for r in source_ranks]
        trimmed = 0 if stage3 else stage12_trimmed(move.target, pos)
        length = move.target.partition_numel
        spaces = [FlatSpace([s.fp32 for s in ss]) for ss in sources]
        flats.append(new_tensor(sources[0][0].fp32, length - trimmed,
                                 partition_segments(move, pos, spaces, length - trimmed, where)))
        state = copy_tree(originals.get(joined[0])) if recut else states.get(g)
        for key, value in list((state or {}).items()):
            if key not in sources[0][0].moments and (not isinstance(value, TensorRef) or value.numel <= 1):
                continue  # Adam's step and other scalars: the same on every rank, kept (moments on NVMe: empty here)
            spaces = [FlatSpace([state_tensor(ckpt, r, k, key, move) for k in joined]) for r in source_ranks]
            state[key] = new_tensor(value, length, partition_segments(move, pos, spaces, length, f"{where} {key}"))
        if recut:
            states[g] = state
    if recut:
        torch_state["state"] = {g: states[g] for g in range(len(mine)) if states.get(g) is not None}
        owner = [s.param_group for s in ckpt.optimizer_states[0].groups]
        for i, group in enumerate(torch_state["param_groups"]):
            group["params"] = [g for g, m in enumerate(mine) if owner[(m.source_groups or (g,))[0]] == i]
    renamed = {m.index: world_size // len(m.target_ranks) for m in mine
               if m.source_params is not None and m.target_ranks is not None}
    if renamed:  # experts at another ep_size: their optimizer group is named for it
        from .experts import renamed_groups

        torch_state["param_groups"] = renamed_groups(torch_state["param_groups"], renamed)
        if isinstance(osd.get(L.PARAM_ALIGNMENT_PADDINGS), list):  # one (zero) padding per parameter it now holds
            osd[L.PARAM_ALIGNMENT_PADDINGS] = [[0] * len(m.names) if m.source_params is not None else pads
                                               for m, pads in zip(mine, osd[L.PARAM_ALIGNMENT_PADDINGS])]
    if stage3:
        osd[L.FP32_FLAT_GROUPS] = flats
        osd[L.PARTITION_COUNT] = world_size
    else:
        osd[L.SINGLE_PARTITION_OF_FP32_GROUPS] = flats
        osd[L.PARTITION_COUNT] = [len(m.target_ranks) if m.target_ranks is not None else world_size for m in mine]
        osd[L.GROUP_PADDINGS] = [stage12_trimmed(m.target, m.position(rank)) for m in mine]
        if L.PARAM_SLICE_MAPPINGS in osd:
            osd[L.PARAM_SLICE_MAPPINGS] = [slice_mappings_at(m, m.position(rank), osd[L.PARAM_SLICE_MAPPINGS]) for m in mine]
    return OutputFile(rank_file_name("optim", Coord(tp=ckpt.tp_rank, dp=rank), bf16=is_bf16(tf.path)), tf.path, tree)
