"""Run under torchrun, twice per world-size pair: the oracle for `dsckpt reshard` (issue 13).

``train ROOT COMBOS STEPS`` (at world size N), for every stage x precision in COMBOS:
  train the odd model (two param groups with their own hyper-parameters, a frozen layer, a tied
  weight, buffers, DeepSpeed's WarmupLR scheduler) for STEPS steps on a fixed global batch, save
  ROOT/<combo>/ckpt with a client state, then record - the oracle - every parameter's
  ``safe_get_full_fp32_param`` and Adam moments, the full state dict, the step counts, scheduler,
  loss scale and counters (ROOT/<combo>/before.pt), and take STEPS_AFTER more steps recording the
  losses and the masters after them (the uninterrupted run).
A combo ``S>T:precision`` (load mode) is a change of stage: ROOT/zS_<precision>/ws<M>_sT, written by
`dsckpt reshard --stage T`, loaded into a ZeRO-T engine; its records end in ``_sT``.
A combo ``Su:precision`` (load mode) is ROOT/zS_<precision>/universal, written by `dsckpt convert --to universal`,
loaded by stock ``engine.load_checkpoint`` with ``{"checkpoint": {"load_universal": true}}``; its records are
``after_universal_ws<M>.pt`` (no native save).
``load ROOT COMBOS STEPS`` (at world size M, after `dsckpt reshard ROOT/<combo>/ckpt ROOT/<combo>/ws<M>`):
  a fresh engine, stock ``engine.load_checkpoint`` (dsckpt's weights-only loader, DeepSpeed's four
  classes allowed), the same records (ROOT/<combo>/after_ws<M>.pt), DeepSpeed's own save of the
  loaded state (ROOT/<combo>/native_ws<M>) for the file comparison, then STEPS_AFTER steps on the
  same global batches.  The test compares the records.

The global batch (GLOBAL_BATCH sequences) is the same at every world size; rank r of W takes its
r-th slice, so N and M see the same samples per step.
"""
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import Runtime, full_state_dict, rank, shutdown, world_size
from dsckpt.runtime.train import TrainOptions

GLOBAL_BATCH = int(os.environ.get("RESHARD_GLOBAL_BATCH", "6"))  # divisible by 1, 2 and 3 ranks
MODEL = os.environ.get("RESHARD_MODEL", "odd_model:build")  # bench/multi_gpu_proof.py: a ~1B transformer
STEPS_AFTER = int(os.environ.get("RESHARD_STEPS_AFTER", "3"))  # bench/reshard_curves.py runs longer
CLIENT = {"epoch": 2, "note": "resharded", "nested": {"ids": [1, 2, (3, 4)], "t": torch.arange(5)}}


def build(stage: str, precision: str, universal: bool = False):
    """``stage``: "1".."3"; "2o" / "3o" for the offload presets (optimizer on the CPU; stage 3 parameters too);
    "3s" for ZeRO-3 cut into sub-groups (each rank's fp32 partition saved as several flat tensors)."""
    from dsckpt.runtime.train import load_factory

    offload = stage.endswith("o")
    config = TrainOptions(stage=int(stage.rstrip("os")), precision=precision, lr=3e-3, offload_optimizer=offload,
                          offload_parameters=offload and stage.startswith("3")).deepspeed_config()
    if stage == "3s":  # the odd model's ~5.8k trainable elements -> several sub-groups; no persistent params
        config["zero_optimization"].update(sub_group_size=1500, stage3_param_persistence_threshold=10)
    if "fp16" in config and config["fp16"].get("enabled"):
        config["fp16"]["initial_scale_power"] = 8  # 2**16 would skip the first steps on overflow
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                          "warmup_num_steps": 10}}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    runtime = Runtime(config)

    def optimizer(params):
        matrices = [p for p in params if len(getattr(p, "ds_shape", p.shape)) > 1]
        vectors = [p for p in params if len(getattr(p, "ds_shape", p.shape)) <= 1]
        return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                  {"params": vectors, "weight_decay": 0.0, "betas": (0.8, 0.95)}], lr=3e-3)

    torch.manual_seed(7)
    runtime.setup(load_factory(MODEL), optimizer)
    return runtime


def batch(step: int, seq_len: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, seq_len), generator=gen)
    per_rank = GLOBAL_BATCH // world_size()
    return tokens[rank() * per_rank:(rank() + 1) * per_rank]


def step(engine, index: int) -> float:
    module = engine.module
    loss = engine(batch(index, module.seq_len, module.vocab_size).to(engine.device))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return float(mean) / world_size()


def relink_optimizer_state(engine) -> None:
    """DeepSpeed 0.19.8 defect: ZeRO-1/2 steps one param group at a time and links parameters to their
    optimizer state right after the *first* group's step, once - so the parameters of groups 1, 2, ...
    never see theirs and ``safe_get_full_optimizer_state`` raises "exp_avg not found in optimizer
    state fragment".  Link every group again (views only; no state changes)."""
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "single_partition_of_fp32_groups"):
        for i, _ in enumerate(opt.optimizer.param_groups):
            lazy_init_hp_params_optimizer_state(opt.bit16_groups[i], opt.single_partition_of_fp32_groups[i],
                                                opt.optimizer.state)


def record(engine) -> dict:
    """The oracle: what the issue names, gathered the way a user of DeepSpeed would (collectives)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    relink_optimizer_state(engine)
    masters, moments = {}, {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            masters[name] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                moments[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    inner = engine.optimizer.optimizer
    steps = sorted(float(s["step"]) for s in inner.state.values() if "step" in s)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return {"masters": masters, "moments": moments, "module": full_state_dict(engine.module), "steps": steps,
            "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
            "loss_scale": float(getattr(scaler, "cur_scale", 0.0)) if scaler is not None else None,
            "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
            "global_samples": engine.global_samples,
            "hyperparams": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]}


def after_steps(engine, first: int) -> dict:
    losses = [step(engine, first + i) for i in range(STEPS_AFTER)]
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {n: safe_get_full_fp32_param(p).detach().cpu().clone()
               for n, p in engine.module.named_parameters() if p.requires_grad}
    return {"losses": losses, "masters": masters}


def main(mode: str, root: str, combos: str, steps: str) -> None:
    quiet_deepspeed()
    if os.environ.get("RESHARD_FORCE_FP16") == "1":  # a by-hand fp16 run on a CPU whose oneDNN says no
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    steps = int(steps)
    for combo in combos.split(","):
        stage, precision = combo.split(":")
        stage, _, new_stage = stage.partition(">")  # "2>3": trained at ZeRO-2, resharded to and loaded at ZeRO-3
        universal = stage.endswith("u")
        stage = stage.removesuffix("u")
        folder = Path(root) / f"z{stage}_{precision}"
        suffix = f"_s{new_stage}" if new_stage else ""
        runtime = build(new_stage or stage, precision, universal)
        engine = runtime.engine
        if mode == "train":
            for i in range(steps):
                step(engine, i)
            runtime.save_checkpoint(folder / "ckpt", {**CLIENT, "rank": rank()}, tag="step%d" % steps)
            before = record(engine)
            before["after"] = after_steps(engine, steps)
            before["world_size"] = world_size()
            if rank() == 0:
                torch.save(before, folder / "before.pt")
        elif universal:  # stock DeepSpeed, as a user of universal checkpoints calls it
            _, client = engine.load_checkpoint(str(folder / "universal"), load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
            loaded = record(engine)
            loaded["client"] = {k: client[k] for k in CLIENT}
            loaded["after"] = after_steps(engine, steps)
            loaded["world_size"] = world_size()
            if rank() == 0:
                torch.save(loaded, folder / f"after_universal_ws{world_size()}.pt")
        else:
            client = runtime.load_checkpoint(folder / f"ws{world_size()}{suffix}")
            loaded = record(engine)
            loaded["client"] = client
            runtime.save_checkpoint(folder / f"native_ws{world_size()}{suffix}", client, tag="step%d" % steps)
            loaded["after"] = after_steps(engine, steps)
            loaded["world_size"] = world_size()
            if rank() == 0:
                torch.save(loaded, folder / f"after_ws{world_size()}{suffix}.pt")
        del runtime, engine
        gc.collect()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    shutdown(exit_process=True)
