"""A DeepSpeed ZeRO-1/2/3 checkpoint at M ranks from any training state (``plan.training_state``): the files
``convert --to deepspeed`` writes, as the trees DeepSpeed 0.19.8's ``save_checkpoint`` pickles.  Pure: each
partition is segments of the source's full tensors (``plan.segments``), cut where ``zero.partitioning`` says
rank r holds them.

* flat groups: one per torch param group, its parameters in the group's order (ZeRO's flat order);
  stage 1/2 laid back to back and cut in M equal slices, stage 3 each parameter split on its own;
* per rank, an optimizer file: the fp32 partition per group, Adam's moments in the same layout (zeros in the
  padding), the group's step, the torch optimizer's ``param_groups`` (settings kept; ``params`` the group's
  index), DeepSpeed's records (partition counts, paddings, ``param_slice_mappings``; a static loss scaler of 1,
  what bf16 and fp32 runs save; fp16: none at ZeRO-1/2, whose load keeps the engine's, DeepSpeed's defaults at
  ZeRO-3, whose load requires one);
* the model file(s): stage 1/2 one ``module`` with every entry in full (trainable parameters as their masters
  cast to the module dtype, both tied names one tensor), stage 3 one per rank with buffers in full, every
  parameter an empty placeholder and frozen parameters as that rank's part; ``param_shapes``,
  ``frozen_param_*``, ``shared_params``, ``buffer_names``, ``global_steps`` as DeepSpeed records them.
No scheduler state is written unless the caller gives one (``lr_scheduler`` None): load with
``load_lr_scheduler_states=False`` when the engine has a scheduler.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dtypes import FLOATING, ITEMSIZE
from ..errors import ConfigError, InconsistentCheckpointError, UnsupportedCheckpointError
from ..formats.pickle_policy import Opaque, TorchDtype, TorchSize, opaque_type
from ..formats.pickle_writer import NewTensor
from ..zero import layout as L
from ..zero.grid import Coord, rank_file_name
from ..zero.partitioning import GroupLayout, stage3_group, stage12_group, stage12_trimmed
from .consolidate import TensorPlan
from .moves import DEFAULT_SUB_GROUP_SIZE, GroupMove, OutputFile, ReshardPlan, slice_mappings_at
from .segments import Piece, TensorSource, Window, Zeros, merged
from .training_state import TrainingState

DS_VERSION = "0.19.8"  # the DeepSpeed whose files these are (its loader checks the recorded version is >= 0.3.17)
LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
ZERO_STAGE_ENUM = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
DYNAMIC_LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
MODULE_DTYPES = ("F32", "BF16", "F16")
# DeepSpeed's fp16 defaults (initial_scale_power 16, loss_scale_window 1000, hysteresis 2, min_loss_scale 1): what a
# ZeRO-3 file must hold, no source having a scaler; ZeRO-1/2's load keeps the engine's own when the file has none
FP16_SCALER_DEFAULTS = {"cur_scale": 65536.0, "dynamic": True, "last_overflow_iter": -1, "scale_factor": 2.0,
                        "scale_window": 1000, "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 2,
                        "consecutive_hysteresis": False, "raise_error_at_min_scale": True}


@dataclass(frozen=True)
class DeepSpeedLayout:
    world_size: int
    stage: int
    dtype: str  # the module's floating dtype: "F32" or "BF16"
    tag: str
    global_steps: int = 0
    lr_scheduler: dict[str, Any] | None = None  # the state the engine's scheduler loads (None: none written)
    client_state: dict[str, Any] = field(default_factory=dict)  # beside DeepSpeed's keys, as save_checkpoint puts it


def check_layout(world_size: int, stage: int, dtype: str) -> None:
    """Refuse a target DeepSpeed cannot run, before the source is read."""
    if stage not in (1, 2, 3):
        raise ConfigError(f"--stage {stage}: convert --to deepspeed writes ZeRO stage 1, 2 or 3")
    if type(world_size) is not int or world_size < 1:
        raise ConfigError(f"--world-size {world_size!r}: expected a whole number of ranks, 1 or more")
    if dtype not in MODULE_DTYPES:
        raise ConfigError(f"--dtype {dtype}: convert --to deepspeed writes fp32, bf16 or fp16 engines")


def build_deepspeed_plan(state: TrainingState, target: DeepSpeedLayout, source: Path) -> ReshardPlan:
    """Every file of ``target``'s tag folder; ``source`` names the input in messages and records."""
    check_layout(target.world_size, target.stage, target.dtype)
    by_name = {p.name: p for p in state.params}
    layouts: list[GroupLayout] = []
    for g, group in enumerate(state.groups):
        numels = [math.prod(by_name[n].master.shape) for n in group.params]
        layout = stage3_group(numels, target.world_size) if target.stage == 3 else stage12_group(numels, target.world_size)
        if target.stage == 3 and layout.partition_numel > DEFAULT_SUB_GROUP_SIZE:
            raise UnsupportedCheckpointError(f"param group {g} would hold {layout.partition_numel:,} elements "
                                             f"per rank, more than one ZeRO-3 sub-group; not supported yet", at=source)
        layouts.append(layout)
    if state.order_guessed:
        _require_telling_sizes(layouts, target, source)
    moves = tuple(GroupMove(g.params, layout, layout, i) for i, (g, layout) in enumerate(zip(state.groups, layouts)))
    files = [_optim_file(state, target, moves, r, source) for r in range(target.world_size)]
    if target.stage == 3:
        files = [_model_file(state, target, r, source) for r in range(target.world_size)] + files
    else:
        files = [_model_file(state, target, None, source)] + files
    return ReshardPlan(target.stage, 1, target.world_size, target.tag, moves, tuple(files))


def _require_telling_sizes(layouts: list[GroupLayout], target: DeepSpeedLayout, source: Path) -> None:
    """Groups in a guessed order: a job listing them otherwise must fail its load on the partition sizes, which it
    does unless two groups' partitions are the same size on every rank."""
    seen: dict[tuple[int, int], int] = {}
    for g, layout in enumerate(layouts):
        last = 0 if target.stage == 3 else stage12_trimmed(layout, target.world_size - 1)
        other = seen.setdefault((layout.partition_numel, last), g)
        if other != g:
            raise ConfigError(f"param groups {other} and {g} (by their settings; their order in the DeepSpeed job's "
                              f"optimizer is not recorded) hold {layout.partition_numel:,} elements per rank each at "
                              f"{target.world_size} ranks: a job listing them the other way round would load each "
                              "one's masters and moments into the other without an error",
                              hint="--group-order NAME,NAME,...: one parameter of each group, in the order the "
                                   "DeepSpeed job passes the groups to its optimizer", at=source)


def _partition(layout: GroupLayout, rank: int, tensors: list[TensorPlan], length: int, where: str) -> TensorSource:
    """Rank ``rank``'s first ``length`` elements of a flat group, as fp32 from ``tensors`` (one per parameter)."""
    dtypes = {t.src_dtype for t in tensors}
    if len(dtypes) > 1:
        raise UnsupportedCheckpointError(f"a param group mixes {sorted(dtypes)} tensors; one flat "
                                         "partition is read in one dtype", at=where)
    src = dtypes.pop() if dtypes else "F32"
    size = ITEMSIZE[src]
    out: list[Piece] = []
    pos = 0
    for tensor, spans in zip(tensors, layout.params):
        window = Window(tuple(tensor.pieces))
        for span in spans:
            if span.rank != rank:
                continue
            if span.rank_start > pos:
                out.append(Zeros((span.rank_start - pos) * size))
            out += window.cut(span.param_start * size, span.count * size)
            pos = span.rank_start + span.count
    if pos > length:
        raise InconsistentCheckpointError(f"rank {rank} needs {pos} elements but keeps {length}", at=where)
    if length > pos:
        out.append(Zeros((length - pos) * size))
    return TensorSource(src, "F32", merged(out))


def _flat(source: TensorSource, requires_grad: bool) -> NewTensor:
    numel = sum(p.nbytes for p in source.pieces) // ITEMSIZE[source.src_dtype]
    return NewTensor("F32", (numel,), source, requires_grad)


def _step_tensor(step: object, where: str) -> NewTensor | None:
    """Adam's step as torch keeps it: a 0-d float32 tensor, read from the source's own step tensor."""
    if step is None:
        return None
    if not isinstance(step, TensorPlan) or step.shape != ():
        raise UnsupportedCheckpointError(f"the optimizer step is {step!r:.60}, not a stored 0-d tensor", at=where)
    return NewTensor("F32", (), TensorSource(step.src_dtype, "F32", tuple(step.pieces)))


def _optim_file(state: TrainingState, target: DeepSpeedLayout, moves: tuple[GroupMove, ...], rank: int,
                source: Path) -> OutputFile:
    by_name = {p.name: p for p in state.params}
    flats, torch_state, param_groups = [], {}, []
    for g, (group, move) in enumerate(zip(state.groups, moves)):
        where = f"{source}: param group {g}"
        params = [by_name[n] for n in group.params]
        length = move.target.partition_numel
        trimmed = stage12_trimmed(move.target, rank) if target.stage != 3 else 0
        flats.append(_flat(_partition(move.target, rank, [p.master for p in params], length - trimmed, where), True))
        keys = [k for k in (params[0].moments if params else {})]
        if any(list(p.moments) != keys for p in params):
            raise UnsupportedCheckpointError("its parameters hold different optimizer state keys", at=where)
        entry: dict[str, NewTensor] = {}
        step = _step_tensor(params[0].step, where) if params else None
        if step is not None and keys:
            entry["step"] = step
        for key in keys:
            entry[key] = _flat(_partition(move.target, rank, [p.moments[key] for p in params], length, f"{where} {key}"),
                               False)
        if entry:
            torch_state[g] = entry
        param_groups.append({**group.settings, "params": [g]})
    stage_enum = opaque_type(*ZERO_STAGE_ENUM)(target.stage)
    scaler = _loss_scaler(target)
    if target.stage == 3:
        osd: dict[str, Any] = {L.ZERO_STAGE: stage_enum, L.LOSS_SCALER: scaler, "dynamic_loss_scale": target.dtype == "F16",
                     "overflow": False,
                     L.PARTITION_COUNT: target.world_size,
                     L.OPTIMIZER_STATE_DICT: {"state": torch_state, "param_groups": param_groups},
                     L.FP32_FLAT_GROUPS: flats}
    else:
        osd = {} if target.dtype == "F16" else {L.LOSS_SCALER: scaler, "dynamic_loss_scale": False, "overflow": False}
        osd |= {L.BASE_OPTIMIZER_STATE: {"state": torch_state, "param_groups": param_groups},
               L.SINGLE_PARTITION_OF_FP32_GROUPS: flats, L.ZERO_STAGE: stage_enum,
               L.GROUP_PADDINGS: [stage12_trimmed(m.target, rank) for m in moves],
               L.PARAM_ALIGNMENT_PADDINGS: [[0] * len(m.names) for m in moves],
               L.PARTITION_COUNT: [target.world_size] * len(moves), L.DS_VERSION: DS_VERSION,
               L.PARAM_SLICE_MAPPINGS: [OrderedDict(slice_mappings_at(m, rank, [])) for m in moves]}
    tree = {L.OPTIMIZER_STATE_DICT: osd, L.DS_CONFIG: _config(target), L.DS_VERSION: DS_VERSION}
    name = rank_file_name("optim", Coord(dp=rank), bf16=target.dtype == "BF16")
    return OutputFile(name, source, tree)


def _loss_scaler(target: DeepSpeedLayout) -> Opaque:
    """A static scaler of 1 (what fp32 and bf16 engines save), or for fp16 a dynamic one at DeepSpeed's defaults."""
    dynamic = target.dtype == "F16"
    cls = opaque_type(*(DYNAMIC_LOSS_SCALER if dynamic else LOSS_SCALER))
    scaler: Opaque = cls.__new__(cls)
    scaler.state = {**FP16_SCALER_DEFAULTS, "cur_iter": target.global_steps, "dtype": TorchDtype("F16", "float16")} \
        if dynamic else {"cur_scale": 1.0, "dynamic": False}
    return scaler


def _config(target: DeepSpeedLayout) -> dict[str, Any]:
    config: dict[str, Any] = {"zero_optimization": {"stage": target.stage}}
    if target.dtype in ("BF16", "F16"):
        config["bf16" if target.dtype == "BF16" else "fp16"] = {"enabled": True}
    return config


def _module_value(plan: TensorPlan, dtype: str) -> NewTensor:
    out = dtype if plan.kind != "buffer" and plan.src_dtype in FLOATING else plan.src_dtype
    return NewTensor(out, plan.shape, TensorSource(plan.src_dtype, out, tuple(plan.pieces)))


def _model_file(state: TrainingState, target: DeepSpeedLayout, rank: int | None, source: Path) -> OutputFile:
    """Stage 1/2 (``rank`` None): the one model file; stage 3: rank ``rank``'s."""
    masters = {p.name: p.master for p in state.params}
    module: OrderedDict[str, NewTensor] = OrderedDict()
    frozen = [t for t in state.model.tensors if t.kind == "frozen"]
    for t in state.model.tensors:
        if rank is not None and t.kind != "buffer":  # ZeRO-3: parameters live in the partitions
            dtype = target.dtype if t.src_dtype in FLOATING else t.src_dtype
            module[t.name] = NewTensor(dtype, (0,), TensorSource(dtype, dtype, ()))
        else:
            module[t.name] = _module_value(masters.get(t.name, t), target.dtype)
    for alias, owner in state.model.aliases.items():
        module[alias] = module[owner]  # one tensor under both names, as the module's state_dict holds it
    by_name = {p.name: p for p in state.params}
    tree: dict[str, Any] = {
        L.MODULE: module,
        L.BUFFER_NAMES: [t.name for t in state.model.tensors if t.kind == "buffer"],
        "optimizer": None,
        L.PARAM_SHAPES: [OrderedDict((n, TorchSize(by_name[n].master.shape)) for n in g.params) for g in state.groups],
        L.FROZEN_PARAM_SHAPES: None,
        L.SHARED_PARAMS: dict(state.model.aliases) if not rank else {},
        L.FROZEN_PARAM_FRAGMENTS: None,
        "lr_scheduler": target.lr_scheduler, "data_sampler": None, "random_ltd": None,
        "skipped_steps": 0, "global_steps": target.global_steps,
        L.DP_WORLD_SIZE: target.world_size, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        L.DS_CONFIG: _config(target), L.DS_VERSION: DS_VERSION,
    }
    if frozen and target.stage >= 2:
        tree[L.FROZEN_PARAM_SHAPES] = OrderedDict((t.name, TorchSize(t.shape)) for t in frozen)
        tree[L.FROZEN_PARAM_FRAGMENTS] = OrderedDict(
            (t.name, module[t.name] if rank is None else _frozen_part(t, target, rank)) for t in frozen)
    tree.update((k, v) for k, v in target.client_state.items() if k not in tree)  # (DeepSpeed's keys win, as at load)
    if rank is None:
        return OutputFile(rank_file_name("model", Coord(), per_dp_rank=False), source, tree)
    return OutputFile(rank_file_name("model", Coord(dp=rank)), source, tree)


def _frozen_part(t: TensorPlan, target: DeepSpeedLayout, rank: int) -> NewTensor:
    """Rank ``rank``'s ZeRO-3 part of a frozen parameter (padded), in the module dtype."""
    layout = stage3_group([math.prod(t.shape)], target.world_size)
    dtype = target.dtype if t.src_dtype in FLOATING else t.src_dtype
    size = ITEMSIZE[t.src_dtype]
    out: list[Piece] = []
    for span in layout.params[0]:
        if span.rank == rank:
            out += Window(tuple(t.pieces)).cut(span.param_start * size, span.count * size)
            if span.count < layout.partition_numel:
                out.append(Zeros((layout.partition_numel - span.count) * size))
    if not out:
        out = [Zeros(layout.partition_numel * size)]
    return NewTensor(dtype, (layout.partition_numel,), TensorSource(t.src_dtype, dtype, merged(out)))


