"""Stock DeepSpeed loads a resharded pipeline x TP checkpoint: ``pptp_load.py CKPT RESAVE`` on pp x tp x dp ranks.

Builds fixtures/make_pptp_fixtures.py's Megatron-style PipelineModule (pp 2, tp 2, this job's other ranks data
parallel), runs DeepSpeed's own ``load_checkpoint`` of CKPT, checks every TP-local fp32 master against the slice of
the fixture's ``reference.pt`` its pattern gives (column: dim 0, row: dim 1, replicated: whole), then saves what
the engine holds to RESAVE.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures"))


def main(ckpt: str, resave: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils import safe_get_full_fp32_param
    from make_pptp_fixtures import FIXTURES, STATE, UC_INFO, layers, loss_fn

    stage, pp, tp, _ = FIXTURES["pp2_tp2_z1_fp32"]
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dist.get_world_size() // (pp * tp))
    coord = topology.get_coord(dist.get_rank())
    groups = {}
    for ranks in topology.get_axis_comm_lists("model"):
        group = dist.new_group(ranks)
        groups.update({r: group for r in ranks})
    STATE.update(tp=tp, tp_rank=coord.model, group=groups[dist.get_rank()])
    torch.manual_seed(11)
    model = PipelineModule(layers(), loss_fn=loss_fn, topology=topology, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    path, client = engine.load_checkpoint(ckpt)
    assert path is not None and client["iteration"] == 3, client
    full = torch.load(ROOT / "fixtures" / "pp2_tp2_z1_fp32" / "reference.pt", weights_only=True)
    for name, p in engine.module.named_parameters():
        want = full[name]
        if not any(re.match(r, name) for r in UC_INFO["tp_replicated_parameter_patterns"]):
            dim = 1 if any(re.match(r, name) for r in UC_INFO["parameter_with_row_parallelism_patterns"]) else 0
            want = want.chunk(tp, dim=dim)[coord.model]
        assert torch.equal(safe_get_full_fp32_param(p).detach().cpu(), want), name
    engine.save_checkpoint(resave, tag="global_step3", client_state={"universal_checkpoint_info": UC_INFO, "iteration": 3})


if __name__ == "__main__":
    main(*sys.argv[1:3])
