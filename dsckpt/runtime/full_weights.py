"""Load one full-weights file into a live (possibly ZeRO-3 partitioned) DeepSpeed model.

Protocol (every rank runs it; only rank 0 opens the file):
1. rank 0 opens the file (``api.weights.WeightsFile``: positional reads, one tensor at a time), expands tied aliases recorded by ``dsckpt consolidate``, and checks keys and shapes against the
   model; the verdict is broadcast so every rank fails the same way.
2. module by module: ``GatheredParameters(module.parameters(recurse=False), modifier_rank=0)``;
   rank 0 copies values in (having read them on a helper thread while the previous module was
   gathered); DeepSpeed re-partitions on exit.  Stages 0-2 need no gathering, and
   rank 0's values are broadcast.  Persistent buffers are broadcast from rank 0.
3. the optimizer's fp32 masters are set from the file: ``refresh_fp32_params()`` for fp32 models;
   for 16-bit models each parameter's fp32 value is broadcast and each rank sets its own slice of
   its partition (``set_full_fp32``) so masters keep full precision.
AutoTP (``runtime.tensor_parallel``): the file's shapes are the full ones; rank 0 broadcasts each full value and
every rank copies in and keeps as master its own TP slice.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..api.keys import KeyReport, compare, full_shape, state_slots, tie_groups
from ..api.weights import WeightsFile
from . import engine as eng
from .moe import ep_rank_of, ep_size_of, global_name, local_experts
from .tensor_parallel import tp_model


def broadcast_object(obj: Any) -> Any:
    if eng.world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def release_memory_promptly() -> None:
    """Fix glibc's mmap threshold at 32 MiB (no-op elsewhere): big freed buffers go back to the OS at once.

    glibc raises its mmap threshold after large frees, so the per-module buffers of a load (file
    reads, gathered parameters) end up on the heap and stay resident; a threshold as low as 1 MiB makes every
    tensor a fresh, page-faulted mmap instead (both measured: docs/dev/performance-log.md section 6).
    32 MiB is the highest value glibc's dynamic threshold reaches, so smaller buffers are reused as
    glibc would reuse them; fixing it also keeps the trim threshold fixed, so the heap's free top goes
    back to the OS.  The setting stays for the rest of the process.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def load_full_weights(engine, path: str | Path, *, strict: bool = True, strip_prefixes: tuple[str, ...] = (),
                      progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Load ``path`` into ``engine.module`` following the protocol above; returns counts."""
    import deepspeed

    release_memory_promptly()
    module = engine.module
    tp = tp_model(engine)  # AutoTP: each rank holds its slice of a parameter; the file holds it whole
    slots = state_slots(module)
    experts = {name: getattr(m, a) for name, (m, a, _) in slots.items() if ep_size_of(getattr(m, a)) > 1}
    per_rank = local_experts(module) if experts else {}
    slots = {name: slot for name, slot in slots.items() if name not in experts}  # (loaded by _load_experts)
    expected = {name: full_shape(getattr(m, a)) for name, (m, a, _) in slots.items()}
    if tp:
        expected = {name: tp.full_shape(name, shape) for name, shape in expected.items()}
    expected.update({global_name(name, e, per_rank): tuple(p.shape)  # every ep rank's experts, by global id
                     for name, p in experts.items() for e in range(ep_size_of(p))})
    src = WeightsFile(path, strip_prefixes) if eng.rank() == 0 else None
    keys = compare(expected, {k: tuple(src.shape(k)) for k in src.keys()}, tie_groups(module)) if src else None
    broadcast_object(keys or KeyReport()).raise_for(path, strict)  # every rank fails the same way
    have = broadcast_object(set(src.keys()) if src else None)
    by_module: dict[int, tuple[list, list]] = {}  # per module, in module order: (parameters, buffers) in the file
    seen: set[int] = set()
    for name, (mod, attr, is_param) in slots.items():
        tensor = getattr(mod, attr)
        if name in have and id(tensor) not in seen:  # a tied tensor is loaded once, under its first name
            seen.add(id(tensor))
            by_module.setdefault(id(mod), ([], []))[0 if is_param else 1].append((name, tensor))
    steps = list(by_module.values())

    pin = torch.cuda.is_available() and any(p.device.type == "cuda" for p in module.parameters())

    def read(i: int) -> dict[str, torch.Tensor]:  # rank 0, on a helper thread; pinned for a DMA to the GPU
        if src is None:
            raise RuntimeError("only rank 0 reads the weights file")
        return {name: src.get(name, pin) for name, _ in steps[i][0] + steps[i][1]}

    masters = _MasterSetter(engine)  # 16-bit runs: fp32 masters from the same values, no second read
    loaded = 0
    with ThreadPoolExecutor(1) as pool:
        # rank 0 reads module i+1 from disk while module i is gathered and scattered: two modules in memory
        ahead = pool.submit(read, 0) if src and steps else None
        for i, (params, buffers) in enumerate(steps):
            values = ahead.result() if ahead else {}
            ahead = pool.submit(read, i + 1) if src and i + 1 < len(steps) else None
            if tp:
                values = _tp_slices(tp, params, values, masters.device)
            gathered = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0) if params \
                else contextlib.nullcontext()
            with gathered, torch.no_grad():
                for name, p in params:
                    if eng.rank() == 0 or tp:
                        # to the device first, then cast there (a CPU-side fp32 -> bf16 cast of every tensor
                        # cost more than the copy on an H200); the master below reuses the device copy
                        values[name] = values[name].to(p.device, non_blocking=True)
                        p.data.copy_(values[name].to(p.dtype).view(p.shape))
                    if not tp and not hasattr(p, "ds_id") and eng.world_size() > 1:
                        dist.broadcast(p.data, 0)  # stages 0-2: replicate rank 0's values
            for name, p in params:
                if tp:
                    masters.set_local(p, values[name].to(masters.device, torch.float32))
                else:
                    masters.set(name, p, values.get(name))
            for name, b in buffers:
                if eng.rank() == 0:
                    b.data.copy_(values[name].to(b.dtype).view(b.shape))
                if eng.world_size() > 1:
                    dist.broadcast(b.data, 0)  # GatheredParameters does not cover buffers
            loaded += len(params) + len(buffers)
            if progress:
                progress(1)
    loaded += _load_experts(experts, per_rank, src, masters)
    masters.finish()
    return {"loaded": loaded, "expected": len(expected)}


def _tp_slices(tp, params: list, values: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """AutoTP: rank 0 broadcasts each full value (fp32: exact for every dtype a file holds), every rank keeps its
    own TP slice, shaped as its parameter."""
    out = {}
    for name, p in params:
        shape = tp.full_shape(name, tuple(getattr(p, "ds_shape", p.shape)))
        full = values[name].to(device, torch.float32).reshape(shape) if eng.rank() == 0 else \
            torch.empty(shape, dtype=torch.float32, device=device)
        dist.broadcast(full, 0)
        out[name] = tp.local(name, full).reshape(tuple(getattr(p, "ds_shape", p.shape)))
    return out


def _load_experts(experts: dict[str, torch.nn.Parameter], per_rank: dict[str, int], src, masters) -> int:
    """DeepSpeed-MoE experts at ep_size > 1 (``runtime.moe``): the file names each by its global id, a rank holds
    its expert-parallel rank's; rank 0 reads each global expert tensor in turn and broadcasts it, the ranks of
    that ep rank keep it (weights and, for 16-bit runs, the fp32 master - a local write at ZeRO-1/2)."""
    loaded = 0
    for name, p in experts.items():
        mine = ep_rank_of(p)
        for e in range(ep_size_of(p)):
            full = src.get(global_name(name, e, per_rank)).to(masters.device, torch.float32).reshape(p.shape) \
                if eng.rank() == 0 else torch.empty(p.shape, dtype=torch.float32, device=masters.device)
            if eng.world_size() > 1:
                dist.broadcast(full, 0)
            if e == mine:
                with torch.no_grad():
                    p.data.copy_(full.to(p.device, p.dtype))
                masters.set_local(p, full)
                loaded += 1
    return loaded


def stage0_masters(optimizer) -> dict[int, torch.Tensor]:
    """id(16-bit parameter) -> fp32 master, for DeepSpeed's stage-0 16-bit optimizer.

    ZeRO 1-3 and BF16_Optimizer expose masters through ``safe_get/set_full_fp32_param``; the
    stage-0 fp16/bf16 optimizer (``FP16_UnfusedOptimizer``) only has parallel lists of parameters.
    """
    pairs: dict[int, Any] = {}
    for group16, group32 in zip(getattr(optimizer, "fp16_groups", []), getattr(optimizer, "fp32_groups", [])):
        if isinstance(group32, list):
            pairs.update((id(p16), p32) for p16, p32 in zip(group16, group32))
    return pairs


def get_fp32_master(engine, param: torch.nn.Parameter) -> torch.Tensor | None:
    from deepspeed.utils import safe_get_full_fp32_param

    master = safe_get_full_fp32_param(param)
    return master if master is not None else stage0_masters(engine.optimizer).get(id(param))


def comm_device() -> torch.device:
    """Where collectives need their tensors: the GPU under nccl, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_full_fp32(engine, param: torch.nn.Parameter, full: torch.Tensor, state_key: str | None = None) -> None:
    """Set ``param``'s fp32 master (or optimizer state ``state_key``) from its full value, on every rank.

    ZeRO-3: DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer_Stage3.set_full_hp_param`` (behind
    ``safe_set_full_fp32_param``) cuts ``value.narrow(0, partition_numel * rank, partition_numel)``,
    which runs past the end on the last rank whenever the element count is not a multiple of the
    world size ("start (2492) + length (1246) exceeds dimension size (3737)").  Each rank here
    copies its own slice, clipped to the parameter, and zeroes the padding after it.
    """
    opt = engine.optimizer
    if hasattr(param, "ds_id") and hasattr(opt, "fp32_partitioned_groups_flat"):
        if not param.requires_grad:
            return
        part, group = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=state_key)
        start = part.numel() * opt._get_param_partition_rank(param)
        mine = full.reshape(-1)[start:start + part.numel()]  # slicing clips: the last rank gets fewer
        part.data[:mine.numel()].copy_(mine)
        part.data[mine.numel():].zero_()
        if opt._swappable_optimizer_subgroup(group):
            opt._optimizer_states_and_gradient_swap_out(group)
        return
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if state_key is None:
        safe_set_full_fp32_param(param, full)
    else:
        safe_set_full_optimizer_state(param, full, state_key)


class _MasterSetter:
    """Make the optimizer's fp32 masters hold the file's values (else step() reverts the load).

    16-bit runs: each trainable parameter's master is set from the value just read for its weight (rank 0
    broadcasts it, one parameter at a time: no rank holds the whole file) - exact fp32, where the peers'
    ``refresh_fp32_params`` would leave the 16-bit rounding in the masters.  The file is read once: a first
    version read every tensor again for its master, 2.3x the load time on an H200 (docs/performance.md).
    fp32 runs: ``refresh_fp32_params`` at the end (the weights are the masters).
    """

    def __init__(self, engine):
        self.engine, self.opt = engine, engine.optimizer
        self.sixteen_bit = self.opt is not None and any(
            p.dtype in (torch.float16, torch.bfloat16) for p in engine.module.parameters())
        self.stage0 = stage0_masters(self.opt) if self.sixteen_bit else {}
        self.device = comm_device()
        self.done: set[int] = set()

    def set(self, name: str, p: torch.nn.Parameter, value: torch.Tensor | None) -> None:
        if not self.sixteen_bit or not p.requires_grad or id(p) in self.done:
            return
        self.done.add(id(p))  # a tied parameter once
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if eng.rank() == 0:
            if value is None:
                raise RuntimeError(f"{name}: rank 0 has no value to load")
            full = value.to(device=self.device, dtype=torch.float32).reshape(shape).contiguous()
        else:
            full = torch.empty(shape, dtype=torch.float32, device=self.device)
        if eng.world_size() > 1:
            dist.broadcast(full, 0)
        if id(p) in self.stage0:
            self.stage0[id(p)].data.copy_(full.view_as(self.stage0[id(p)]))
        else:
            set_full_fp32(self.engine, p, full)

    def set_local(self, p: torch.nn.Parameter, full: torch.Tensor) -> None:
        """This rank's master of ``p`` from ``full``, already here (no broadcast)."""
        if self.sixteen_bit and p.requires_grad and id(p) not in self.done:
            self.done.add(id(p))
            set_full_fp32(self.engine, p, full)

    def finish(self) -> None:
        if self.opt is not None and not self.sixteen_bit and hasattr(self.opt, "refresh_fp32_params"):
            self.opt.refresh_fp32_params()  # masters = the (fp32) weights just loaded