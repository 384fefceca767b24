"""ZeRO-0 16-bit checkpoints: which fp32 master belongs to which parameter.

DeepSpeed's stage-0 fp16/bf16 optimizers keep one fp32 master per trainable parameter in
``optimizer["fp32_groups"]``, in optimizer order, without names.  This is the one place the reader
reads tensor bytes to build the model (the plan never does).
"""
from __future__ import annotations

from typing import Any

from ..errors import InconsistentCheckpointError
from ..formats.pickle_policy import TensorRef
from . import layout as L


def match_masters(ckpt: Any) -> dict[str, TensorRef]:  # (a zero.reader.Checkpoint, which imports this module)
    """name -> fp32 master, for the module's trainable parameters ({} when there are no masters).

    Masters are matched to the module's parameters in order: the next master belongs to a
    parameter when shapes agree and the 16-bit weight is exactly the master cast down (DeepSpeed
    copies it so after every step); otherwise that parameter is frozen.  Reads the 16-bit weights once.
    """
    optimizer = ckpt.model_files[0].obj.get(L.OPTIMIZER) if ckpt.module else None
    groups = optimizer.get("fp32_groups") if isinstance(optimizer, dict) else None
    if not groups:
        return {}
    masters = [t for g in groups for t in g]
    names = [n for n, t in ckpt.module.items() if isinstance(t, TensorRef) and n not in ckpt.buffers
             and n not in ckpt.shared]
    out, i = {}, 0
    for name in names:
        ref = ckpt.module[name]
        if i < len(masters) and masters[i].shape == ref.shape and _is_master_of(masters[i], ref):
            out[name] = masters[i]
            i += 1
    if i != len(masters):
        raise InconsistentCheckpointError(f"{len(masters)} fp32 master tensors, "
                                          f"only {i} match the module's parameters", at=ckpt.model_files[0].path)
    return out


def _is_master_of(master: TensorRef, weight: TensorRef) -> bool:
    from ..formats.torchzip import read_tensor_bytes
    from ..formats.cast import cast_bytes

    return cast_bytes(read_tensor_bytes(master), "F32", weight.dtype) == read_tensor_bytes(weight)
