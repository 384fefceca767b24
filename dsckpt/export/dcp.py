"""A ``torch.distributed.checkpoint`` (DCP) folder from a training-state plan, one tensor in memory at a time.

The layout is what ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` gives for
the same model and ``torch.optim.AdamW`` (measured on torch 2.13 with an FSDP2 ``fully_shard`` model)::

    {"model": {fqn: tensor},                        # parameters (frozen too), persistent buffers, tied names
     "optim": {"state": {fqn: {"step": 0-d float32, "exp_avg": ..., "exp_avg_sq": ...}},
               "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}}

which DCP stores flattened ("model.<fqn>", "optim.state.<fqn>.exp_avg", "optim.param_groups.0.lr").
``weights_only`` writes the "model" half.

How: torch's own ``dcp.save`` (no process group: one writer, whole tensors; a loader at any world size
reads the slices it needs) over a state dict of *meta* tensors - shapes and dtypes, no bytes - with a
planner whose ``resolve_data`` reads the tensor asked for (``io.read``) just before ``FileSystemWriter``
writes it.  torch writes its own ``.metadata``, so the folder is what its reader expects at this version.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

from ..dtypes import torch_dtype
from ..formats.pickle_policy import TensorRef
from ..io.read import Reader, torch_tensor
from ..plan.consolidate import TensorPlan
from ..plan.segments import ref_segments
from ..plan.training_state import TrainingState

MODEL_KEY, OPTIM_KEY = "model", "optim"  # the top-level keys of get_state_dict's pair, as users save them


def step_plan(step: Any) -> TensorPlan | float | None:
    """Adam's step as torch.optim.AdamW keeps it: a 0-d float32 tensor (from a stored tensor or a number)."""
    if isinstance(step, TensorRef):
        return TensorPlan("step", (), step.dtype, "F32", "step", ref_segments(step))
    return float(step) if isinstance(step, (int, float)) else None


def write_dcp(state: TrainingState, out: Path, progress: Callable[[int], None] | None = None) -> None:
    """Write ``state`` as a DCP folder at ``out`` (created; must not exist)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    sources: dict[int, TensorPlan] = {}

    def lazy(t: TensorPlan):
        meta = torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta")
        sources[id(meta)] = t
        return meta

    tensors = {t.name: lazy(t) for t in state.model.tensors}
    model = {**tensors, **{alias: tensors[src] for alias, src in state.model.aliases.items()}}
    root: dict[str, Any] = {MODEL_KEY: model}
    if state.params:
        optim_state = {}
        for p in state.params:
            entry = {}
            step = step_plan(p.step)
            if isinstance(step, TensorPlan):
                entry["step"] = lazy(step)
            elif step is not None:
                entry["step"] = torch.tensor(step, dtype=torch.float32)
            entry.update({k: lazy(t) for k, t in p.moments.items()})
            optim_state[p.name] = entry
        groups = [{**g.settings, "params": list(g.params)} for g in state.groups]
        root[OPTIM_KEY] = {"state": optim_state, "param_groups": groups}

    with Reader() as reader:
        class LazyPlanner(DefaultSavePlanner):
            """Reads each tensor from the checkpoint when the writer asks for it."""

            def resolve_data(self, write_item):
                planned = sources.get(id(self.lookup_object(write_item.index)))
                if planned is None:
                    return super().resolve_data(write_item)
                tensor = torch_tensor(reader, planned)
                if progress:
                    progress(planned.nbytes)
                return tensor

        writer = dcp.FileSystemWriter(str(out), thread_count=1)  # one Reader: its buffers serve one thread
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save(root, storage_writer=writer, planner=LazyPlanner())
