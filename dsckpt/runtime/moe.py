"""DeepSpeed-MoE models in the runtime: their optimizer groups, and expert parameters under the names a
consolidated file gives them.

Inside a rank, an MoE layer's experts are named by local ids (``...deepspeed_experts.{0..N/E-1}...``); a file
``dsckpt consolidate`` wrote names them by global id (``zero/experts.py``): expert-parallel rank e holds
global ids ``e * N/E + local``.  With ep_size 1 the two coincide.
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..zero.experts import LOCAL_ID


def is_moe_model(module: torch.nn.Module) -> bool:
    from deepspeed.moe.layer import MoE

    return any(isinstance(m, MoE) for m in module.modules())


def optimizer_groups(module: torch.nn.Module, params: list[torch.nn.Parameter]) -> list | Iterable:
    """What the optimizer gets: DeepSpeed-MoE needs the experts in groups of their own (``moe: True``,
    named ``ep_size_E``) - its ZeRO optimizer partitions them over the expert-data-parallel group."""
    if not is_moe_model(module):
        return params
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "params"})


def ep_size_of(param: torch.nn.Parameter) -> int:
    """1 for a dense parameter; an expert's expert-parallel size (its group is named ``ep_size_E``)."""
    if getattr(param, "allreduce", True) is not False:
        return 1
    return int(str(getattr(param, "group_name", "ep_size_1")).rsplit("_", 1)[1])


def ep_rank_of(param: torch.nn.Parameter) -> int:
    from deepspeed.utils import groups

    return groups._get_expert_parallel_rank(getattr(param, "group_name")) if ep_size_of(param) > 1 else 0


def local_experts(module: torch.nn.Module) -> dict[str, int]:
    """MoE layer path -> experts per expert-parallel rank."""
    from deepspeed.moe.layer import MoE

    return {name: m.num_local_experts for name, m in module.named_modules() if isinstance(m, MoE)}


def global_name(name: str, ep_rank: int, per_rank: dict[str, int]) -> str:
    """``name`` (an expert parameter, by local id) as expert-parallel rank ``ep_rank`` holds it, by global id."""
    match = LOCAL_ID.search(name)
    if match is None:
        raise ValueError(f"{name!r} is no expert parameter")
    layer = name[:match.start()]
    global_id = ep_rank * per_rank[layer] + int(match.group(1))
    return f"{name[:match.start(1)]}{global_id}{name[match.end(1):]}"
