"""Run under torchrun at any world size: FSDP2 loads `dsckpt convert --to dcp` output (issue 27's oracle).

``fsdp2_load.py ROOT COMBOS`` - for every combo ("<stage>:<precision>", reshard_oracle.py's runs):
build the odd model in fp32, wrap it with FSDP2 ``fully_shard``, give it the AdamW param groups the
DeepSpeed run had (matrices: weight_decay 0.1; vectors: 0.0, betas (0.8, 0.95)), then exactly what an FSDP2
user writes: ``get_state_dict`` -> ``dcp.load(ROOT/<combo>/dcp)`` -> ``set_state_dict``.  Records (rank 0,
ROOT/<combo>/fsdp2_ws<M>.pt): every full parameter and buffer, both Adam moments per parameter, the step
counts and each group's settings; then the loss of the next global batch before any update (the DeepSpeed
run recorded the same batch's loss) and whether one more optimizer step moved every trainable parameter.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from odd_model import build  # noqa: E402

GLOBAL_BATCH = 6  # as reshard_oracle.py: divisible by 1, 2 and 3 ranks
STEPS = 3  # the DeepSpeed run's steps before it saved


def batch(step: int, seq_len: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, seq_len), generator=gen)
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    return tokens[dist.get_rank() * per_rank:(dist.get_rank() + 1) * per_rank]


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def state_record(model, optimizer) -> dict:
    """Every full parameter and persistent buffer, both Adam moments per parameter, the steps and each group's
    settings, gathered from an FSDP2 model (also tests/jobs/into_deepspeed.py's record of its source run)."""
    names = {p: n for n, p in model.named_parameters()}
    return {"params": {n: full(p) for n, p in model.named_parameters()},
            "buffers": {n: full(b) for n, b in model.named_buffers() if n in model.state_dict()},
            "moments": {f"{k}/{names[p]}": full(s[k]) for p, s in optimizer.state.items()
                        for k in ("exp_avg", "exp_avg_sq")},
            "steps": sorted(float(s["step"]) for s in optimizer.state.values()),
            "hyperparams": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def mean_loss(model) -> torch.Tensor:
    loss = model(batch(STEPS, model.seq_len, model.vocab_size))
    total = loss.detach().clone()
    dist.all_reduce(total)
    return loss, float(total) / dist.get_world_size()


def main(root: str, combos: str) -> None:
    dist.init_process_group("gloo")
    for combo in combos.split(","):
        stage, precision = combo.split(":")
        folder = Path(root) / f"z{stage}_{precision}"
        torch.manual_seed(123)  # other values than the run's: everything must come from the checkpoint
        model = build()
        fully_shard(model.up)
        fully_shard(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW([{"params": [p for p in trainable if p.dim() > 1], "weight_decay": 0.1},
                                       {"params": [p for p in trainable if p.dim() <= 1], "weight_decay": 0.0,
                                        "betas": (0.8, 0.95)}], lr=1.0)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        record = {**state_record(model, optimizer),
                  "world_size": dist.get_world_size()}
        loss, record["next_loss"] = mean_loss(model)
        loss.backward()
        optimizer.step()
        record["moved"] = {n: not torch.equal(full(p), record["params"][n]) for n, p in model.named_parameters()
                           if p.requires_grad}
        if dist.get_rank() == 0:
            torch.save(record, folder / f"fsdp2_ws{dist.get_world_size()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    from job_exit import leave

    leave()
