"""Lightning's own DeepSpeedStrategy (it needs CUDA): fit, save, and resume with ``fit(ckpt_path=)`` (issue 23).

    lightning_strategy.py OUT STAGE MAX_STEPS [CKPT_PATH]

Fits tests/models/lit_model.LitOdd with ``DeepSpeedStrategy(stage=STAGE)`` on one GPU in fp32 up to
MAX_STEPS (resuming from CKPT_PATH when given), then ``trainer.save_checkpoint(OUT/ckpt)`` - Lightning's
folder of DeepSpeed shards with its own checkpoint dict as the client state.  Writes ``OUT/log.json``:
the step it started from and the loss of every step it ran.  With ``DSCKPT_ASYNC=1`` in the environment the
saves go through dsckpt's background engine (``LightningAsyncSave``) and a ``ModelCheckpoint`` saves every step
into OUT/every with ``save_top_k=1``; the log lists what OUT/every holds at the end.
"""
import json
import os
import sys

import torch


def main(out: str, stage: str, max_steps: str, ckpt_path: str | None) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lit_model import LitOdd, batches

    class Record(L.Callback):
        def __init__(self):
            self.start, self.losses = None, []

        def on_train_start(self, trainer, module):
            self.start = trainer.global_step

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    record = Record()
    callbacks, background = [record], bool(os.environ.get("DSCKPT_ASYNC"))
    if background:
        from lightning.pytorch.callbacks import ModelCheckpoint

        from dsckpt.checkpoint_engine.integrations import LightningAsyncSave

        callbacks += [LightningAsyncSave(), ModelCheckpoint(dirpath=os.path.join(out, "every"), every_n_train_steps=1,
                                                            save_top_k=1, monitor="step", mode="max")]
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=DeepSpeedStrategy(stage=int(stage)),
                        precision="32-true", max_steps=int(max_steps), logger=False,
                        enable_checkpointing=background, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, default_root_dir=out)
    torch.manual_seed(5)
    trainer.fit(LitOdd(lr=2e-3, note="strategy"), batches(16), ckpt_path=ckpt_path)
    trainer.save_checkpoint(os.path.join(out, "ckpt"))
    if trainer.global_rank == 0:
        with open(os.path.join(out, "log.json"), "w") as fh:
            every = sorted(os.listdir(os.path.join(out, "every"))) if background else []
            json.dump({"start": record.start, "losses": record.losses, "end": trainer.global_step, "every": every,
                       "every_latest": [os.path.exists(os.path.join(out, "every", e, "latest")) for e in every]}, fh)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
