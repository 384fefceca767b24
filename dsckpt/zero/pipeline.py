"""Pipeline-parallel checkpoints (DeepSpeed's ``PipelineModule``): what each stage wrote and where its layers are.

DeepSpeed 0.19.8 writes, per stage ``s`` (ZeRO 0/1 only; ``mp_rank`` is the stage when there is no TP):
* ``mp_rank_{s:02d}_model_states.pt`` with ``module`` None, and ``param_shapes`` / ``buffer_names`` under
  ``PipelineModule``'s names: ``{layer index}.{key}``, and ``tied_modules.{key}.{...}`` for a ``TiedLayerSpec``
  (held by every stage that uses it, kept equal by DeepSpeed);
* ``zero_pp_rank_{dp}_mp_rank_{s:02d}_optim_states.pt``: the stage's flat fp32 partitions, as any ZeRO-1 run;
* ``layer_{i:02d}-model_states.pt`` per layer (written by data-parallel rank 0): the layer's own ``state_dict`` in
  the module's dtype - its buffers and frozen parameters live only here; with TP (``PipeModelDataParallelTopology``)
  ``layer_{i:02d}-model_{t:02d}-model_states.pt`` per TP rank, and ``mp_rank_{s * tp + t:02d}`` files.

``zero.reader`` opens each stage as a data-parallel checkpoint whose ``module`` is its layers' tensors from these
files (``layer_owners``); ``plan.consolidate`` joins the stages, tied copies compared.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import DsckptError, UnsupportedCheckpointError
from ..formats.pickle_policy import TensorRef
from ..formats.torchzip import TorchFile
from . import layout as L
from .layout import PIPELINE_LAYER_RE

TIED_PREFIX = "tied_modules."


def layer_index(name: str) -> int | None:
    """The layer a PipelineModule name belongs to (``3.up.weight`` -> 3); None for tied modules."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def layer_tensors(files: tuple[Path, ...]) -> tuple[dict[int, dict[str, TensorRef]], list[DsckptError]]:
    """Per TP rank (``-model_YY``; 0 without TP), every layer file's tensors under ``{layer}.{key}``; an unreadable
    or foreign file is a problem."""
    out: dict[int, dict[str, TensorRef]] = {}
    problems: list[DsckptError] = []
    for path in sorted(files):
        match = PIPELINE_LAYER_RE.match(path.name)
        if match is None:  # (layout only lists names the pattern matched)
            continue
        try:
            state = TorchFile(path).obj
        except DsckptError as exc:
            problems.append(exc)
            continue
        if not isinstance(state, dict):
            problems.append(UnsupportedCheckpointError(f"a layer file holding a {type(state).__name__}, expected a "
                                                       "state dict", at=path))
            continue
        layer, tp = int(match.group("layer")), int(match.group("mp") or 0)
        out.setdefault(tp, {}).update((f"{layer}.{key}", ref) for key, ref in state.items() if isinstance(ref, TensorRef))
    return out, problems


def tp_degree(layout: Any) -> int:
    """How many TP ranks each stage has: the layer files' ``-model_YY`` count (DeepSpeed's
    ``checkpoint_parallel_dimensions`` says the same where it is recorded)."""
    matches = [PIPELINE_LAYER_RE.match(p.name) for p in layout.pipeline_files]
    ranks = {int(m.group("mp") or 0) for m in matches if m is not None}
    return max(ranks, default=0) + 1


def recorded_names(lay: Any, mp: int) -> dict[str, Any]:
    """The parameter names (-> shapes) and buffer names (-> None) a pipeline stage's model states record (none when
    unreadable: ``_open`` reports why)."""
    try:
        head = TorchFile(next(f.path for f in lay.model_files if f.mp_rank == mp)).obj
        names = {str(n): shape for g in head.get(L.PARAM_SHAPES) or [] if isinstance(g, dict) for n, shape in g.items()}
        return {**names, **{str(n): None for n in head.get(L.BUFFER_NAMES) or []}}
    except (DsckptError, AttributeError, TypeError):
        return {}


def layer_owners(layers: dict[int, dict[str, TensorRef]], recorded: list[dict[str, Any]]) -> dict[str, int]:
    """Which stage each layer-file tensor belongs to (``recorded[s]``: stage s's parameter names -> shapes, buffer
    names): the stage whose names hold its layer. A layer no stage names is a tied module's file (its keys and
    shapes are a ``tied_modules.*`` entry's: its values come from the optimizer files, so it is no stage's) or a
    layer whose parameters are all frozen: the stage of the nearest named layer before it (stage 0 below)."""
    claimed = {index: stage for stage, names in enumerate(recorded) for index in {layer_index(n) for n in names}
               if index is not None}
    tied = {(n.rsplit(".", 1)[-1], tuple(shape)) for names in recorded for n, shape in names.items()
            if n.startswith(TIED_PREFIX) and shape is not None}
    owners: dict[str, int] = {}
    for tensors in layers.values():
        by_layer: dict[int | None, list[str]] = {}
        for name in tensors:
            by_layer.setdefault(layer_index(name), []).append(name)
        for index, names in by_layer.items():
            if index in claimed:
                owners.update((n, claimed[index]) for n in names)
            elif not all((n.split(".", 1)[1], tuple(tensors[n].shape)) in tied for n in names):
                before = [i for i in claimed if index is not None and i < index]
                owners.update((n, claimed[max(before)] if before else 0) for n in names)
    return owners


def stage_map(stages: list[Any]) -> list[dict[str, Any]]:
    """Per stage: its layer indices and the tied modules it holds, for ``inspect``."""
    out = []
    for s, ckpt in enumerate(stages):
        names = list(ckpt.trainable) + list(ckpt.frozen) + list(ckpt.buffers)
        out.append({"stage": s, "layers": sorted({i for i in map(layer_index, names) if i is not None}),
                    "tied": sorted({re.sub(r"^tied_modules\.([^.]+)\..*$", r"\1", n) for n in names
                                    if n.startswith(TIED_PREFIX)})})
    return out
