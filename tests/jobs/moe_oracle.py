"""Run under torchrun: the oracle for resharding DeepSpeed-MoE checkpoints (issue 26).

``train ROOT STAGE EP PRECISION`` (at world size N): train fixtures/make_moe_fixtures.py's model (two MoE layers
of 4 experts, ep_size EP) for 3 steps, save ROOT/ckpt, record every parameter's fp32 master and Adam moments
under its global name (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``) in ROOT/before.pt.
``load ROOT STAGE EP PRECISION`` (at world size M, after `dsckpt reshard ROOT/ckpt ROOT/ws<M>_ep<EP> -w M
--ep-size EP`): a fresh engine at ep_size EP, stock ``engine.load_checkpoint`` (with dsckpt's weights-only
loader), the same records in ROOT/after_ws<M>_ep<EP>.pt, then one more training step (training goes on).
"""
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))
from make_moe_fixtures import EXPERTS, STEPS, VOCAB, build  # noqa: E402

LOCAL = re.compile(r"(\.deepspeed_experts\.)(\d+)(\.)")


def engine_for(stage: int, ep: int, precision: str):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(7)
    model = build(ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "params"})
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": precision == "bf16"},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.1),
                                      config=config)
    return engine


def step(engine, seed: int) -> float:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    loss = engine(ids)
    engine.backward(loss)
    engine.step()
    return float(loss)


def records(engine, ep: int) -> dict:
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state
    from reshard_oracle import relink_optimizer_state  # DeepSpeed 0.19.8 links only the first group's state

    relink_optimizer_state(engine)
    out = {"masters": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        if getattr(p, "allreduce", True) is False:  # an expert: its global id
            first = EXPERTS // ep * groups._get_expert_parallel_rank(p.group_name)
            name = LOCAL.sub(lambda m: f"{m.group(1)}{first + int(m.group(2))}{m.group(3)}", name, count=1)
        out["masters"][name] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][name] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    merged = {key: {} for key in out}
    for part in gathered:
        for key, values in part.items():
            merged[key].update(values)
    return merged


def main() -> None:
    mode, root, stage, ep, precision = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    engine = engine_for(stage, ep, precision)
    if mode == "train":
        for i in range(STEPS):
            step(engine, 100 * i + dist.get_rank())
        engine.save_checkpoint(str(root / "ckpt"), tag="step3", client_state={"note": "moe oracle"})
        result, name = records(engine, ep), "before.pt"
    else:
        from dsckpt.checkpoint_engine import safe_load

        world = dist.get_world_size()
        safe_load.install(engine)
        path, client = engine.load_checkpoint(str(root / f"ws{world}_ep{ep}"))
        assert path is not None and client["note"] == "moe oracle", (path, client)
        result, name = records(engine, ep), f"after_ws{world}_ep{ep}.pt"
        result["loss_after"] = step(engine, 999 + dist.get_rank())
        result["global_steps"] = engine.global_steps
    if dist.get_rank() == 0:
        torch.save(result, root / name)
    dist.barrier()


if __name__ == "__main__":
    main()
