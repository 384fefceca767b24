"""Run on 2 ranks: every rank is killed (SIGKILL) while a background save is being written.

ARGS: OUT [TAG].  Saves t1 and waits for it; steps; saves TAG (t2, or t1 again: a reused tag) with a writer that takes
seconds, and as soon as save_checkpoint returns every rank kills itself.  The test then finds `latest` on t1, and t1
loadable and as first saved.
"""
import os
import signal
import sys
import time
from pathlib import Path

import torch

from dsckpt.checkpoint_engine.background import AsyncSave
from dsckpt.checkpoint_engine.persist import write_snapshot
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.train import TrainOptions, Trainer


def stalled_save(state, path):
    write_snapshot(state, path)  # the temp is there, complete, but not yet agreed on by every rank
    time.sleep(30)


def main(out: str, tag: str = "t2") -> None:
    quiet_deepspeed()
    trainer = Trainer(TrainOptions(model="odd_model:build", stage=3, batch_size=2, sync_save=True))
    trainer.fit(1, progress=False)
    trainer.runtime.saver = saver = AsyncSave(trainer.engine)
    trainer.runtime.save_checkpoint(out, trainer.client_state(), tag="t1")
    saver.wait()
    trainer.step()
    saver.writer.write = stalled_save
    trainer.runtime.save_checkpoint(out, trainer.client_state(), tag=tag)
    torch.distributed.barrier()
    time.sleep(1)  # the writers are inside the stalled write now
    Path(out, f"killed.{torch.distributed.get_rank()}").write_text("")
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(*sys.argv[1:3])
