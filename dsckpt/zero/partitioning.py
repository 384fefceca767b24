"""DeepSpeed ZeRO's partitioning rules as pure functions: where each parameter's elements live.

No files, no tensors: given the parameters' element counts and the world size, these say which
rank holds which elements of which parameter, at which offset of that rank's flat partition.
The consolidation planner (and any future resharder) maps these element ranges to bytes.

Stage 1/2 (``stage12_group``), per optimizer param group, as DeepSpeed 0.19.8 builds it
(``DeepSpeedZeroOptimizer.__init__``, ``stage_1_and_2.py``):
1. parameters are laid back to back in group order; after each but the last, its alignment
   padding (``param_alignment_paddings``: 0 unless parameter alignment is on);
2. the flat buffer is padded up to a multiple of ``2 * world_size`` elements
   (``nccl_start_alignment_factor`` x world size);
3. rank r holds the r-th of ``world_size`` equal slices; a parameter may straddle ranks;
4. saved, each rank's fp32 partition loses its tail padding (``stage12_trimmed``), its moments do not.

Stage 3 (``stage3_group``), per sub-group (``fp32_flat_groups`` entry):
1. each parameter is split on its own into ``ceil(n / world_size)``-element parts; rank r holds
   elements ``[r * part, (r + 1) * part)``, clipped to n (the last ranks hold padding, or nothing);
2. a rank's flat partition is its parts of the sub-group's parameters, back to back, padding
   included (every rank's partition has the same size: the sum of the parts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

NCCL_START_ALIGNMENT_FACTOR = 2  # DeepSpeed's stage 1/2 flat-buffer alignment, in elements per rank


@dataclass(frozen=True)
class Span:
    """``count`` elements of a parameter, starting at its element ``param_start``, held by ``rank``
    at element ``rank_start`` of that rank's flat partition."""

    rank: int
    rank_start: int
    param_start: int
    count: int


@dataclass(frozen=True)
class GroupLayout:
    """Where every parameter of one flat group lives; ``partition_numel`` elements per rank."""

    world_size: int
    partition_numel: int
    params: tuple[tuple[Span, ...], ...]  # per parameter, in group order, its spans in element order
    used_numel: int  # elements the parameters (and their alignment paddings) occupy, before the tail padding


def parameter_alignment(paddings: list[int], itemsize: int) -> int:
    """Elements per alignment unit when DeepSpeed's parameter alignment was on (16 bytes), else 1.

    A checkpoint records the paddings, not the setting: any non-zero padding means it was on (with
    all paddings zero, both settings give the same layout except for the last parameter's rounding,
    which ``stage12_group`` then cannot see either way - and DeepSpeed's own size check is the same).
    """
    return 16 // math.gcd(16, itemsize) if any(paddings) else 1


def stage12_group(numels: list[int], world_size: int, paddings: list[int] | None = None,
                  alignment: int = 1) -> GroupLayout:
    """Stage 1/2: one param group's flat buffer cut into ``world_size`` equal partitions.

    ``alignment`` (elements): with DeepSpeed's parameter alignment on, the buffer is sized for every
    parameter rounded up to it - the last one's rounding included, though no padding follows it.
    """
    _check(numels, world_size)
    paddings = paddings if paddings is not None else [0] * len(numels)
    if len(paddings) != len(numels) or any(p < 0 for p in paddings):
        raise ValueError(f"{len(numels)} parameters but paddings {paddings!r}")
    align = NCCL_START_ALIGNMENT_FACTOR * world_size
    used = sum(numels) + sum(paddings)
    sized = sum(numels) + sum((-n) % alignment for n in numels)  # DeepSpeed's max_param_padding
    partition = math.ceil(max(used, sized) / align) * align // world_size
    layout, offset = [], 0
    for n, pad in zip(numels, paddings):
        spans = []
        start = offset
        while start < offset + n:
            rank = start // partition
            end = min(offset + n, (rank + 1) * partition)
            spans.append(Span(rank, start - rank * partition, start - offset, end - start))
            start = end
        layout.append(tuple(spans))
        offset += n + pad
    return GroupLayout(world_size, partition, tuple(layout), used)


def stage12_trimmed(layout: GroupLayout, rank: int) -> int:
    """Tail padding DeepSpeed trims from ``rank``'s saved fp32 partition (its ``group_paddings`` entry):
    the part of the partition past the parameters; Adam's moments keep it (zeros)."""
    start = rank * layout.partition_numel
    return max(0, min(layout.partition_numel, start + layout.partition_numel - layout.used_numel))


def stage3_part(numel: int, world_size: int) -> int:
    """Elements of one parameter that each rank holds at stage 3 (padding included)."""
    return math.ceil(numel / world_size)


def stage3_group(numels: list[int], world_size: int) -> GroupLayout:
    """Stage 3: every parameter split on its own; each rank's partition is its parts back to back."""
    _check(numels, world_size)
    layout, offset = [], 0
    for n in numels:
        part = stage3_part(n, world_size)
        spans = tuple(Span(r, offset, r * part, min(part, n - r * part))
                      for r in range(world_size) if n - r * part > 0)
        layout.append(spans)
        offset += part
    return GroupLayout(world_size, offset, tuple(layout), offset)


def _check(numels: list[int], world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if any(not isinstance(n, int) or n < 0 for n in numels):
        raise ValueError("element counts must be non-negative integers")
