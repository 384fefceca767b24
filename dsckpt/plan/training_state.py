"""The training state as other systems keep it: per parameter its fp32 master, Adam's moments and step; per
optimizer param group its settings and parameter names.  ``convert --to dcp`` and ``--to universal`` write
from this plan; neither asks how ZeRO partitioned anything.

``build_training_state(ckpt)`` is pure (no tensor bytes read):
1. the model: the consolidation plan (fp32 masters, frozen parameters, buffers, tied aliases;
   ``plan.consolidate``), frozen parameters and buffers in their stored dtypes;
2. per trainable parameter, the plans of its per-element optimizer state (Adam's ``exp_avg`` and ``exp_avg_sq``,
   SGD's ``momentum_buffer``, Adagrad's ``sum``...: what its flat group holds), in the same parameter order;
3. per parameter, its flat group (``plan.groups``) and through it the group's Adam step and the torch
   param group that owns it (ZeRO-3 sub-groups of one param group share its settings);
4. per torch param group, its settings and the names of its parameters in flat order.
What cannot map to one full tensor per name is refused by name: ZeRO-0 (no partitioned optimizer state),
mixture-of-experts runs, universal checkpoints (already converted).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedCheckpointError
from ..zero.reader import Checkpoint
from .consolidate import Plan, TensorPlan, build_plan
from .groups import group_layouts, structure_errors
from .joins import holders


@dataclass(frozen=True)
class ParamState:
    name: str
    master: TensorPlan  # the fp32 master, full shape
    moments: dict[str, TensorPlan]  # per-element state by key: "exp_avg", "exp_avg_sq"; "momentum_buffer"...
    step: Any  # the flat group's Adam step: a 0-d TensorRef, a number, or None when the optimizer kept none
    group: int  # index into TrainingState.groups


@dataclass(frozen=True)
class ParamGroup:
    settings: dict[str, Any]  # lr, betas, eps, weight_decay, ... as the torch optimizer recorded them
    params: tuple[str, ...]


@dataclass(frozen=True)
class TrainingState:
    model: Plan  # every tensor of the model state dict (tied aliases in model.aliases)
    params: tuple[ParamState, ...]  # trainable parameters, flat-group order
    groups: tuple[ParamGroup, ...]  # the torch optimizer's param groups, in its order
    order_guessed: bool = False  # ``groups``' order is the model's, no record of the job's (torchtitan's layout)


def require_convertible(ckpt: Checkpoint, weights_only: bool = False) -> None:
    where = ckpt.layout.tag_dir
    if ckpt.universal:
        raise UnsupportedCheckpointError("already a universal checkpoint (ds_to_universal's output)",
                                         hint="convert the DeepSpeed checkpoint it was made from", at=where)
    if ckpt.experts:
        raise UnsupportedCheckpointError("a mixture-of-experts run; convert does not map expert "
                                         "parallelism to DCP or universal checkpoints",
                                         hint="dsckpt consolidate writes its weights; dsckpt reshard --ep-size moves it", at=where)
    if ckpt.zero_stage == 0 and not weights_only:
        raise UnsupportedCheckpointError("a ZeRO-0 checkpoint keeps no partitioned optimizer state "
                                         "to convert", hint="--weights-only converts the weights", at=where)


def _held(ckpt: Checkpoint, key: str) -> list[TensorPlan]:
    """The plans of optimizer state ``key`` for the parameters whose flat groups hold it."""
    parts = holders(ckpt)
    if all(key in g.moments for part in parts for r in part.optimizer_states for g in r.groups):
        return [t for t in build_plan(ckpt, state=key).tensors if t.kind == "param"]
    from .consolidate import group_plans

    return group_plans(ckpt, key)


def build_training_state(ckpt: Checkpoint, weights_only: bool = False) -> TrainingState:
    require_convertible(ckpt, weights_only)
    model = build_plan(ckpt)
    if weights_only:
        return TrainingState(model, (), ())
    parts = holders(ckpt)  # a pipeline run: each stage's flat groups, one torch optimizer per stage
    keys = {key for part in parts for r in part.optimizer_states for g in r.groups for key in g.moments}
    fp32 = {t.name: t for t in build_plan(ckpt, "fp32").tensors if t.kind == "param"}
    # a key some flat groups lack (Muon's momentum beside its Adam groups' moments) is planned group by group
    moments = {key: {t.name: t for t in _held(ckpt, key)} for key in sorted(keys)}
    owners: dict[int, int] = {}  # torch param group (the same index on every stage) -> index in groups
    settings: list[dict[str, Any]] = []
    names: list[list[str]] = []
    params: dict[str, ParamState] = {}  # a tied module held by several stages: once
    for part in parts:
        with structure_errors(part):
            for flat in group_layouts(part):
                state = part.optimizer_states[flat.ranks[0]].groups[flat.index]
                if state.param_group not in owners:
                    owners[state.param_group] = len(settings)
                    settings.append(dict(state.hyperparams))
                    names.append([])
                group = owners[state.param_group]
                for name in flat.names:
                    if name in params:
                        continue
                    names[group].append(name)
                    held = {key: plans[name] for key, plans in moments.items() if name in plans}
                    params[name] = ParamState(name, fp32[name], held, state.step, group)
    order = sorted(owners, key=lambda g: owners[g])
    groups = tuple(ParamGroup(settings[owners[g]], tuple(names[owners[g]])) for g in order)
    return TrainingState(model, tuple(params.values()), groups)
