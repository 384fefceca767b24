"""The plan of a universal checkpoint (DeepSpeed's elastic format): what ``ds_to_universal`` writes for the
same checkpoint, file for file and tensor for tensor, read straight from the rank files.

``build_universal_plan(ckpt, state)`` is pure (``state`` from ``plan.training_state``):
1. per trainable parameter, ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``: at stage 1/2
   ``{"cat_dim": 0, "param": <full tensor>}`` plus ``step.pt`` (the step as stored); at stage 3 the bare
   tensor, flat (DeepSpeed's stage-3 loader views every state as 1-d);
2. stage 1/2: every other ``module`` entry (frozen parameters, buffers, tied names) as
   ``zero/<name>/fp32.pt`` = ``{"param": <module value as float32>}``, as ``ds_to_universal`` adds them;
3. ``zero/optimizer_state.pt``: rank 0's optimizer state without its partitions (stage 3: all of it), plus
   ``param_groups``, the torch optimizer's groups (DeepSpeed's loader reads the loss scaler, the step and
   the hyper-parameters there);
4. the model-states files (every TP rank's), copied as they are; ``latest_universal`` names the tag.
A tensor-parallel run's parameters are the joined full tensors, with the keys ``ds_to_universal`` writes beside
them (``zero.tensor_parallel.universal_fields``) instead of ``cat_dim: 0``.
ZeRO-3's loader gives every param group the settings of the first (DeepSpeed 0.19.8,
``load_hp_checkpoint_state_from_checkpoint_dir_stage3``): a DeepSpeed defect, not a property of the files.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats.pickle_writer import NewTensor
from ..plan.segments import TensorSource, ref_segments
from ..zero import layout as L
from ..zero.reader import Checkpoint
from ..zero.tensor_parallel import universal_fields
from .joins import holders, outermost
from .training_state import TrainingState

STAGE12_PARTITIONS = (L.BASE_OPTIMIZER_STATE, L.PARAM_SLICE_MAPPINGS, L.SINGLE_PARTITION_OF_FP32_GROUPS)


@dataclass(frozen=True)
class UniversalFile:
    name: str  # relative to the tag folder
    tree: Any  # a pickle tree for ``io.torch_writer.write_archive`` (NewTensor / TensorRef leaves)


@dataclass(frozen=True)
class UniversalPlan:
    tag: str
    stage: int
    files: tuple[UniversalFile, ...]
    copies: tuple[tuple[Path, str], ...]  # (source path, name in the tag folder), copied byte for byte


def _param_file(name: str, state: str) -> str:
    """``zero/<name>/<state>.pt``: DeepSpeed's names for fp32 and Adam's moments, any other state key by its own."""
    return f"{L.UNIVERSAL_DIR}/{name}/{L.UNIVERSAL_STATE_FILES.get(state, state + '.pt')}"


def build_universal_plan(ckpt: Checkpoint, state: TrainingState) -> UniversalPlan:
    files = []
    stage3 = ckpt.zero_stage == 3
    for p in state.params:
        fields = universal_fields(ckpt.tp_info, p.name) if ckpt.tp_slices else {L.UNIVERSAL_CAT_DIM_KEY: 0}
        for key, t in (("fp32", p.master), *p.moments.items()):
            tree: NewTensor | dict[str, Any]
            if stage3:
                tree = NewTensor(t.dtype, (t.numel,), t)
            else:
                tree = {**fields, L.UNIVERSAL_PARAM_KEY: NewTensor(t.dtype, t.shape, t)}
            files.append(UniversalFile(_param_file(p.name, key), tree))
        if not stage3 and p.step is not None:
            files.append(UniversalFile(f"{L.UNIVERSAL_DIR}/{p.name}/{L.UNIVERSAL_STEP_FILE}", p.step))
    if not stage3:
        files += _untrained(ckpt, state)
    files.append(UniversalFile(f"{L.UNIVERSAL_DIR}/{L.UNIVERSAL_OPTIMIZER_FILE}", _optimizer_state(ckpt)))
    copies = tuple((f.path, f.path.name) for f in ckpt.every_model_file)
    copies += tuple((path, path.name) for path in ckpt.layout.pipeline_files)  # a pipeline module loads its layers
    return UniversalPlan(ckpt.layout.tag_dir.name, ckpt.zero_stage, tuple(files), copies)


def _untrained(ckpt: Checkpoint, state: TrainingState) -> list[UniversalFile]:
    """Every other ``module`` entry (frozen parameters, buffers, tied names) as float32, in module order; a
    tensor-parallel run's whole and every pipeline stage's, from the joined plan."""
    trainable = {p.name for p in state.params}
    planned = {t.name: t for t in state.model.tensors}
    joined = outermost(ckpt) is not None
    modules = {n: ref for part in holders(ckpt) for n, ref in part.module.items()}
    out = []
    for name, ref in modules.items():
        if name in trainable or not hasattr(ref, "shape"):
            continue
        t = planned.get(state.model.aliases.get(name, name)) if joined else None
        source = TensorSource(t.src_dtype, "F32", tuple(t.pieces)) if t else TensorSource(ref.dtype, "F32", ref_segments(ref))
        shape = t.shape if t else tuple(ref.shape)
        out.append(UniversalFile(_param_file(name, "fp32"), {L.UNIVERSAL_PARAM_KEY: NewTensor("F32", shape, source)}))
    return out


def _optimizer_state(ckpt: Checkpoint) -> dict[str, Any]:
    osd = ckpt.optim_files[0].obj[L.OPTIMIZER_STATE_DICT]
    if ckpt.zero_stage == 3:
        out: dict[str, Any] = type(osd)(osd)
        out[L.UNIVERSAL_PARAM_GROUPS] = osd[L.OPTIMIZER_STATE_DICT][L.UNIVERSAL_PARAM_GROUPS]
    else:
        out = type(osd)((k, v) for k, v in osd.items() if k not in STAGE12_PARTITIONS)
        out[L.UNIVERSAL_PARAM_GROUPS] = osd[L.BASE_OPTIMIZER_STATE][L.UNIVERSAL_PARAM_GROUPS]
    return out
