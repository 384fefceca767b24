"""Resharding a mixture-of-experts run to another ep_size (``reshard --ep-size``): experts change ranks.

At ep_size E a layer's N experts sit N/E per expert-parallel rank; at E' they sit N/E' per rank, so
expert G moves from ep rank ``G // (N/E)`` (local id ``G % (N/E)``) to ep rank ``G // (N/E')`` (local id
``G % (N/E')``).  Per expert optimizer group (``zero.experts``), pure bookkeeping:
1. the source: every ep rank's flat group at N, joined into one layout whose ranks are all of theirs
   (``joined_source``), so one parameter index names one expert tensor of one ep rank;
2. per target ep rank e': its recorded names - layer by layer, local ids 0 .. N/E'-1, each expert's
   tensors in the order DeepSpeed records them - laid out over its M / E' ranks (``partitioning``), and
   for each of its parameters the source parameter that holds the same global expert's tensor;
3. the records that name the ep_size or the local experts: the optimizer group's name ``ep_size_{E'}``
   and rank 0's ``param_shapes`` (ep rank 0's local experts), rewritten by the reshard plan.
The expert files need nothing: they are named by global id.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from ..errors import UnsupportedCheckpointError
from ..formats.pickle_policy import TorchSize
from ..zero.experts import EXPERTS_MARK, LOCAL_ID, edp_ranks
from ..zero.partitioning import GroupLayout, stage12_group
from .groups import FlatGroup


def joined_source(groups: list[FlatGroup]) -> tuple[GroupLayout, tuple[int, ...]]:
    """The ep ranks' flat groups as one layout: parameters back to back, each group's ranks renumbered after
    the previous group's (positions index the joined rank list)."""
    params: list[tuple[Any, ...]] = []
    ranks: list[int] = []
    for group in groups:
        offset = len(ranks)
        params += [tuple(replace(span, rank=span.rank + offset) for span in spans) for spans in group.layout.params]
        ranks += group.ranks
    first = groups[0].layout
    return GroupLayout(len(ranks), first.partition_numel, tuple(params), first.used_numel), tuple(ranks)


def target_names(recorded: tuple[str, ...], experts: dict[str, int], ep_size: int) -> tuple[str, ...]:
    """The names an ep rank records at ``ep_size``: per layer (``experts``: layer path -> number of experts, in
    order), local ids 0 .. N/ep_size - 1, each with the tensors expert 0 has in ``recorded``."""
    out = []
    for prefix, count in experts.items():
        head = f"{prefix}{EXPERTS_MARK}0."
        suffixes = [name[len(head):] for name in recorded if name.startswith(head)]
        out += [f"{prefix}{EXPERTS_MARK}{local}.{suffix}" for local in range(count // ep_size) for suffix in suffixes]
    return tuple(out)


def moved_expert_groups(groups: list[FlatGroup], experts: dict[str, int], new_ep: int, world_size: int, where: object
                        ) -> list[tuple[tuple[str, ...], GroupLayout, tuple[int, ...], tuple[int, ...]]]:
    """Per target ep rank: (recorded names, target layout over its ranks, those ranks, for each target parameter
    the index of its source parameter in ``joined_source(groups)``)."""
    old_ep = len(groups)
    if any(any(g.paddings or ()) for g in groups):
        raise UnsupportedCheckpointError("an expert group with parameter alignment paddings; changing "
                                         "its ep_size is not supported", at=where)
    index = {}  # (layer path, global id, tensor suffix) -> index in the joined source
    for e, group in enumerate(groups):
        for j, name in enumerate(group.recorded):
            prefix, rest = name.split(EXPERTS_MARK, 1)
            local, suffix = rest.split(".", 1)
            index[(prefix, e * experts[prefix] // old_ep + int(local), suffix)] = sum(len(g.recorded) for g in groups[:e]) + j
    shapes = {name: shape for group in groups[:1] for name, shape in zip(group.recorded, group.shapes)}
    out = []
    for e in range(new_ep):
        names = target_names(groups[0].recorded, experts, new_ep)
        sources = []
        for name in names:
            prefix, rest = name.split(EXPERTS_MARK, 1)
            local, suffix = rest.split(".", 1)
            sources.append(index[(prefix, e * experts[prefix] // new_ep + int(local), suffix)])
        numels = [math.prod(shapes[LOCAL_ID.sub(f"{EXPERTS_MARK}0.", n, count=1)]) for n in names]
        ranks = edp_ranks(e, new_ep, world_size)
        out.append((names, stage12_group(numels, len(ranks)), ranks, tuple(sources)))
    return out


def rewritten_shapes(param_shapes: list[Any], groups: dict[int, tuple[str, ...]],
                     shapes: dict[str, tuple[int, ...]]) -> list[Any]:
    """Rank 0's ``param_shapes`` with each moved expert group listing ep rank 0's new local experts."""
    out = list(param_shapes)
    for g, names in groups.items():
        out[g] = type(param_shapes[g])((n, TorchSize(shapes[LOCAL_ID.sub(f"{EXPERTS_MARK}0.", n, count=1)]))
                                       for n in names)
    return out


def renamed_groups(param_groups: list[Any], groups: dict[int, int]) -> list[Any]:
    """The torch optimizer's param groups with each moved expert group named for its new ep_size."""
    out = []
    for g, group in enumerate(param_groups):
        if g in groups and isinstance(group, dict):
            group = OrderedDict(group) if isinstance(group, OrderedDict) else dict(group)
            group["name"] = f"ep_size_{groups[g]}"
        out.append(group)
    return out
