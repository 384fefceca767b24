"""Stock DeepSpeed loads a resharded AutoTP checkpoint: ``tp_load.py FIXTURE CKPT RESAVE STAGE`` on tp x dp ranks.

Builds the fixture's Llama in an AutoTP engine (``fixtures/make_tp_fixtures.py``'s model and config, at this job's
data-parallel size and ZeRO ``STAGE``), runs DeepSpeed's own ``load_checkpoint`` of CKPT, checks every TP-local fp32
master against the fixture's ``masters.pt`` bit for bit, then saves what the engine holds to RESAVE - the test
compares that save's masters and Adam moments with the original checkpoint's.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures"))


def main(fixture: str, ckpt: str, resave: str, stage: str) -> None:
    import deepspeed
    import torch
    from deepspeed.utils import groups, safe_get_full_fp32_param
    from make_tp_fixtures import FIXTURES, build

    _, tp, _, precision, tied = FIXTURES[fixture]
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(11)  # other initial weights than the fixture's: the load must replace them all
    model = build(tied)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "tensor_parallel": {"autotp_size": tp}, "zero_optimization": {"stage": int(stage)},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
              "bf16": {"enabled": precision == "bf16"}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    path, client = engine.load_checkpoint(ckpt)
    assert path is not None and client["note"] == "autotp fixture", client
    want = torch.load(ROOT / "fixtures" / fixture / "masters.pt", weights_only=True)[groups.get_tensor_model_parallel_rank()]
    for name, p in engine.module.named_parameters():
        got = safe_get_full_fp32_param(p).detach().cpu()
        assert torch.equal(got, want[name]), name
    engine.save_checkpoint(resave, tag="step3", client_state={k: client[k] for k in ("note", "epoch")})
    print(f"rank {torch.distributed.get_rank()}: {len(want)} masters equal")


if __name__ == "__main__":
    main(*sys.argv[1:5])
