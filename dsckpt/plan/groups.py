"""The checkpoint's flat optimizer groups, laid out as DeepSpeed laid them out: one recipe for every plan.

``group_layouts(ckpt)`` says, per flat group, which parameters it holds (in flat order) and where each
rank's partition holds their elements at the checkpoint's world size (``zero.partitioning``):
* ZeRO-1/2: one flat group per optimizer param group, with the recorded alignment paddings (a group of
  mixture-of-experts experts: one per expert-parallel rank, over its expert-data-parallel ranks);
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
from ..zero.experts import edp_ranks, is_expert
from ..zero.reader import Checkpoint


@dataclass(frozen=True)
class FlatGroup:
    index: int  # the optimizer's flat group (param group at stage 1/2, sub-group at stage 3)
    names: tuple[str, ...]  # as written out (an expert under its global id)
    shapes: tuple[tuple[int, ...], ...]
    layout: GroupLayout  # at the checkpoint's world size (an expert group: its expert-data-parallel size)
    stage: int
    ranks: tuple[int, ...]  # the checkpoint ranks whose partitions these are, in partition order
    recorded: tuple[str, ...]  # the names as the optimizer records them (an expert by its local id)
    paddings: tuple[int, ...] | None = None  # stage 1/2: param_alignment_paddings as recorded
    alignment: int = 1  # stage 1/2: the parameter alignment those paddings imply
    ep_size: int = 1  # a group of experts: the expert-parallel size (its ranks are every ep_size-th from its ep rank)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    def ranks_at(self, world_size: int) -> tuple[int, ...]:
        """The ranks holding this group's partitions at ``world_size`` (the same expert-parallel rank)."""
        return edp_ranks(self.ranks[0], self.ep_size, world_size) if self.ep_size > 1 else tuple(range(world_size))

    def at(self, world_size: int) -> GroupLayout:
        """The same group at ``world_size`` ranks, as DeepSpeed lays it out at the same stage."""
        world_size = len(self.ranks_at(world_size))
        if self.stage == 3:
            return stage3_group(list(self.numels), world_size)
        return stage12_group(list(self.numels), world_size, list(self.paddings) if self.paddings is not None else None,
                             self.alignment)


def group_layouts(ckpt: Checkpoint) -> list[FlatGroup]:
    return stage3_groups(ckpt) if ckpt.zero_stage == 3 else stage12_groups(ckpt)


def stage12_groups(ckpt: Checkpoint) -> list[FlatGroup]:
    """One per param group; a group of experts (``zero.experts``) once per expert-parallel rank, laid out
    over that rank's expert-data-parallel group, its parameters under their global expert ids."""
    paddings = ckpt.optimizer_states[0].alignment_paddings
    itemsize = ITEMSIZE[canonical(ckpt.precision)]
    world = ckpt.world_size
    expert_groups = ckpt.experts.groups if ckpt.experts else {}
    out = []
    for g, shapes in enumerate(ckpt.param_groups):
        numels = [math.prod(s) for s in shapes.values()]
        pad = tuple(paddings[g]) if paddings is not None else None
        if pad is not None and len(pad) != len(numels):
            raise InconsistentCheckpointError(f"group {g} has {len(numels)} parameters "
                                              f"but {len(pad)} alignment paddings", at=ckpt.optim_files[0].path)
        align = parameter_alignment(list(pad or []), itemsize)
        ep_size = expert_groups.get(g, 1)
        layout = stage12_group(numels, world // ep_size, list(pad) if pad is not None else None, align)
        for ep in range(ep_size):
            experts = ckpt.experts
            names = tuple(shapes) if g not in expert_groups or experts is None else \
                tuple(experts.global_name(n, ep) if is_expert(n) else n for n in shapes)
            out.append(FlatGroup(g, names, tuple(shapes.values()), layout, ckpt.zero_stage,
                                 edp_ranks(ep, ep_size, world), tuple(shapes), pad, align, ep_size))
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
            raise InconsistentCheckpointError(f"sub-group {g} holds {state.fp32.numel} "
                                              "elements, which no run of the recorded parameters fills", at=ckpt.optim_files[0].path)
        out.append(FlatGroup(g, tuple(names[start:i]), tuple(ckpt.trainable[n] for n in names[start:i]),
                             stage3_group(numels[start:i], ckpt.world_size), 3, tuple(range(ckpt.world_size)),
                             tuple(names[start:i])))
    if i != len(names):
        raise InconsistentCheckpointError(f"the sub-groups hold {i} of the "
                                          f"{len(names)} trainable parameters", at=ckpt.optim_files[0].path)
    return out


@contextlib.contextmanager
def structure_errors(ckpt: Checkpoint) -> Iterator[None]:
    """A structure DeepSpeed never writes (a damaged or foreign file) met while planning: a typed error."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        raise InconsistentCheckpointError("unexpected checkpoint structure "
                                          f"({type(exc).__name__}: {exc})", at=ckpt.layout.tag_dir) from None
