"""The names only a model knows (``plan.from_dcp.ModelNames``), from its factory built on the meta device: no
weights are computed, a 70B model's names take a second."""
from __future__ import annotations

import torch

from ..plan.from_dcp import ModelNames
from .train import load_factory


def model_names(spec: str) -> ModelNames:
    """``spec``: "package.module:factory", as ``dsckpt train --model`` takes it."""
    factory = load_factory(spec)
    with torch.device("meta"):
        model = factory()
    first: dict[int, str] = {}
    parameters, ties = [], {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[name] = first[id(param)]
        else:
            first[id(param)] = name
            parameters.append(name)
    persistent = set(model.state_dict(keep_vars=True))
    buffers = frozenset(n for n, _ in model.named_buffers() if n in persistent)
    return ModelNames(tuple(parameters), buffers, ties)
