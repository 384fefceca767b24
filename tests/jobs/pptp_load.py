"""Stock DeepSpeed loads a resharded pipeline x TP checkpoint: ``pptp_load.py CKPT RESAVE`` on pp x tp x dp ranks.

Builds fixtures/make_pptp_fixtures.py's Megatron-style PipelineModule (pp 2, tp 2, this job's other ranks data
parallel), runs DeepSpeed's own ``load_checkpoint`` of CKPT, checks every TP-local fp32 master against the slice of
the fixture's ``reference.pt`` its pattern gives (column: dim 0, row: dim 1, replicated: whole), then saves what
the engine holds to RESAVE.
"""
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures"))


def main(ckpt: str, resave: str) -> None:
    import torch
    from deepspeed.utils import safe_get_full_fp32_param
    from make_pptp_fixtures import FIXTURES, UC_INFO, build_engine

    stage, pp, tp, _ = FIXTURES["pp2_tp2_z1_fp32"]
    engine, coord = build_engine(stage, pp, tp, int(os.environ["WORLD_SIZE"]) // (pp * tp), seed=11)
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
