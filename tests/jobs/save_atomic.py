"""Run under torchrun (1 rank): a save that dies midway never disturbs the previous tag or `latest`."""
import json
import sys
from pathlib import Path

from dsckpt.zero.reader import open_checkpoint
from dsckpt.zero.layout import list_tags
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import shutdown
from dsckpt.runtime.train import TrainOptions, Trainer


def main(save_dir: str, report: str) -> None:
    quiet_deepspeed()
    root = Path(save_dir)
    trainer = Trainer(TrainOptions(model="dsckpt.runtime.demo_model:build_small_model", stage=2, save_dir=save_dir, sync_save=True,
                                   batch_size=2))
    trainer.fit(1, progress=False)  # saves step1
    real_save = trainer.engine.save_checkpoint

    def dies_after_writing(*args, **kwargs):
        real_save(*args, **kwargs)
        raise RuntimeError("simulated crash before the save completed")

    trainer.engine.save_checkpoint = dies_after_writing
    try:
        trainer.save("step1")  # re-saving an existing tag, and dying
    except RuntimeError:
        pass
    after_crash = {"latest": (root / "latest").read_text(), "tags": list_tags(root),
                   "step1_steps": open_checkpoint(root, "step1").global_steps,
                   "hidden": sorted(p.name for p in root.iterdir() if p.name.startswith("."))}
    trainer.engine.save_checkpoint = real_save
    trainer.step()
    trainer.save()
    from dsckpt.api.catalog import list_checkpoints

    listed = [[e.name, e.leftover] for e in list_checkpoints(root) if e.leftover]
    Path(report).write_text(json.dumps({"after_crash": after_crash, "latest": (root / "latest").read_text(),
                                        "tags": list_tags(root), "listed": listed,
                                        "hidden": sorted(p.name for p in root.iterdir() if p.name.startswith("."))}))


if __name__ == "__main__":
    # leave the process group and skip teardown explicitly (see dsckpt.runtime.engine.shutdown)
    main(sys.argv[1], sys.argv[2])
    shutdown(exit_process=True)  # only after success: a barrier after a failure would wait for gone peers
