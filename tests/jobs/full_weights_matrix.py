"""Run under torchrun: load one full-weights file into the odd model at every stage x precision.

One process group serves every combination (a fresh DeepSpeed engine each), so a world size costs
one start-up.  For each: ``resume_full_weights`` + ``check_against_file`` (weights, buffers and
fp32 masters compared bit for bit), the parameter dtype the engine trains in, and one training
step to show the loaded state trains on.  Rank 0 writes the list of reports as JSON.
"""
import gc
import json
import sys

import torch

from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import rank, shutdown, world_size
from dsckpt.runtime.resume import check_against_file, resume_full_weights
from dsckpt.runtime.train import TrainOptions, Trainer


def main(weights: str, report: str, precisions: str) -> None:
    quiet_deepspeed()
    results = []
    for stage in (0, 1, 2, 3):
        for precision in precisions.split(","):
            trainer = Trainer(TrainOptions(model="odd_model:build", stage=stage, precision=precision,
                                           batch_size=2, seed=5))
            restored = resume_full_weights(trainer, weights, None, True, ())
            check = check_against_file(trainer, weights, restored, ())
            dtypes = sorted({str(p.dtype) for p in trainer.engine.module.parameters()})
            loss = trainer.step()
            results.append({"stage": stage, "precision": precision, "world_size": world_size(), **check,
                            "dtypes": dtypes, "loss_finite": bool(torch.isfinite(torch.tensor(loss)))})
            del trainer, restored
            gc.collect()
    if rank() == 0:
        with open(report, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    shutdown(exit_process=True)
