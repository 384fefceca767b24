"""Stock DeepSpeed loads a converted AutoTP checkpoint: ``tp_load.py FIXTURE CKPT RESAVE STAGE TP [universal]``.

Builds the fixture's Llama (``fixtures/make_tp_fixtures.py``'s model and config) in an engine at ``autotp_size``
TP (1: no tensor parallelism) over this job's ranks and ZeRO ``STAGE``, runs DeepSpeed's own ``load_checkpoint`` of
CKPT (``universal``: with ``checkpoint.load_universal``), checks every fp32 master bit for bit - TP-local against the
fixture's ``masters.pt`` at the fixture's TP degree, whole against ``reference.pt`` (the fp32 masters of an fp32
run) at TP 1 - then saves what the engine holds to RESAVE: the test compares that save's masters and Adam moments
with the original checkpoint's.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures"))


def main(fixture: str, ckpt: str, resave: str, stage: str, tp: str, mode: str = "") -> None:
    import deepspeed
    import torch
    from deepspeed.utils import groups, safe_get_full_fp32_param
    from make_tp_fixtures import FIXTURES, build

    _, source_tp, _, precision, tied = FIXTURES[fixture]
    tp = int(tp)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(11)  # other initial weights than the fixture's: the load must replace them all
    model = build(tied)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": int(stage)}, "checkpoint": {"load_universal": mode == "universal"},
              **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}),
              # torch's AdamW (torch_adam): DeepSpeed's FusedAdam is a C++ build in every fresh venv
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
              "bf16": {"enabled": precision == "bf16"}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    path, client = engine.load_checkpoint(ckpt)
    assert path is not None and client["note"] == "autotp fixture", client
    fixture_dir = ROOT / "fixtures" / fixture
    want = torch.load(fixture_dir / "masters.pt", weights_only=True)[groups.get_tensor_model_parallel_rank()] \
        if tp == source_tp else torch.load(fixture_dir / "reference.pt", weights_only=True)
    for name, p in engine.module.named_parameters():
        got = safe_get_full_fp32_param(p).detach().cpu()
        assert torch.equal(got, want[name]), name
    engine.save_checkpoint(resave, tag="step3", client_state={k: client[k] for k in ("note", "epoch")})
    print(f"rank {torch.distributed.get_rank()}: {len(want)} masters equal")


if __name__ == "__main__":
    main(*sys.argv[1:])
