"""Pipeline-parallel checkpoints (DeepSpeed's ``PipelineModule``): what each stage wrote and where its layers are.

DeepSpeed 0.19.8 writes, per stage ``s`` (ZeRO 0/1 only; ``mp_rank`` is the stage when there is no TP):
* ``mp_rank_{s:02d}_model_states.pt`` with ``module`` None, and ``param_shapes`` / ``buffer_names`` under
  ``PipelineModule``'s names: ``{layer index}.{key}``, and ``tied_modules.{key}.{...}`` for a ``TiedLayerSpec``
  (held by every stage that uses it, kept equal by DeepSpeed);
* ``zero_pp_rank_{dp}_mp_rank_{s:02d}_optim_states.pt``: the stage's flat fp32 partitions, as any ZeRO-1 run;
* ``layer_{i:02d}-model_states.pt`` per layer (written by data-parallel rank 0): the layer's own ``state_dict`` in
  the module's dtype - its buffers and frozen parameters live only here.

``zero.reader`` opens each stage as a data-parallel checkpoint whose ``module`` is its layers' tensors from these
files (``stage_layers``); ``plan.consolidate`` joins the stages, tied copies compared.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import DsckptError, UnsupportedCheckpointError
from ..formats.pickle_policy import TensorRef
from ..formats.torchzip import TorchFile
from .layout import PIPELINE_LAYER_RE
from .tensor_parallel import PARALLEL_DIMENSIONS

TIED_PREFIX = "tied_modules."


def layer_index(name: str) -> int | None:
    """The layer a PipelineModule name belongs to (``3.up.weight`` -> 3); None for tied modules."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def layer_tensors(files: tuple[Path, ...]) -> tuple[dict[str, TensorRef], list[tuple[type, str]]]:
    """Every layer file's tensors under ``{layer}.{key}``; an unreadable or foreign entry is a problem."""
    out: dict[str, TensorRef] = {}
    problems: list[tuple[type, str]] = []
    for path in sorted(files):
        match = PIPELINE_LAYER_RE.match(path.name)
        if match.group("mp") is not None and int(match.group("mp")):
            continue  # PP x TP: other TP ranks' copies of the layer (refused by stage_problems)
        try:
            state = TorchFile(path).obj
        except DsckptError as exc:
            problems.append((type(exc), str(exc)))
            continue
        if not isinstance(state, dict):
            problems.append((UnsupportedCheckpointError, f"{path}: a layer file holding a {type(state).__name__}, "
                             "expected a state dict"))
            continue
        layer = int(match.group("layer"))
        out.update((f"{layer}.{key}", ref) for key, ref in state.items() if isinstance(ref, TensorRef))
    return out, problems


def stage_layers(layers: dict[str, TensorRef], names: list[str]) -> dict[str, TensorRef]:
    """The tensors of the layers a stage's recorded ``names`` belong to (a tied layer's file is the tied module
    under its own index, and stands in for nothing: its values come from the optimizer files)."""
    mine = {layer_index(n) for n in names} - {None}
    return {n: ref for n, ref in layers.items() if layer_index(n) in mine}


def stage_problems(layout: Any, heads: list[tuple[Path, dict]]) -> list[tuple[type, str]]:
    """What dsckpt cannot join yet: pipeline stages that are also tensor parallel."""
    path, head = heads[0]
    dims = head.get(PARALLEL_DIMENSIONS) if isinstance(head, dict) else None
    tp = dims.get("tp_degree", 1) if isinstance(dims, dict) else 1
    if tp != 1 or any(PIPELINE_LAYER_RE.match(p.name).group("mp") not in (None, "00") for p in layout.pipeline_files):
        return [(UnsupportedCheckpointError, f"{path}: pipeline stages that are also tensor parallel (tp {tp}); "
                 "dsckpt joins pipeline stages or TP slices, not both yet")]
    return []


def stage_map(stages: list[Any]) -> list[dict[str, Any]]:
    """Per stage: its layer indices and the tied modules it holds, for ``inspect``."""
    out = []
    for s, ckpt in enumerate(stages):
        names = list(ckpt.trainable) + list(ckpt.frozen) + list(ckpt.buffers)
        out.append({"stage": s, "layers": sorted({layer_index(n) for n in names} - {None}),
                    "tied": sorted({re.sub(r"^tied_modules\.([^.]+)\..*$", r"\1", n) for n in names
                                    if n.startswith(TIED_PREFIX)})})
    return out
