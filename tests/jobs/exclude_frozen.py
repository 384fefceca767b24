"""Run under torchrun: train the demo model at ZeRO 2 or 3, then save with DeepSpeed's own
``save_checkpoint(exclude_frozen_parameters=True)`` (what PEFT/LoRA runs use); rank 0 reports what
dsckpt consolidates from it against the live weights."""
import json
import sys
from pathlib import Path

import torch

import dsckpt
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import full_state_dict, rank, shutdown
from dsckpt.runtime.train import TrainOptions, Trainer


def main(stage: str, save_dir: str, report: str) -> None:
    quiet_deepspeed()
    trainer = Trainer(TrainOptions(stage=int(stage), freeze=True))
    trainer.fit(1, progress=False)
    trainer.engine.save_checkpoint(save_dir, tag="adapters", exclude_frozen_parameters=True)
    torch.distributed.barrier()
    live = full_state_dict(trainer.engine.module)
    frozen = sorted(n for n, p in trainer.engine.module.named_parameters() if not p.requires_grad)
    if rank() == 0:
        saved = dsckpt.load_state_dict(save_dir)
        Path(report).write_text(json.dumps({
            "frozen": frozen, "saved": sorted(saved), "live": sorted(live),
            "unequal": [k for k in saved if not torch.equal(saved[k].to(live[k].dtype), live[k])],
        }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    shutdown(exit_process=True)
