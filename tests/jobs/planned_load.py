"""Run on M ranks: a checkpoint of another world size / ZeRO stage loaded without a copy (checkpoint_engine.planned_load).

ARGS: STAGE SOURCE TAG COPY REPORT.  An engine at ZeRO STAGE loads SOURCE (tag TAG, written at another world size
or stage) through ``load_resharded``, and its optimizer partitions and client state are captured; then it loads COPY
(``dsckpt reshard SOURCE COPY -w M --stage STAGE``) with DeepSpeed's own load; the two must be equal.  Rank 0
writes REPORT; every rank adds the bytes its process read while loading (``/proc/self/io``).
"""
import json
import sys
from pathlib import Path

import torch

from async_save import capture, same
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import rank, shutdown
from dsckpt.checkpoint_engine.planned_load import load_resharded
from dsckpt.runtime.train import TrainOptions, Trainer, states_equal


def read_bytes() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")).split()[1])


def main(stage: str, source: str, tag: str, copy: str, report: str) -> None:
    quiet_deepspeed()
    trainer = Trainer(TrainOptions(model="odd_model:build", stage=int(stage), batch_size=2, sync_save=True))
    before = read_bytes()
    path, planned_client = load_resharded(trainer.engine, source, tag)
    read = read_bytes() - before
    planned = capture(trainer.engine)
    trainer.step()  # the state moves on, so that the second load has something to restore
    path_copy, copy_client = trainer.engine.load_checkpoint(copy)
    stock = capture(trainer.engine)
    reads = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reads, read)
    if rank() == 0:
        Path(report).write_text(json.dumps({
            "loaded": path is not None and path_copy is not None, "equal": same(planned, stock),
            "client_equal": states_equal(planned_client, copy_client), "read": reads}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(*sys.argv[1:6])
    shutdown(exit_process=True)
