"""Stock DeepSpeed loads a converted pipeline checkpoint: ``pp_load.py FIXTURE CKPT RESAVE [PP [universal]]``.

Builds fixtures/make_pp_fixtures.py's PipelineModule over PP stages (default the fixture's) and this job's other
ranks as data parallel, runs DeepSpeed's own ``load_checkpoint`` of CKPT (``universal``: with
``checkpoint.load_universal``), checks each stage's fp32 masters and buffers against the fixture's ``reference.pt``
bit for bit, then saves what the engine holds to RESAVE (the test compares its masters and moments with the
original's).
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures"))


def main(fixture: str, ckpt: str, resave: str, stages: str = "", mode: str = "") -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from deepspeed.utils import safe_get_full_fp32_param
    from make_pp_fixtures import FIXTURES, layers, loss_fn

    stage, pp, _, precision = FIXTURES[fixture]
    pp = int(stages or pp)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(11)  # other initial weights: the load must replace them all
    dp = dist.get_world_size() // pp
    model = PipelineModule(layers(), loss_fn=loss_fn, topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
                           partition_method="parameters")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage}, "checkpoint": {"load_universal": mode == "universal"},
              # torch's AdamW (torch_adam): DeepSpeed's FusedAdam is a C++ build in every fresh venv
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
              "bf16": {"enabled": precision == "bf16"}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    path, client = engine.load_checkpoint(ckpt)
    assert path is not None and client["note"] == "pipeline fixture", client
    want = torch.load(ROOT / "fixtures" / fixture / "reference.pt", weights_only=True)
    for name, p in engine.module.named_parameters():
        assert torch.equal(safe_get_full_fp32_param(p).detach().cpu(), want[name]), name
    for name, b in engine.module.named_buffers():
        assert torch.equal(b.detach().cpu(), want[name]), name
    engine.save_checkpoint(resave, tag="step3", client_state={k: client[k] for k in ("note", "epoch")})


if __name__ == "__main__":
    main(*sys.argv[1:])
