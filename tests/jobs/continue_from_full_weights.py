"""Run under torchrun: load a full-weights file into ZeRO-3, train on, save; the saved checkpoint,
consolidated, must equal the live weights after those steps, and carry the client state on."""
import json
import sys
from pathlib import Path

import torch

import dsckpt
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import full_state_dict, rank, shutdown
from dsckpt.runtime.resume import resume_full_weights
from dsckpt.runtime.train import TrainOptions, Trainer


def main(weights: str, save_dir: str, report: str) -> None:
    quiet_deepspeed()
    trainer = Trainer(TrainOptions(stage=3, save_dir=save_dir))
    resume_full_weights(trainer, weights, None, True, ())
    start = trainer.global_step
    trainer.fit(2, progress=False)
    live = full_state_dict(trainer.engine.module)
    if rank() == 0:
        saved = dsckpt.load_state_dict(save_dir)
        Path(report).write_text(json.dumps({
            "start": start, "end": trainer.global_step,
            "equal": all(torch.equal(saved[k], v) for k, v in live.items()),
            "user": dsckpt.open_checkpoint(save_dir).client_state["user"] == trainer.opts.user_state,
        }))


if __name__ == "__main__":
    # leave the process group and skip teardown explicitly (see dsckpt.runtime.engine.shutdown)
    main(*sys.argv[1:4])
    shutdown(exit_process=True)  # only after success: a barrier after a failure would wait for gone peers
