"""The optimizer side of the checkpoint model: per rank and flat group, typed, as tensor references.

What DeepSpeed 0.19.8 keeps in each ``*_optim_states.pt`` (key names in ``layout``):

``optimizer_state_dict`` (DeepSpeed's ZeRO optimizer state) holds, at every stage, ``loss_scaler`` (a
DeepSpeed object, read as an opaque record of its fields), ``dynamic_loss_scale``, ``overflow``,
``partition_count``, and:

* stage 1/2: ``single_partition_of_fp32_groups`` (one flat fp32 partition per param group),
  ``param_alignment_paddings``, and ``base_optimizer_state`` - the torch optimizer's own
  ``{"state": {group index: {"exp_avg", "exp_avg_sq", "step"}}, "param_groups": [...]}``;
* stage 3: ``fp32_flat_groups`` (one flat partition per sub-group) and ``optimizer_state_dict``, the
  torch optimizer's ``{"state": {sub-group index: ...}, "param_groups": [...]}``.

``rank_states(ckpt)`` turns those into ``RankState`` records; nothing else needs the key names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import layout as L
from .offloaded import attach
from ..errors import InconsistentCheckpointError
from ..formats.pickle_policy import Opaque, TensorRef

if TYPE_CHECKING:
    from ..formats.torchzip import TorchFile

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def per_element(state: dict[str, Any], numel: int) -> dict[str, TensorRef]:
    """The optimizer's per-element state of one flat group: every tensor as long as the partition (Adam's
    ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``, Adagrad's ``sum``, Muon's), Adam's first."""
    keys = sorted((k for k, v in state.items() if isinstance(v, TensorRef) and v.numel == numel and numel > 1),
                  key=lambda k: (k not in ADAM_MOMENTS, ADAM_MOMENTS.index(k) if k in ADAM_MOMENTS else 0, str(k)))
    return {k: state[k] for k in keys}


@dataclass(frozen=True)
class GroupState:
    """One rank's partition of one flat group (a param group; at stage 3 a sub-group)."""

    fp32: TensorRef  # the fp32 master partition
    moments: dict[str, TensorRef] = field(default_factory=dict)  # per-element state ("exp_avg"...), laid out as fp32
    step: Any = None  # Adam's step count: a 0-d tensor reference or a number
    hyperparams: dict[str, Any] = field(default_factory=dict)  # lr, betas, eps, weight_decay, ...
    trimmed: int = 0  # stage 1/2: tail padding left out of the saved fp32 partition (moments hold it)
    param_group: int = 0  # the torch optimizer's param group this flat group belongs to (stage 3: sub-groups share one)


@dataclass(frozen=True)
class RankState:
    rank: int
    path: Path
    groups: tuple[GroupState, ...]
    alignment_paddings: tuple[tuple[int, ...], ...] | None  # stage 1/2, per group, per parameter
    loss_scaler: dict[str, Any]  # the scaler's recorded fields (cur_scale, ...), {} when unknown


def rank_states(ckpt: Any) -> list[RankState]:  # (a zero.reader.Checkpoint: the reader imports this module)
    """The typed optimizer state of every rank, in rank order (empty at stage 0); a ZeRO-Infinity run's sub-groups
    on NVMe read from their swap files (``offloaded``)."""
    return attach(ckpt, [_rank_state(ckpt.zero_stage, r, f) for r, f in enumerate(ckpt.optim_files)])


def _rank_state(stage: int, rank: int, tf: TorchFile) -> RankState:
    try:
        osd = tf.obj[L.OPTIMIZER_STATE_DICT]
        if stage == 3:
            flats, torch_state = osd[L.FP32_FLAT_GROUPS], osd[L.OPTIMIZER_STATE_DICT]
            paddings = None
        else:
            flats, torch_state = osd[L.SINGLE_PARTITION_OF_FP32_GROUPS], osd.get(L.BASE_OPTIMIZER_STATE, {})
            raw = osd.get(L.PARAM_ALIGNMENT_PADDINGS)
            paddings = tuple(tuple(int(p) for p in g) for g in raw) if raw is not None else None
        trims = [int(p) for p in osd.get(L.GROUP_PADDINGS) or []] if stage != 3 else []
        per_group = torch_state.get("state", {}) if isinstance(torch_state, dict) else {}
        hyper, owner = _hyperparams(torch_state.get("param_groups", []) if isinstance(torch_state, dict) else [])
        groups = []
        for g, flat in enumerate(flats):
            if not isinstance(flat, TensorRef):
                raise TypeError(f"flat group {g} is a {type(flat).__name__}")
            state = per_group.get(g, {})
            trimmed = trims[g] if g < len(trims) else 0
            moments = per_element(state, flat.numel + trimmed)
            for name in ADAM_MOMENTS:
                ref = state.get(name)
                if isinstance(ref, TensorRef) and ref.numel != flat.numel + trimmed:
                    raise ValueError(f"group {g} {name} holds {ref.numel} elements, its fp32 partition {flat.numel}"
                                     + (f" + {trimmed} of trimmed padding" if trimmed else ""))
            groups.append(GroupState(flat, moments, state.get("step"), hyper.get(g, {}), trimmed, owner.get(g, g)))
        scaler = osd.get(L.LOSS_SCALER)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InconsistentCheckpointError(f"unexpected optimizer-state structure ({exc})", at=tf.path) from None
    return RankState(rank, tf.path, tuple(groups), paddings, _fields(scaler))


def _hyperparams(param_groups: list[Any]) -> tuple[dict[int, dict[str, Any]], dict[int, int]]:
    """Flat-group index -> its param group's settings, and -> that param group's index (``params`` lists
    the flat groups a param group owns)."""
    settings_of, owner = {}, {}
    for i, group in enumerate(param_groups if isinstance(param_groups, list) else []):
        if not isinstance(group, dict):
            continue
        settings = {k: v for k, v in group.items() if k != "params"}
        for index in group.get("params", [i]):
            if isinstance(index, int):
                settings_of[index], owner[index] = settings, i
    return settings_of, owner


def _fields(scaler: Any) -> dict[str, Any]:
    if isinstance(scaler, Opaque) and isinstance(scaler.state, dict):
        return dict(scaler.state)
    return {}
