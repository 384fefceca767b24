"""ZeRO-3's save without its second gather of the persistent parameters.

DeepSpeed's ``save_checkpoint`` at ZeRO-3 partitions every parameter first (``checkpoint_event_prologue``: the
model-states file then holds empty placeholders) and afterwards all-gathers the persistent ones back
(``checkpoint_event_epilogue``): a collective over the data-parallel group that a background save would otherwise
block on.  Partitioning a parameter that is already partitioned only drops its gathered copy; nothing a save does
changes one, so the copy each rank held before the save is put back instead, and every parameter ends as it began.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


def _applies(optimizer: Any) -> bool:
    """A plain ZeRO-3 optimizer: no secondary (hpZ) partitions, no quantized weights, no parameters on NVMe."""
    if not hasattr(optimizer, "persistent_parameters") or not hasattr(optimizer, "invalidate_secondary_tensor"):
        return False
    offload = getattr(optimizer, "parameter_offload", None)
    if getattr(optimizer, "zero_hpz_partition_size", 1) > 1 or getattr(offload, "zero_quantized_weights", True):
        return False  # (a quantized gather is lossy: the copy held is not what stock's gather would give)
    for param in optimizer.persistent_parameters:
        tensor = getattr(param, "ds_tensor", None)
        if tensor is None or hasattr(tensor, "ds_quant_scale") or getattr(param, "ds_secondary_tensor", None) is not None:
            return False
        if str(getattr(tensor, "final_location", None)).endswith("nvme"):
            return False
    return True


@contextlib.contextmanager
def persistent_parameters_kept(optimizer: Any) -> Iterator[None]:
    """Within the block, the optimizer's save epilogue puts back the gathered persistent parameters it held."""
    if optimizer is None or not _applies(optimizer):
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    held = [(param, param.data) for param in optimizer.persistent_parameters
            if param.ds_status == ZeroParamStatus.AVAILABLE and param.data.numel() == param.ds_numel]

    def epilogue() -> None:
        optimizer.invalidate_secondary_tensor()
        for param, data in held:
            param.data = data
            param.ds_status = ZeroParamStatus.AVAILABLE

    optimizer.checkpoint_event_epilogue = epilogue
    try:
        yield
    finally:
        del optimizer.checkpoint_event_epilogue  # the class's own again
