"""A full-weights file or Hugging Face folder as a training state at step 0 (the source of ``convert --to
deepspeed`` when no optimizer state exists): every trainable parameter's master is its weight (cast to fp32),
Adam's moments zeros and its step 0 - what a fresh ``torch.optim.AdamW`` holds before its first step - in the
param groups the caller names (the model's order, never the file's sorted key order).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, StateDictMismatchError
from .consolidate import Plan, TensorPlan
from .from_dcp import ModelNames
from .segments import Zeros
from .training_state import ParamGroup, ParamState, TrainingState

FRESH_MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state, zeros before the first step


def build_weights_state(tensors: list[TensorPlan], model: ModelNames, groups: tuple[ParamGroup, ...],
                        where: Path) -> TrainingState:
    """``tensors``: the file's entries (kind "param"); ``model``: which are buffers, which names are ties;
    ``groups``: the optimizer's param groups (parameters in no group are frozen)."""
    stored = {t.name: t for t in tensors}
    wanted = [n for n in (*model.parameters, *sorted(model.buffers)) if n not in model.ties]
    missing = [n for n in wanted if n not in stored]
    extra = [n for n in stored if n not in wanted and n not in model.ties]
    if missing or extra:
        raise StateDictMismatchError("the weights and the model disagree - missing from the weights: "
                                     f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; not in the model: {extra[:5]}", at=where)
    model.check_shapes({n: stored[n].shape for n in wanted}, where)
    trainable = [n for g in groups for n in g.params]
    unknown = [n for n in trainable if n not in model.parameters or n in model.ties]
    if unknown or len(set(trainable)) != len(trainable):
        raise ConfigError(f"param groups name {unknown[:5] or 'a parameter twice'}; each of the model's parameters "
                          "belongs to at most one group")
    kinds = {n: "param" if n in trainable else "buffer" if n in model.buffers else "frozen" for n in wanted}
    plans = [TensorPlan(n, stored[n].shape, stored[n].src_dtype, stored[n].src_dtype, kinds[n], stored[n].pieces)
             for n in wanted]
    aliases = {alias: owner for alias, owner in model.ties.items()}
    step = TensorPlan("step", (), "F32", "F32", "step", (Zeros(4),))
    params = []
    for g, group in enumerate(groups):
        for name in group.params:
            t = stored[name]
            master = TensorPlan(name, t.shape, t.src_dtype, "F32", "param", t.pieces)
            zeros = {k: TensorPlan(name, t.shape, "F32", "F32", "param", (Zeros(master.numel * 4),) if master.numel else ())
                     for k in FRESH_MOMENTS}
            params.append(ParamState(name, master, zeros, step, g))
    return TrainingState(Plan(tuple(plans), aliases), tuple(params), groups)
