"""FSDP2 loads `dsckpt convert --to dcp` of an AutoTP run: ``fsdp2_tp_load.py FIXTURE DCP OUT`` at any world size.

The fixture's Llama (fixtures/make_tp_fixtures.py) built whole, every decoder layer and the root wrapped with
``fully_shard``, the AdamW DeepSpeed built from the run's config; then what an FSDP2 user writes: ``get_state_dict``
-> ``dcp.load`` -> ``set_state_dict``.  Rank 0 saves to OUT every full parameter, both Adam moments and the step.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))
from make_tp_fixtures import FIXTURES, build  # noqa: E402


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def main(fixture: str, folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(11)  # other weights than the run's: the load must replace them
    model = build(FIXTURES[fixture][4])
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    params = {n: full(p) for n, p in model.named_parameters()}
    moments = {key: {n: full(optimizer.state[p][key]) for n, p in model.named_parameters()}
               for key in ("exp_avg", "exp_avg_sq")}
    steps = {float(optimizer.state[p]["step"]) for p in model.parameters()}
    if dist.get_rank() == 0:
        torch.save({"fp32": params, **moments, "steps": sorted(steps)}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
