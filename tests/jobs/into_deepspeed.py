"""Run under torchrun: the oracle for `dsckpt convert --to deepspeed` (issue 55).

``fsdp2 ROOT`` (any world size): the odd model under FSDP2 ``fully_shard`` with AdamW in two param groups
(matrices: weight_decay 0.1; vectors: 0.0, betas (0.8, 0.95)) trains STEPS steps on fixed global batches, then
saves what users save - ``dcp.save({"model": msd, "optim": osd})`` with ``get_state_dict`` (ROOT/dcp) and
torchtitan's layout (model keys at the top level, the optimizer flattened, ``train_state.step``; ROOT/titan) -
and records (ROOT/fsdp2.pt): every full parameter and buffer, both Adam moments, the steps and group settings,
the loss of the next global batch before any update, and the parameters after that batch's AdamW step.

``deepspeed ROOT FOLDERS`` (at world size M): for each "<name>:<stage>[:<precision>]", a fresh DeepSpeed engine at that ZeRO
stage with the same model and the same AdamW groups (settings deliberately other than the saved ones), stock
``engine.load_checkpoint(ROOT/<name>)`` (DeepSpeed's four classes allowed, no pickle code), then the same
records through DeepSpeed's own accessors (ROOT/<name>/loaded_ws<M>.pt).
"""
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from odd_model import build  # noqa: E402

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks: every world size sees the same samples per step
STEPS = 3


def batch(step: int, seq_len: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, seq_len), generator=gen)
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    return tokens[dist.get_rank() * per_rank:(dist.get_rank() + 1) * per_rank]


def groups(params, lr: float) -> list[dict]:
    trainable = [p for p in params if p.requires_grad]
    shape = lambda p: getattr(p, "ds_shape", p.shape)  # noqa: E731  (a ZeRO-3 parameter's full shape)
    return [{"params": [p for p in trainable if len(shape(p)) > 1], "weight_decay": 0.1},
            {"params": [p for p in trainable if len(shape(p)) <= 1], "weight_decay": 0.0, "betas": (0.8, 0.95)}]


def mean(loss: torch.Tensor) -> float:
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def fsdp2(root: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = build()
    fully_shard(model.up)
    fully_shard(model)
    optimizer = torch.optim.AdamW(groups(model.parameters(), 3e-3), lr=3e-3)
    for i in range(STEPS):
        model(batch(i, model.seq_len, model.vocab_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / "dcp"))
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    titan = {**get_model_state_dict(model), "optimizer": flat,
             "train_state": {"step": torch.tensor(STEPS, dtype=torch.int32)},
             "lr_scheduler": {"last_epoch": STEPS}}
    dcp.save(titan, checkpoint_id=str(root / "titan"))

    from fsdp2_load import full, state_record

    record = state_record(model, optimizer)
    loss = model(batch(STEPS, model.seq_len, model.vocab_size))
    record["next_loss"] = mean(loss)
    loss.backward()
    optimizer.step()
    record["params_after"] = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    if dist.get_rank() == 0:
        torch.save(record, root / "fsdp2.pt")


def deepspeed_load(root: Path, folders: str) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from dsckpt.runtime.commands import quiet_deepspeed
    from dsckpt.runtime.engine import Runtime
    from dsckpt.runtime.train import TrainOptions
    from reshard_oracle import relink_optimizer_state

    quiet_deepspeed()
    for item in folders.split(","):
        name, stage, precision = (item.split(":") + ["32"])[:3]
        config = TrainOptions(stage=int(stage), precision=precision, lr=1.0).deepspeed_config()
        config["gradient_clipping"] = 0.0  # FSDP2's step clipped nothing
        runtime = Runtime(config)
        torch.manual_seed(123)  # other values than the run's: everything must come from the checkpoint
        runtime.setup(build, lambda params: torch.optim.AdamW(groups(params, 1.0), lr=1.0))
        engine = runtime.engine
        runtime.load_checkpoint(root / name)
        relink_optimizer_state(engine)
        record = {"params": {}, "moments": {}, "world_size": dist.get_world_size()}
        for n, p in engine.module.named_parameters():
            if p.requires_grad:
                record["params"][n] = safe_get_full_fp32_param(p).detach().cpu().clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    record["moments"][f"{key}/{n}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
        inner = engine.optimizer.optimizer
        record["steps"] = sorted(float(s["step"]) for s in inner.state.values() if "step" in s)
        record["hyperparams"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        record["global_steps"] = engine.global_steps
        module = engine.module
        loss = engine(batch(STEPS, module.seq_len, module.vocab_size))
        record["next_loss"] = mean(loss)
        engine.backward(loss)
        engine.step()
        record["params_after"] = {n: safe_get_full_fp32_param(p).detach().cpu().clone()
                                  for n, p in engine.module.named_parameters() if p.requires_grad}
        if dist.get_rank() == 0:
            torch.save(record, root / name / f"loaded_ws{dist.get_world_size()}.pt")
        del runtime, engine
        gc.collect()


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "fsdp2":
        dist.init_process_group("gloo")
        fsdp2(root)
        dist.barrier()
        dist.destroy_process_group()
    else:
        deepspeed_load(root, sys.argv[3])
        from dsckpt.runtime.engine import shutdown

        shutdown(exit_process=True)
    from job_exit import leave

    leave()
