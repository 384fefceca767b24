"""Run on N ranks: ``engine.load_checkpoint`` (enable_async_save's) of a checkpoint at another world size whose
fp32 masters were damaged (bytes changed, CRC-32 not).  ARGS: SOURCE STAGE REPORT; rank 0 writes REPORT: the error
every rank raised (or null: it loaded)."""
import json
import sys
from pathlib import Path

import torch

from dsckpt.errors import DsckptError
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import rank, shutdown
from dsckpt.runtime.train import TrainOptions, Trainer


def main(source: str, stage: str, report: str) -> None:
    quiet_deepspeed()
    trainer = Trainer(TrainOptions(model="dsckpt.runtime.demo_model:build_small_model", stage=int(stage),
                                   batch_size=4))  # (background saves on: the engine's load is dsckpt's)
    try:
        trainer.engine.load_checkpoint(source)
        said = None
    except DsckptError as exc:
        said = str(exc)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, said)
    if rank() == 0:
        Path(report).write_text(json.dumps(every))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    shutdown(exit_process=True)
