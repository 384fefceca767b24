"""A torch.distributed.checkpoint folder's training state (``plan.training_state``'s model), the source of
``convert --to deepspeed``.  Pure: the index and the small values ``formats.dcp`` read in, the plan out.

Two layouts, told apart by the saved paths (``planner_data``; measured, torch 2.13):
* FSDP2's ``dcp.save({"model": msd, "optim": osd})`` with ``get_state_dict(model, optimizer)``: ``("model",
  fqn)``, ``("optim", "state", fqn, key)``, ``("optim", "param_groups", i, key)`` - the groups list their
  parameters by name, in the optimizer's order;
* torchtitan's: ``(fqn,)`` at the top level, ``("optimizer", "state.<fqn>.<key>")`` and
  ``("optimizer", "param_groups.<fqn>.<key>")`` (``flatten_optimizer_state_dict``: settings per parameter, no
  group list), ``("train_state", "step")``, the scheduler's and data loader's own entries.  Groups are rebuilt
  from parameters with equal settings, each in model order.

What DCP cannot say - which model entries that no optimizer holds are frozen parameters, buffers or a tied
parameter's second name - comes from the model (``ModelNames``); without it only integer entries are taken as
buffers and anything else is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dtypes import FLOATING
from ..errors import ConfigError, CorruptFileError, StateDictMismatchError, UnsupportedCheckpointError
from ..formats.dcp import DcpContents, DcpIndex
from .consolidate import Plan, TensorPlan
from .segments import Segment
from .training_state import ParamGroup, ParamState, TrainingState

FSDP2, TORCHTITAN = "fsdp2", "torchtitan"
TORCHTITAN_EXTRAS = ("lr_scheduler", "dataloader", "train_state")  # torchtitan's own entries beside the model
PER_ELEMENT = ("exp_avg", "exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta", "ax")


@dataclass(frozen=True)
class ModelNames:
    """The model's own names (built on the meta device): its parameters in order, its persistent buffers, and
    each tied parameter's second name -> the first (``named_parameters(remove_duplicate=False)``)."""
    parameters: tuple[str, ...]
    buffers: frozenset[str] = frozenset()
    ties: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # (what is known) checked against the source

    def check_shapes(self, stored: dict[str, tuple[int, ...]], where: object) -> None:
        wrong = [f"{n} {list(s)} (the model's {list(self.shapes[n])})" for n, s in stored.items()
                 if n in self.shapes and tuple(self.shapes[n]) != tuple(s)]
        if wrong:
            raise StateDictMismatchError(f"shapes differ from the model's: {'; '.join(wrong[:4])}"
                                         f"{' ...' if len(wrong) > 4 else ''}", at=where)


@dataclass(frozen=True)
class DcpState:
    layout: str  # FSDP2 | TORCHTITAN
    state: TrainingState
    step: int  # the training step the source reached (the optimizer's, or torchtitan's train_state)
    notes: tuple[str, ...]
    client_state: dict[str, Any] = field(default_factory=dict)  # what the source kept beside the training state


def split_entries(index: DcpIndex) -> tuple[str, dict[str, str], dict[str, dict[str, str]], dict[Any, dict[str, str]],
                                     list[str]]:
    """Layout, then model entries (fqn -> key), optimizer state (fqn -> state key -> key), group entries
    (group -> setting -> key) and the keys neither holds."""
    missing = [key for key in [*index.tensors, *index.values] if key not in index.paths]
    if missing:
        raise CorruptFileError(f"no saved path for {missing[0]!r} (planner_data); a DCP folder "
                               "written by torch >= 2.4 records one for every key", at=index.metadata_file)
    paths = {key: index.paths[key] for key in [*index.tensors, *index.values]}
    layout = TORCHTITAN if any(p[0] == "optimizer" for p in paths.values()) else FSDP2
    model: dict[str, str] = {}
    state: dict[str, dict[str, str]] = {}
    groups: dict[Any, dict[str, str]] = {}
    other = []
    for key, path in paths.items():
        if layout == FSDP2 and path[0] == "model" and len(path) == 2:
            model[str(path[1])] = key
        elif layout == FSDP2 and path[:2] == ("optim", "state") and len(path) == 4:
            state.setdefault(str(path[2]), {})[str(path[3])] = key
        elif layout == FSDP2 and path[:2] == ("optim", "param_groups") and len(path) == 4:
            groups.setdefault(path[2], {})[str(path[3])] = key
        elif layout == TORCHTITAN and len(path) == 1:
            model[str(path[0])] = key
        elif layout == TORCHTITAN and path[0] == "optimizer" and len(path) == 2 and "." in str(path[1]):
            kind, _, rest = str(path[1]).partition(".")
            fqn, _, name = rest.rpartition(".")
            if kind == "state" and fqn:
                state.setdefault(fqn, {})[name] = key
            elif kind == "param_groups" and fqn:
                groups.setdefault(fqn, {})[name] = key
            else:
                other.append(key)
        else:
            other.append(key)
    return layout, model, state, groups, other


def _tensor_plan(index: DcpIndex, contents: DcpContents, key: str, name: str, kind: str,
                 dtype: str | None = None) -> TensorPlan:
    t = index.tensors.get(key)
    if t is None:
        raise CorruptFileError(f"{key!r} is a value, expected a tensor", at=index.metadata_file)
    pieces = tuple(Segment(path, offset, n) for path, offset, n in contents.ranges[key])
    return TensorPlan(name, t.shape, t.dtype, dtype or t.dtype, kind, pieces)


def build_dcp_state(index: DcpIndex, contents: DcpContents, model: ModelNames | None = None,
                    group_order: tuple[str, ...] | None = None) -> DcpState:
    """``group_order``: torchtitan's layout with parameters of several settings - one parameter of each
    rebuilt group, in the order the DeepSpeed job's optimizer lists its groups."""
    where = index.metadata_file
    layout, entries, state, group_entries, other = split_entries(index)
    if not entries:
        raise UnsupportedCheckpointError(f"no model entries (neither {FSDP2}'s \"model.<fqn>\" nor "
                                         f"{TORCHTITAN}'s top-level <fqn>)", at=where)
    notes = []
    if layout == FSDP2:
        groups = []
        for i in sorted(group_entries, key=lambda g: int(g) if str(g).isdigit() else str(g)):
            settings = {k: contents.values.get(v, contents.scalars.get(v)) for k, v in group_entries[i].items()}
            names = settings.pop("params", None)
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise CorruptFileError(f"param group {i} lists no parameter names", at=where)
            groups.append(ParamGroup(settings, tuple(names)))
    else:
        by_settings: dict[str, tuple[dict[str, Any], list[str]]] = {}
        for fqn in entries:  # model order
            if fqn in group_entries:
                settings = {k: contents.values.get(v, contents.scalars.get(v)) for k, v in group_entries[fqn].items()}
                by_settings.setdefault(repr(sorted(settings.items())), (settings, []))[1].append(fqn)
        groups = _ordered([ParamGroup(settings, tuple(names)) for settings, names in by_settings.values()],
                          group_order, where)
        if group_order is None and len(groups) > 1:
            notes.append(f"the parameters fall into {len(groups)} param groups by their settings, taken in model "
                         f"order ({', '.join(g.params[0] for g in groups)} first): the order the DeepSpeed job's "
                         "optimizer must list them in (--group-order NAME,... sets another)")
    if layout == FSDP2 and group_order is not None:
        raise ConfigError("FSDP2's DCP lists its param groups in order; --group-order is for torchtitan's "
                          "layout, which keeps settings per parameter", at=where)
    trainable = [n for g in groups for n in g.params]
    unknown = [n for n in trainable if n not in entries]
    if unknown:
        raise StateDictMismatchError(f"the optimizer's param groups name {unknown[:5]} "
                                     f"{'...' if len(unknown) > 5 else ''} which the model entries lack", at=where)
    if len(set(trainable)) != len(trainable):
        raise CorruptFileError("a parameter is listed in two param groups", at=where)
    kinds = _kinds(index, entries, set(trainable), model)
    aliases = {n: target for n, (kind, target) in kinds.items() if kind == "tied" and target is not None}
    tensors = [_tensor_plan(index, contents, entries[n], n, kinds[n][0]) for n in entries if kinds[n][0] != "tied"]
    params, steps = [], set()
    for g, group in enumerate(groups):
        group_steps = set()
        for name in group.params:
            found = state.get(name, {})
            moments = {k: _tensor_plan(index, contents, v, name, "param", "F32") for k, v in found.items()
                       if v in index.tensors and index.tensors[v].shape != ()}
            for k, plan in moments.items():
                if plan.shape != index.tensors[entries[name]].shape:
                    raise CorruptFileError(f"{k} of {name!r} has shape {list(plan.shape)}, the parameter "
                                           f"{list(index.tensors[entries[name]].shape)}", at=where)
            step_key = found.get("step")
            if step_key is not None and step_key not in contents.scalars:
                raise UnsupportedCheckpointError(f"the step of {name!r} is not a stored 0-d tensor", at=where)
            group_steps.add(contents.scalars.get(step_key) if step_key else None)
            step = _tensor_plan(index, contents, step_key, "step", "step") if step_key else None
            params.append(ParamState(name, _tensor_plan(index, contents, entries[name], name, "param", "F32"),
                                     moments, step, g))
        if len(group_steps) > 1:
            raise UnsupportedCheckpointError(f"param group {g} holds parameters at different optimizer steps "
                                             f"{sorted(map(str, group_steps))}; ZeRO keeps one step per group", at=where)
        steps |= group_steps
    kept = {k for k in other if index.paths[k][0] in TORCHTITAN_EXTRAS}
    carried_elsewhere = sorted({str(index.paths[k][0]) for k in kept} - {"train_state"})
    if carried_elsewhere:
        notes.append(f"torchtitan's {' and '.join(carried_elsewhere)} state is not carried (DeepSpeed keeps its own)")
    if set(other) - kept:
        notes.append(f"left out {len(set(other) - kept)} entries that are neither model nor optimizer state "
                     f"(first: {sorted(set(other) - kept)[0]!r})")
    reached = training_step(index, contents, other, steps)
    guessed = layout != FSDP2 and group_order is None and len(groups) > 1
    return DcpState(layout, TrainingState(Plan(tuple(tensors), aliases), tuple(params), tuple(groups), guessed),
                    reached, tuple(notes))


def _ordered(groups: list[ParamGroup], order: tuple[str, ...] | None, where: Path) -> list[ParamGroup]:
    """torchtitan's groups (parameters of equal settings) in the order ``order`` names them by one parameter each;
    without one, in model order (each group's first parameter's place)."""
    if order is None:
        return groups
    picked = []
    for name in order:
        owner = [g for g in groups if name in g.params]
        if not owner:
            raise ConfigError(f"--group-order: {name!r} is not a trainable parameter of {where.parent}")
        if owner[0] in picked:
            raise ConfigError(f"--group-order: {name!r} names a group already named")
        picked.append(owner[0])
    if len(picked) != len(groups):
        missing = [g.params[0] for g in groups if g not in picked]
        raise ConfigError(f"--group-order names {len(picked)} of {len(groups)} param groups (none for {missing})")
    return picked


def _kinds(index: DcpIndex, entries: dict[str, str], trainable: set[str],
           model: ModelNames | None) -> dict[str, tuple[str, str | None]]:
    """Per model entry: ("param" | "frozen" | "buffer" | "tied", the tied parameter's first name)."""
    where = index.metadata_file
    if model is not None:
        known = set(model.parameters) | set(model.buffers) | set(model.ties)
        missing, extra = sorted(known - set(entries)), sorted(set(entries) - known)
        if missing or extra:
            raise StateDictMismatchError("the model and the checkpoint disagree - missing from the "
                                         f"checkpoint: {missing[:5]}; not in the model: {extra[:5]}", at=where)
        model.check_shapes({n: index.tensors[k].shape for n, k in entries.items()}, where)
        out: dict[str, tuple[str, str | None]] = {}
        for name in entries:
            if name in model.ties:
                out[name] = ("tied", model.ties[name])
            elif name in model.buffers:
                out[name] = ("buffer", None)
            else:
                out[name] = ("param" if name in trainable else "frozen", None)
        frozen_in_groups = [n for n in trainable if out[n][0] != "param"]
        if frozen_in_groups:
            raise StateDictMismatchError(f"the optimizer holds {frozen_in_groups[:3]}, which the model "
                                         "names as buffers or tied copies", at=where)
        return out
    unclear = [n for n in entries if n not in trainable and index.tensors[entries[n]].dtype in FLOATING]
    if unclear:
        raise ConfigError(f"{len(unclear)} floating-point model entries no optimizer holds "
                          f"({', '.join(unclear[:4])}{', ...' if len(unclear) > 4 else ''}): frozen parameters, "
                          "buffers and a tied parameter's second name look the same in DCP",
                          hint="pass --model MODULE:FACTORY (the model is built on the meta device to read its "
                               "names; no weights are computed)", at=where)
    return {n: ("param" if n in trainable else "buffer", None) for n in entries}


def training_step(index: DcpIndex, contents: DcpContents, other: list[str], steps: set[Any]) -> int:
    """torchtitan's ``train_state.step`` when saved, else the optimizer's step (0 when it never stepped)."""
    for key in other:
        if index.paths[key] == ("train_state", "step"):
            value = contents.scalars.get(key, contents.values.get(key))
            if isinstance(value, (int, float)):
                return int(value)
    numbers = [s for s in steps if isinstance(s, (int, float))]
    return int(max(numbers)) if numbers else 0
