"""A live DeepSpeed AutoTP model's split: which part of each full tensor this rank holds.

DeepSpeed records the split on the model (``universal_checkpoint_info``, what it also saves in every checkpoint);
``TPModel`` turns it into ``zero.tensor_parallel.Split``s - the same rules ``consolidate`` joins a checkpoint by -
and cuts this rank's slice out of a full tensor (``local``).  None without tensor parallelism.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..zero.tensor_parallel import INFO, Split, tp_splits


class TPModel:
    def __init__(self, splits: dict[str, Split], tp_rank: int, aliases: dict[str, str] | None = None):
        self.splits, self.tp_rank = splits, tp_rank
        self.aliases = aliases or {}  # a tied name -> the name its parameter is split under

    def _split(self, name: str) -> Split | None:
        return self.splits.get(self.aliases.get(name, name))

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        split = self._split(name)
        return tuple(split.shape) if split else local

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of ``full`` (a tensor not in the split description: all of it)."""
        split = self._split(name)
        if split is None:
            return full
        rows = full.reshape(split.count, -1)
        parts, at = [], 0
        for block in split.blocks:
            step = block.numel
            if block.rank == self.tp_rank:
                parts.append((block.start, rows[:, at:at + step]))
            at += step
        if not parts:  # a replicated tensor this rank holds a copy of
            return full
        parts.sort(key=lambda p: p[0])
        return torch.cat([p for _, p in parts], dim=1).reshape(-1)


def tp_model(engine: Any) -> TPModel | None:
    """The split of ``engine``'s module across its TP ranks (every rank calls this: it gathers the ranks' shapes)."""
    from deepspeed.utils import groups

    autotp = getattr(engine, "autotp_size", None)
    size = autotp() if callable(autotp) else 1
    if size <= 1:
        return None
    info = getattr(engine.module, INFO, None) or {}
    local = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (groups.get_tensor_model_parallel_rank(), local))
    shapes = [next(s for r, s in gathered if r == t) for t in range(size)]
    canonical = {id(p): n for n, p in engine.module.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in engine.module.named_parameters(remove_duplicate=False)}
    return TPModel(tp_splits(info, shapes, "the model's universal_checkpoint_info"),
                   groups.get_tensor_model_parallel_rank(), aliases)
