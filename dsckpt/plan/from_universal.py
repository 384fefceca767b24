"""DeepSpeed's universal checkpoint (``ds_to_universal``'s folder, or dsckpt's ``convert --to universal``) as a
training state, the source of ``convert --to deepspeed``: each trainable parameter whole in
``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``; the groups' order and members from the model file's
``param_shapes``; their settings from ``zero/optimizer_state.pt``'s ``param_groups``; Adam's step from
``zero/<name>/step.pt`` (ZeRO-1/2 sources) or that file's optimizer state (ZeRO-3 sources).
"""
from __future__ import annotations

from typing import Any

from ..errors import UnsupportedCheckpointError
from ..formats.pickle_policy import TensorRef
from ..formats.torchzip import TorchFile
from ..zero import layout as L
from ..zero.reader import Checkpoint
from .consolidate import TensorPlan, build_plan
from .groups import structure_errors
from .segments import ref_segments
from .training_state import ParamGroup, ParamState, TrainingState


def build_universal_state(ckpt: Checkpoint) -> tuple[TrainingState, int]:
    """The training state and the step it reached."""
    folder = ckpt.layout.tag_dir / L.UNIVERSAL_DIR
    optimizer_file = folder / L.UNIVERSAL_OPTIMIZER_FILE
    if not optimizer_file.is_file():
        raise UnsupportedCheckpointError("missing - a universal checkpoint keeps its param groups' "
                                         "settings there", at=optimizer_file)
    optimizer = TorchFile(optimizer_file).obj
    settings = optimizer.get(L.UNIVERSAL_PARAM_GROUPS) if isinstance(optimizer, dict) else None
    if not (isinstance(settings, list) and all(isinstance(g, dict) for g in settings)) \
            or len(settings) != len(ckpt.param_groups):
        raise UnsupportedCheckpointError(f"{len(settings or [])} recorded param groups for "
                                         f"{len(ckpt.param_groups)} groups of parameters in the model file", at=optimizer_file)
    with structure_errors(ckpt):
        model = build_plan(ckpt)
        masters = {t.name: t for t in model.tensors if t.kind == "param"}
        moments = {key: {t.name: t for t in build_plan(ckpt, state=key).tensors} for key in ("exp_avg", "exp_avg_sq")}
    params, groups, steps = [], [], []
    for g, shapes in enumerate(ckpt.param_groups):
        step = _step(ckpt, optimizer, g, next(iter(shapes), None))
        steps.append(step)
        for name in shapes:
            params.append(ParamState(name, masters[name], {k: plans[name] for k, plans in moments.items()}, step, g))
        groups.append(ParamGroup({k: v for k, v in settings[g].items() if k != "params"}, tuple(shapes)))
    return TrainingState(model, tuple(params), tuple(groups)), int(ckpt.global_steps or 0)


def _step(ckpt: Checkpoint, optimizer: dict[str, Any], group: int, first: str | None) -> TensorPlan | None:
    """Adam's step of ``group``: its first parameter's step.pt (ZeRO-1/2), else the optimizer state's (ZeRO-3)."""
    ref = None
    if first is not None and (ckpt.layout.tag_dir / L.UNIVERSAL_DIR / first / L.UNIVERSAL_STEP_FILE).is_file():
        ref = TorchFile(ckpt.layout.tag_dir / L.UNIVERSAL_DIR / first / L.UNIVERSAL_STEP_FILE).obj
    else:
        osd = optimizer.get(L.OPTIMIZER_STATE_DICT)
        state = osd.get("state") if isinstance(osd, dict) else None
        entry = state.get(group) if isinstance(state, dict) else None
        ref = entry.get("step") if isinstance(entry, dict) else None
    if ref is None:
        return None
    if not isinstance(ref, TensorRef) or ref.shape != ():
        raise UnsupportedCheckpointError(f"the step of param group {group} is {ref!r:.60}, "
                                         "not a stored 0-d tensor", at=ckpt.layout.tag_dir)
    return TensorPlan("step", (), ref.dtype, "F32", "step", ref_segments(ref))
