"""Run under torchrun, at ZeRO 2 or 3, a model with a frozen block and trainable parameters the optimizer was
never given (``requires_grad`` left on, in no param group - a common fine-tuning slip; DeepSpeed lists them
in neither ``param_shapes`` nor the frozen shapes). Two saves of the same state: a plain one, and DeepSpeed's
``save_checkpoint(exclude_frozen_parameters=True)`` (what PEFT/LoRA runs use). Rank 0 reports what dsckpt
consolidates from each against the live weights."""
import json
import sys
from pathlib import Path

import torch

import dsckpt
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.demo_model import build_small_model
from dsckpt.runtime.engine import Runtime, full_state_dict, rank, shutdown
from dsckpt.runtime.train import TrainOptions

ORPHANS = ("norm.weight", "norm.bias")
built = {}


def factory():
    built["model"] = build_small_model(freeze_first_block=True)  # frozen ones too: DeepSpeed records those
    return built["model"]


def optimizer(params):
    orphans = {id(p) for n, p in built["model"].named_parameters() if n in ORPHANS}
    return torch.optim.AdamW([p for p in params if id(p) not in orphans], lr=1e-2)


def main(stage: str, save_dir: str, report: str) -> None:
    quiet_deepspeed()
    runtime = Runtime(TrainOptions(stage=int(stage)).deepspeed_config())
    engine = runtime.setup(factory, optimizer)
    tokens = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(rank()))
    engine.backward(engine(tokens))
    engine.step()
    runtime.save_checkpoint(Path(save_dir) / "plain", tag="step1")
    engine.save_checkpoint(str(Path(save_dir) / "no_frozen"), tag="step1", exclude_frozen_parameters=True)
    torch.distributed.barrier()
    live = full_state_dict(engine.module)
    frozen = sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad)
    if rank() == 0:
        out = {"live": sorted(live), "frozen": frozen}
        for name, folder, exclude in (("plain", "plain", False), ("no_frozen", "no_frozen", False),
                                      ("no_frozen_excluded", "no_frozen", True)):
            try:
                saved, error = dsckpt.load_state_dict(Path(save_dir) / folder, exclude_frozen=exclude), None
            except dsckpt.errors.DsckptError as exc:
                saved, error = {}, f"{type(exc).__name__}: {exc}"
            out[name] = {"error": error, "saved": sorted(saved),
                         "unequal": [k for k in saved if not torch.equal(saved[k].to(live[k].dtype), live[k])]}
        Path(report).write_text(json.dumps(out))

if __name__ == "__main__":
    main(*sys.argv[1:4])
    shutdown(exit_process=True)
