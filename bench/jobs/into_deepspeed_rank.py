"""Ranks of bench/bench_into_deepspeed.py.

``fsdp2 OUT``: the benchmark transformer under FSDP2 with AdamW, one step, then ``dcp.save({"model", "optim"})``.
``stock FULL OUT STAGE``: what a user does today without dsckpt - a DeepSpeed engine at STAGE with the same model
and AdamW, one step at lr 0 to create Adam's state (the published workaround), then every parameter's fp32 master
and both moments set from FULL (the DCP folder as one torch file: ``dcp_to_torch_save``) with DeepSpeed's
``safe_set_full_*`` and ``engine.save_checkpoint(OUT)``.  (The step count stays 1: DeepSpeed has no setter for it.)
"""
import sys

import torch
import torch.distributed as dist

from models import transformer


def batch(model):
    gen = torch.Generator().manual_seed(dist.get_rank())
    return torch.randint(0, model.vocab_size, (2, model.seq_len), generator=gen)


def fsdp2(out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = transformer()
    for block in getattr(model, "blocks", []):
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(batch(model)).backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    dist.barrier()


def stock(full: str, out: str, stage: str) -> None:
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    deepspeed.init_distributed("gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": int(stage)},
              "zero_allow_untested_optimizer": True}
    with deepspeed.zero.Init(enabled=stage == "3", config_dict_or_path=config):
        model = transformer()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.0),
                                      config=config)
    engine.backward(engine(batch(model)))
    engine.step()
    state = torch.load(full, mmap=True, weights_only=True)
    for name, param in engine.module.named_parameters():
        safe_set_full_fp32_param(param, state["model"][name])
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(param, state["optim"]["state"][name][key], key)
    engine.save_checkpoint(out, tag="converted")
    dist.barrier()


if __name__ == "__main__":
    {"fsdp2": fsdp2, "stock": stock}[sys.argv[1]](*sys.argv[2:])
