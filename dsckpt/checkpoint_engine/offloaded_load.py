"""Loading into a ZeRO-Infinity engine (the optimizer on NVMe) exactly, where DeepSpeed's own load is not.

DeepSpeed 0.19.8's ``load_checkpoint`` leaves an NVMe-offloaded optimizer's state out and only copies the tag's
``offloaded_tensors/`` back into the swap folder: Adam's step restarts at 1, a sub-group too small to swap keeps the
masters and moments the engine was built with, and a checkpoint without that folder (another world size, a reshard's
output, a run without NVMe) does not load at all.  ``load_offloaded`` instead, on every rank:

1. runs DeepSpeed's own load for the module, frozen parameters, scheduler and client state, with its NVMe copy and
   its optimizer load turned off for the call;
2. walks the sub-groups as the optimizer's step does: swaps one in (when it lives on NVMe), sets its masters,
   moments and step from this rank's planned optimizer file (``plan.reshard`` at the engine's world size: the tag's
   own rank and swap files when that is the checkpoint's), sets the 16-bit partition from the masters, swaps it out.
   One sub-group is in memory at a time, as in DeepSpeed's step.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

from ..errors import InconsistentCheckpointError

if TYPE_CHECKING:
    from ..zero.reader import Checkpoint

STEP = "step"


def offloads_to_nvme(engine: Any) -> bool:
    """The engine's optimizer state lives on NVMe (``offload_optimizer.device: nvme``, ZeRO-3)."""
    nvme = getattr(engine, "zero_nvme_offload_optimizer", None)
    return callable(nvme) and bool(nvme())


def load_offloaded(engine: Any, ckpt: "Checkpoint", rest: Callable[[], tuple[Any, Any]],
                   with_optimizer: bool = True, check_crc: bool = True) -> tuple[Any, Any]:
    """``ckpt`` (any world size, ZeRO 1-3) into an NVMe-offloaded engine, exactly: ``rest()`` is DeepSpeed's load of
    it (``planned_load``'s, answered from the plan where the world size differs), run with the optimizer's part
    turned off; then every sub-group from the plan, its rank-file ranges CRC-checked first (``check_crc``; the swap
    files carry none).  Returns what ``rest`` returned: ``(path, client_state)``."""
    import torch.distributed as dist

    from ..api.resharding import carry_only_allowed
    from .safe_load import check_agreed
    from ..plan.reshard import build_reshard_plan
    from ..zero.layout import RANK_FILE_RE

    rank = dist.get_rank(group=engine.optimizer.dp_process_group)
    plan, _ = carry_only_allowed(build_reshard_plan(ckpt, engine.dp_world_size, 3))
    optim = [f for f in plan.files if (m := RANK_FILE_RE.match(f.name)) and m.group("kind") == "optim"
             and int(m.group("dp") or 0) == rank]
    if len(optim) != 1:
        raise InconsistentCheckpointError(f"the plan for {engine.dp_world_size} ranks has no optimizer file for "
                                          f"rank {rank}", at=ckpt.layout.tag_dir)
    undo = _without_optimizer_load(engine)
    try:
        loaded = rest()
    finally:
        undo()
    if with_optimizer and loaded[0] is not None:
        if check_crc:  # (every rank's verdict: one stopping alone would leave the others in a collective)
            check_agreed(engine, optim)
        restore_sub_groups(engine.optimizer, optim[0].tree["optimizer_state_dict"], str(ckpt.layout.tag_dir))
    return loaded


def _without_optimizer_load(engine: Any) -> Callable[[], None]:
    """For one load: DeepSpeed's NVMe copy off (it needs this world size's swap files) and its optimizer load a
    no-op that succeeds (it cannot fill swapped sub-groups); returns the undo.  (Asked not to load the optimizer,
    DeepSpeed would gather the module's weights through its own zero_to_fp32 instead, which fails on NVMe.)"""
    engine.zero_nvme_offload_optimizer = lambda: False
    engine._load_zero_checkpoint = lambda *args, **kwargs: True

    def undo() -> None:
        del engine.zero_nvme_offload_optimizer
        del engine._load_zero_checkpoint
    return undo


def restore_sub_groups(optimizer: Any, saved: dict[str, Any], where: str) -> None:
    """Every sub-group's masters, moments and step from ``saved`` (this rank's ZeRO-3 optimizer state as planned:
    ``fp32_flat_groups``, ``optimizer_state_dict``), through the swapper; then the 16-bit partitions."""
    from ..io.read import Reader

    flats, torch_state = saved["fp32_flat_groups"], saved["optimizer_state_dict"]
    states = torch_state.get("state", {})
    for key in ("dynamic_loss_scale", "overflow"):
        if isinstance(saved.get(key), bool):
            setattr(optimizer, key, saved[key])
    scaler = getattr(saved.get("loss_scaler"), "state", None)  # (a DeepSpeed class, read as a record of its fields)
    for key, value in (scaler.items() if isinstance(scaler, dict) else ()):
        if hasattr(optimizer.loss_scaler, key) and isinstance(value, (int, float, bool)):
            setattr(optimizer.loss_scaler, key, value)
    for live, group in zip(optimizer.optimizer.param_groups, torch_state.get("param_groups", [])):
        live.update({k: v for k, v in group.items() if k != "params"})
    if len(flats) != len(optimizer.fp32_partitioned_groups_flat):
        raise InconsistentCheckpointError(f"holds {len(flats)} sub-groups for this rank; the engine has "
                                          f"{len(optimizer.fp32_partitioned_groups_flat)}", at=where)
    timers: set[str] = set()
    optimizer._partition_all_parameters()
    with Reader() as reader:
        for g, master in enumerate(optimizer.fp32_partitioned_groups_flat):
            optimizer._prepare_sub_group(g, timers)
            numel = optimizer.fp16_partitioned_groups_flat_numel[g]
            master.data.copy_(_tensor(reader, flats[g], numel, where, f"sub-group {g}'s masters"))
            live = optimizer.optimizer.state[master]
            for key, value in states.get(g, {}).items():
                if key == STEP or not _is_tensor(value):
                    live[key] = _plain(value)
                else:
                    saved_value = _tensor(reader, value, numel, where, f"sub-group {g}'s {key}")
                    if torch_numel(live.get(key)) == numel:
                        live[key].data.copy_(saved_value)
                    else:  # (an engine that has not stepped has none yet: the swapper adopts it on the way out)
                        live[key] = saved_value
            optimizer._reassign_or_swap_out_partitioned_parameters(g)
            optimizer._release_sub_group(g, timers)
    optimizer._post_step(timers)


def torch_numel(value: Any) -> int:
    return int(value.numel()) if hasattr(value, "numel") else -1


def _is_tensor(value: Any) -> bool:
    from ..formats.pickle_policy import TensorRef
    from ..formats.pickle_writer import NewTensor

    return isinstance(value, (TensorRef, NewTensor))


def _tensor(reader: Any, value: Any, numel: int, where: str, what: str) -> Any:
    """A planned tensor (a new one's byte pieces, or a stored one's bytes) as a flat fp32 torch tensor."""
    from ..formats.pickle_policy import TensorRef
    from ..io.read import torch_tensor
    from ..plan.segments import ref_segments

    if math.prod(value.shape) != numel:
        raise InconsistentCheckpointError(f"{what} has {math.prod(value.shape)} elements; the engine's has {numel}",
                                          at=where)
    if isinstance(value, TensorRef):
        source = SimpleNamespace(src_dtype=value.dtype, dtype=value.dtype, pieces=ref_segments(value))
    else:
        source = value.source
    shaped = SimpleNamespace(shape=(numel,), dtype=value.dtype, numel=numel, src_dtype=source.src_dtype,
                             pieces=source.pieces)
    return torch_tensor(reader, shaped).float()


def _plain(value: Any) -> Any:
    """A scalar of the saved state (Adam's step: a 0-d tensor), as the optimizer keeps it."""
    import torch

    from ..dtypes import torch_dtype
    from ..formats.pickle_policy import TensorRef
    from ..formats.torchzip import read_tensor_bytes

    if isinstance(value, TensorRef) and value.numel <= 1:
        data = bytes(read_tensor_bytes(value))
        return torch.frombuffer(bytearray(data), dtype=torch_dtype(value.dtype)).reshape(value.shape).clone()
    return value
