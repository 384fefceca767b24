"""The checkpoint's flat optimizer groups, laid out as DeepSpeed laid them out: one recipe for every plan.

``group_layouts(ckpt)`` says, per flat group, which parameters it holds (in flat order) and where each
rank's partition holds their elements at the checkpoint's world size (``zero.partitioning``):
* ZeRO-1/2: one flat group per optimizer param group, with the recorded alignment paddings;
* ZeRO-3: one per sub-group (``fp32_flat_groups`` entry); the recorded shapes do not say where
  DeepSpeed cut the sub-groups, so the cut is recovered from rank 0's partition sizes.
``FlatGroup.at(M)`` is the same group laid out for M ranks (same stage).  The consolidation plan
reads parameters out of these layouts; the reshard plan moves them from one layout to another.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

from ..dtypes import ITEMSIZE, canonical
from ..errors import InconsistentCheckpointError
from ..zero.partitioning import GroupLayout, parameter_alignment, stage3_group, stage12_group
from ..zero.reader import Checkpoint


@dataclass(frozen=True)
class FlatGroup:
    names: tuple[str, ...]
    numels: tuple[int, ...]
    layout: GroupLayout  # at the checkpoint's world size
    stage: int
    paddings: tuple[int, ...] | None = None  # stage 1/2: param_alignment_paddings as recorded
    alignment: int = 1  # stage 1/2: the parameter alignment those paddings imply

    def at(self, world_size: int) -> GroupLayout:
        """The same group at ``world_size`` ranks, as DeepSpeed lays it out at the same stage."""
        if self.stage == 3:
            return stage3_group(list(self.numels), world_size)
        return stage12_group(list(self.numels), world_size, list(self.paddings) if self.paddings is not None else None,
                             self.alignment)


def group_layouts(ckpt: Checkpoint) -> list[FlatGroup]:
    return stage3_groups(ckpt) if ckpt.zero_stage == 3 else stage12_groups(ckpt)


def stage12_groups(ckpt: Checkpoint) -> list[FlatGroup]:
    paddings = ckpt.optimizer_states[0].alignment_paddings
    itemsize = ITEMSIZE[canonical(ckpt.precision)]
    out = []
    for g, shapes in enumerate(ckpt.param_groups):
        numels = tuple(math.prod(s) for s in shapes.values())
        pad = tuple(paddings[g]) if paddings is not None else None
        if pad is not None and len(pad) != len(numels):
            raise InconsistentCheckpointError(f"{ckpt.optim_files[0].path}: group {g} has {len(numels)} parameters "
                                              f"but {len(pad)} alignment paddings")
        align = parameter_alignment(list(pad or []), itemsize)
        layout = stage12_group(list(numels), ckpt.world_size, list(pad) if pad is not None else None, align)
        out.append(FlatGroup(tuple(shapes), numels, layout, ckpt.zero_stage, pad, align))
    return out


def stage3_groups(ckpt: Checkpoint) -> list[FlatGroup]:
    """Each sub-group's parameters, recovered from its partition size at N: parameters in order until
    their parts fill it (empty parameters at the very end belong to the last)."""
    names = list(ckpt.trainable)
    numels = [math.prod(ckpt.trainable[n]) for n in names]
    states = ckpt.optimizer_states[0].groups
    out, i = [], 0
    for g, state in enumerate(states):
        start, size = i, 0
        while i < len(names) and size < state.fp32.numel:
            size += math.ceil(numels[i] / ckpt.world_size)
            i += 1
        while i < len(names) and numels[i] == 0 and g == len(states) - 1:
            i += 1
        if size != state.fp32.numel:
            raise InconsistentCheckpointError(f"{ckpt.optim_files[0].path}: sub-group {g} holds {state.fp32.numel} "
                                              "elements, which no run of the recorded parameters fills")
        part = tuple(numels[start:i])
        out.append(FlatGroup(tuple(names[start:i]), part, stage3_group(list(part), ckpt.world_size), 3))
    if i != len(names):
        raise InconsistentCheckpointError(f"{ckpt.optim_files[0].path}: the sub-groups hold {i} of the "
                                          f"{len(names)} trainable parameters")
    return out


@contextlib.contextmanager
def structure_errors(ckpt: Checkpoint) -> Iterator[None]:
    """A structure DeepSpeed never writes (a damaged or foreign file) met while planning: a typed error."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        raise InconsistentCheckpointError(f"{ckpt.layout.tag_dir}: unexpected checkpoint structure "
                                          f"({type(exc).__name__}: {exc})") from None
