"""The reshard plan across ZeRO stages (``reshard --stage S``): users move from ZeRO-2 to ZeRO-3 when
they scale up.  Pure bookkeeping, as ``plan.reshard`` (which calls ``restaged`` for a stage change): per output
file, the tree to pickle; the moves it shares with the same-stage plan are ``plan.moves``.

* 1 <-> 2: the same files (DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer`` runs both and never reads back
  the recorded stage): the plan at M with ``zero_stage`` and the config's stage rewritten.
* 1/2 -> 3: the flat groups change layout - each parameter split on its own, padded to M
  (``partitioning.stage3_group``) - so the files are built in stage 3's shape:
  1. per param group, the source layout at N (stage 1/2, alignment paddings included) and the stage-3
     layout at M, with one ZeRO-3 sub-group per param group (DeepSpeed's default ``sub_group_size`` of
     1e9 elements; a group whose partition is larger would be cut, and is refused);
  2. per rank, a model-states file: the source's client state and counters, buffers in full, every
     parameter an empty placeholder, frozen parameters as their stage-3 partitions (read from the
     16-bit ``module`` values), ``shared_params`` on rank 0 only;
  3. per rank, an optimizer file: ``fp32_flat_groups`` and every per-element optimizer state (Adam's
     moments) in the stage-3 layout, the torch optimizer's ``param_groups`` and scalar state, the
     loss scaler, ``partition_count`` M.
* 3 -> 1/2: the flat groups laid out for stage 1/2 at M (no parameter alignment, DeepSpeed's default),
  and the full 16-bit ``module`` stage 1/2 keeps rebuilt - trainable parameters as their fp32 masters cast
  to the trained precision (what DeepSpeed's step leaves in the 16-bit copy), frozen ones gathered from
  their stage-3 partitions; one sub-group per param group is required (else refused).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

from ..errors import UnsupportedCheckpointError
from ..formats.pickle_policy import Opaque, TensorRef, TorchSize
from ..formats.pickle_writer import NewTensor
from ..zero import layout as L
from ..zero.partitioning import stage3_group, stage12_group, stage12_trimmed
from ..zero.reader import Checkpoint
from ..zero.grid import Coord, rank_file_name
from .groups import structure_errors
from .segments import FlatSpace, TensorSource
from .moves import (DEFAULT_SUB_GROUP_SIZE, GroupMove, OutputFile, ReshardPlan, check_reshardable, copy_tree,
                    is_bf16, new_tensor, partition_segments, slice_mappings_at, stage3_moves, stage12_moves,
                    state_tensor)


def restaged(ckpt: Checkpoint, world_size: int, stage: int, same_stage: ReshardPlan | None) -> ReshardPlan:
    """The plan for ``ckpt`` at ``world_size`` and another ZeRO ``stage``; ``same_stage``: its plan at
    ``world_size`` and its own stage (``plan.reshard`` builds it; needed for 1 <-> 2 only)."""
    where = ckpt.layout.tag_dir
    if ckpt.experts:
        raise UnsupportedCheckpointError("a mixture-of-experts checkpoint; reshard --stage does not move "
                                         "experts between stages (DeepSpeed 0.19.8 runs native MoE at ZeRO 0-2 only)", at=where)
    if stage not in (1, 2, 3):
        raise UnsupportedCheckpointError(f"--stage {stage}: reshard writes ZeRO stage 1, 2 or 3")
    if ckpt.zero_stage in (1, 2) and stage in (1, 2) and same_stage is not None:
        files = tuple(replace(f, tree=_with_frozen_records(ckpt, _with_stage(f.tree, stage), stage)
                              if f.name.endswith(L.MODEL_STATES_SUFFIX) else _with_stage(f.tree, stage))
                      for f in same_stage.files)
        return replace(same_stage, stage=stage, files=files)
    with structure_errors(ckpt):
        if ckpt.zero_stage in (1, 2) and stage == 3:
            return _to_stage3(ckpt, world_size)
        if ckpt.zero_stage == 3 and stage in (1, 2):
            return _from_stage3(ckpt, world_size, stage)
    raise UnsupportedCheckpointError(f"ZeRO-{ckpt.zero_stage} -> ZeRO-{stage} is not supported",
                                     hint="dsckpt consolidate, then dsckpt resume --full-weights at the new stage "
                                          "(the optimizer starts fresh)", at=where)


def _with_stage(tree: Any, stage: int) -> Any:
    """A file's tree with the recorded stage (optimizer ``zero_stage``, ``ds_config``) saying ``stage``."""
    tree = copy_tree(tree)
    osd = tree.get(L.OPTIMIZER_STATE_DICT)
    if isinstance(osd, dict) and isinstance(osd.get(L.ZERO_STAGE), Opaque):
        osd[L.ZERO_STAGE] = type(osd[L.ZERO_STAGE])(stage)  # ZeroStageEnum(stage), recorded as REDUCE
    config = tree.get(L.DS_CONFIG)
    if isinstance(config, dict) and isinstance(config.get("zero_optimization"), dict):
        config["zero_optimization"]["stage"] = stage
    return tree


def _with_frozen_records(ckpt: Checkpoint, tree: Any, stage: int) -> Any:
    """Stage 1 records frozen parameters in ``module`` only; stage 2 also as ``frozen_param_shapes`` and
    ``frozen_param_fragments`` (the full values, the module's own tensors) - as DeepSpeed saves each."""
    module = tree[L.MODULE]
    frozen = [n for n in ckpt.frozen if isinstance(module.get(n), (TensorRef, NewTensor))]
    if stage == 1 or not frozen:
        tree[L.FROZEN_PARAM_SHAPES] = tree[L.FROZEN_PARAM_FRAGMENTS] = None
    else:
        tree[L.FROZEN_PARAM_SHAPES] = OrderedDict((n, TorchSize(module[n].shape)) for n in frozen)
        tree[L.FROZEN_PARAM_FRAGMENTS] = OrderedDict((n, module[n]) for n in frozen)
    return tree


# --- 1/2 -> 3 ------------------------------------------------------------------------------------
def _to_stage3(ckpt: Checkpoint, world_size: int) -> ReshardPlan:
    ckpt.require_complete()
    check_reshardable(ckpt, world_size)
    moves = [GroupMove(m.names, m.source, stage3_group([math.prod(ckpt.trainable[n]) for n in m.names], world_size))
             for m in stage12_moves(ckpt, world_size)]
    for g, move in enumerate(moves):
        if move.target.partition_numel > DEFAULT_SUB_GROUP_SIZE:
            raise UnsupportedCheckpointError(
                f"param group {g} would hold {move.target.partition_numel:,} elements per "
                f"rank, more than one ZeRO-3 sub-group ({DEFAULT_SUB_GROUP_SIZE:,}); not supported yet", at=ckpt.layout.tag_dir)
    files = [_stage3_model_file(ckpt, world_size, r) for r in range(world_size)]
    files += [_stage3_optim_file(ckpt, moves, world_size, r) for r in range(world_size)]
    return ReshardPlan(3, ckpt.world_size, world_size, ckpt.layout.tag, tuple(moves), tuple(files))


def _placeholder(ref: TensorRef) -> NewTensor:
    """What a ZeRO-3 save holds for a parameter in ``module``: an empty tensor of its dtype."""
    return NewTensor(ref.dtype, (0,), TensorSource(ref.dtype, ref.dtype, ()), ref.requires_grad, ref.storage.location)


def _stage3_model_file(ckpt: Checkpoint, world_size: int, rank: int) -> OutputFile:
    source = ckpt.model_files[0]
    tree = _with_stage(source.obj, 3)
    module = tree[L.MODULE]
    buffers = set(tree.get(L.BUFFER_NAMES) or ())
    tree[L.MODULE] = type(module)((n, v if n in buffers or not isinstance(v, TensorRef) else _placeholder(v))
                                  for n, v in module.items())
    tree[L.FROZEN_PARAM_SHAPES] = OrderedDict((n, TorchSize(s)) for n, s in ckpt.frozen.items()) if ckpt.frozen \
        else tree.get(L.FROZEN_PARAM_SHAPES)
    tree[L.FROZEN_PARAM_FRAGMENTS] = OrderedDict(
        (n, _frozen_partition(ckpt, module[n], n, world_size, rank)) for n in ckpt.frozen) if ckpt.frozen else None
    if rank:
        tree[L.SHARED_PARAMS] = {}  # DeepSpeed records the ties in rank 0's file only
    tree[L.DP_WORLD_SIZE] = world_size
    return OutputFile(rank_file_name("model", Coord(tp=ckpt.tp_rank, dp=rank)), source.path, tree)


def _frozen_partition(ckpt: Checkpoint, full: TensorRef, name: str, world_size: int, rank: int) -> NewTensor:
    """Rank ``rank``'s stage-3 part of a frozen parameter, from its full 16-bit value in ``module``."""
    n = math.prod(ckpt.frozen[name])
    move = GroupMove((name,), stage3_group([n], 1), stage3_group([n], world_size))
    where = f"{ckpt.layout.tag_dir}: frozen {name!r}"
    return new_tensor(full, move.target.partition_numel,
                       partition_segments(move, rank, [FlatSpace([full])], move.target.partition_numel, where))


def _moved_partitions(ckpt: Checkpoint, moves: list[GroupMove], rank: int, torch_state: dict[str, Any],
                      trimmed: Callable[[GroupMove], int]) -> tuple[list[NewTensor], dict[int, dict[str, Any]]]:
    """Target ``rank``'s fp32 flat partition per group (``trimmed(move)`` elements short: stage 1/2's last
    rank) and the torch optimizer's state with every per-element tensor (Adam's moments) in the new layout;
    scalars (Adam's step) kept."""
    flats, state = [], {}
    for g, move in enumerate(moves):
        where = f"{ckpt.layout.tag_dir}: group {g}"
        length = move.target.partition_numel
        spaces = [FlatSpace([rs.groups[g].fp32]) for rs in ckpt.optimizer_states]
        flats.append(new_tensor(ckpt.optimizer_states[0].groups[g].fp32, length - trimmed(move),
                                 partition_segments(move, rank, spaces, length - trimmed(move), where)))
        group_state = dict(copy_tree(torch_state.get("state", {}).get(g)) or {})
        for key, value in list(group_state.items()):
            if isinstance(value, TensorRef) and value.numel > 1:
                per_rank = [FlatSpace([state_tensor(ckpt, r, g, key, move)]) for r in range(ckpt.world_size)]
                group_state[key] = new_tensor(value, length, partition_segments(move, rank, per_rank, length,
                                                                                 f"{where} {key}"))
        if group_state:
            state[g] = group_state
    return flats, state


def _stage3_optim_file(ckpt: Checkpoint, moves: list[GroupMove], world_size: int, rank: int) -> OutputFile:
    template = ckpt.optim_files[min(rank, ckpt.world_size - 1)]
    osd = copy_tree(template.obj[L.OPTIMIZER_STATE_DICT])
    torch_state = osd[L.BASE_OPTIMIZER_STATE]
    flats, state = _moved_partitions(ckpt, moves, rank, torch_state, lambda move: 0)
    stage3 = {  # the keys and order of DeepSpeed 0.19.8's stage-3 optimizer state_dict
        L.ZERO_STAGE: type(osd[L.ZERO_STAGE])(3),
        L.LOSS_SCALER: osd[L.LOSS_SCALER],
        "dynamic_loss_scale": osd["dynamic_loss_scale"],
        "overflow": osd["overflow"],
        L.PARTITION_COUNT: world_size,
        L.OPTIMIZER_STATE_DICT: {"state": state, "param_groups": torch_state["param_groups"]},
        L.FP32_FLAT_GROUPS: flats,
    }
    tree = _with_stage(template.obj, 3)
    tree[L.OPTIMIZER_STATE_DICT] = stage3
    return OutputFile(rank_file_name("optim", Coord(tp=ckpt.tp_rank, dp=rank), bf16=is_bf16(template.path)), template.path, tree)


# --- 3 -> 1/2 ------------------------------------------------------------------------------------
def _from_stage3(ckpt: Checkpoint, world_size: int, stage: int) -> ReshardPlan:
    """Stage 1/2 files from a stage-3 checkpoint: the flat groups laid out again (no parameter alignment:
    DeepSpeed's default), and the full 16-bit ``module`` stage 1/2 keeps - each trainable parameter its fp32
    master cast to the trained precision (what DeepSpeed's own step leaves in the 16-bit copy), frozen
    parameters gathered from their stage-3 partitions, buffers as they are."""
    ckpt.require_complete()
    check_reshardable(ckpt, world_size)
    optimizer_groups = ckpt.optim_files[0].obj[L.OPTIMIZER_STATE_DICT][L.OPTIMIZER_STATE_DICT]["param_groups"]
    sub_groups = stage3_moves(ckpt, ckpt.world_size)
    if len(sub_groups) != len(optimizer_groups):
        groups = f"{len(optimizer_groups)} param group" + "s" * (len(optimizer_groups) != 1)
        raise UnsupportedCheckpointError(
            f"{len(sub_groups)} ZeRO-3 sub-groups for {groups} "
            "(a small sub_group_size); stage 1/2 keeps one flat group per param group - not supported yet", at=ckpt.layout.tag_dir)
    moves = [GroupMove(m.names, m.source, stage12_group([math.prod(ckpt.trainable[n]) for n in m.names], world_size))
             for m in sub_groups]
    files = [_stage12_model_file(ckpt, world_size, stage)]
    files += [_stage12_optim_file(ckpt, moves, world_size, stage, r) for r in range(world_size)]
    return ReshardPlan(stage, ckpt.world_size, world_size, ckpt.layout.tag, tuple(moves), tuple(files))


def _stage12_model_file(ckpt: Checkpoint, world_size: int, stage: int) -> OutputFile:
    from .consolidate import build_plan

    source = ckpt.model_files[0]  # rank 0's: it alone records shared_params
    tree = _with_stage(source.obj, stage)
    weights = build_plan(ckpt, ckpt.precision)  # masters cast to the trained precision; frozen as stored
    full = {t.name: NewTensor(t.dtype, t.shape, t) for t in weights.tensors if t.kind != "buffer"}
    for alias, target in weights.aliases.items():
        full[alias] = full[target]  # tied names share one tensor, as in the module
    module = tree[L.MODULE]
    tree[L.MODULE] = type(module)((n, full.get(n, v)) for n, v in module.items())
    tree[L.DP_WORLD_SIZE] = world_size
    tree[L.FROZEN_PARAM_FRAGMENTS] = None  # stage 3's partitions; _with_frozen_records sets stage 2's
    return OutputFile(rank_file_name("model", Coord(tp=ckpt.tp_rank), per_dp_rank=False), source.path,
                      _with_frozen_records(ckpt, tree, stage))


def _stage12_optim_file(ckpt: Checkpoint, moves: list[GroupMove], world_size: int, stage: int,
                        rank: int) -> OutputFile:
    template = ckpt.optim_files[min(rank, ckpt.world_size - 1)]
    osd = template.obj[L.OPTIMIZER_STATE_DICT]
    torch_state = osd[L.OPTIMIZER_STATE_DICT]
    flats, state = _moved_partitions(ckpt, moves, rank, torch_state, lambda move: stage12_trimmed(move.target, rank))
    config = template.obj.get(L.DS_CONFIG)
    clip = config.get("gradient_clipping", 0.0) if isinstance(config, dict) else 0.0
    stage12 = {  # the keys and order of DeepSpeed 0.19.8's stage-1/2 optimizer state_dict
        L.LOSS_SCALER: osd[L.LOSS_SCALER],
        "dynamic_loss_scale": osd["dynamic_loss_scale"],
        "overflow": osd["overflow"],
        "clip_grad": clip,
        L.BASE_OPTIMIZER_STATE: {"state": state, "param_groups": copy_tree(torch_state["param_groups"])},
        L.SINGLE_PARTITION_OF_FP32_GROUPS: flats,
        L.ZERO_STAGE: type(osd[L.ZERO_STAGE])(stage),
        L.GROUP_PADDINGS: [stage12_trimmed(m.target, rank) for m in moves],
        L.PARAM_ALIGNMENT_PADDINGS: [[0] * len(m.names) for m in moves],  # alignment off: DeepSpeed's default
        L.PARTITION_COUNT: [world_size] * len(moves),
        L.DS_VERSION: template.obj.get(L.DS_VERSION),
        L.PARAM_SLICE_MAPPINGS: [OrderedDict(slice_mappings_at(m, rank, [])) for m in moves],
    }
    tree = _with_stage(template.obj, stage)
    tree[L.OPTIMIZER_STATE_DICT] = stage12
    return OutputFile(rank_file_name("optim", Coord(tp=ckpt.tp_rank, dp=rank), bf16=is_bf16(template.path)), template.path, tree)
