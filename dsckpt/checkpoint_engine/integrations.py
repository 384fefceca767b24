"""Background saves in the trainers that drive DeepSpeed themselves: one line each (docs/ecosystems/).

Each trainer calls ``engine.save_checkpoint`` and then works on its folders at once; what changes here is only
when those follow-ups happen, so that no folder a trainer would resume from looks complete before it is:

* Lightning (``LightningAsyncSave``): ``ModelCheckpoint``'s deletion of older checkpoints runs once the newer one is
  published.  A Lightning DeepSpeed checkpoint folder holds nothing but DeepSpeed's files, `latest` last.  The engine
  is taken over as the strategy makes it, before ``fit(ckpt_path=)`` loads: another world size or stage loads too.
* HF Trainer (``HFAsyncSave``): each ``checkpoint-N`` is written under ``output_dir/.dsckpt-pending.dsckpt-tmp-<pid>-<id>/``
  (rank 0's; ``dsckpt list`` shows what a killed job left there, ``prune`` removes it) and moved into
  ``output_dir`` once every rank's DeepSpeed files are durable; ``save_total_limit``'s rotation runs after that move.
  ``resume_from_checkpoint=True`` therefore never picks a checkpoint that is still being written.  The engine is
  taken over right after ``accelerator.prepare`` makes it, so that a resume at another world size or ZeRO stage
  loads too (``planned_load``).
* Accelerate and plain loops: ``enable_async_save(engine)`` directly (``accelerator.deepspeed_engine_wrapped.engine``).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from .background import AsyncSave, enable_async_save
from ..io.output import fsync_path

PENDING = ".dsckpt-pending"  # HF checkpoints being written: the Trainer's resume looks for checkpoint-N only


def pending_folder(run_dir: str, saver: AsyncSave) -> str:
    from ..formats.storage import TEMP_MARK

    return os.path.join(run_dir, f"{PENDING}{TEMP_MARK}{saver.owner}")


def LightningAsyncSave() -> Any:
    """A Lightning callback: ``L.Trainer(strategy=DeepSpeedStrategy(...), callbacks=[LightningAsyncSave()])``."""
    from lightning.pytorch.callbacks import Callback

    class _LightningAsyncSave(Callback):
        saver: AsyncSave | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            strategy = trainer.strategy
            strategy_setup = strategy.setup

            def setup_then_enable(*args: Any, **kwargs: Any) -> Any:
                done = strategy_setup(*args, **kwargs)
                self.enable(trainer)  # before fit(ckpt_path=) loads: a checkpoint of another world size or stage too
                return done
            strategy.setup = setup_then_enable

        def enable(self, trainer: Any) -> None:
            strategy = trainer.strategy
            if self.saver is not None or getattr(strategy, "deepspeed_engine", None) is None:
                return
            self.saver = saver = enable_async_save(strategy.deepspeed_engine)
            remove = strategy.remove_checkpoint
            strategy.remove_checkpoint = lambda path: saver.then(lambda: remove(path))

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.enable(trainer)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            if self.saver is not None:
                self.saver.wait()

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if self.saver is not None:
                self.saver.wait()  # (a trainer.save_checkpoint after fit still saves in the background)

    return _LightningAsyncSave()


def HFAsyncSave(trainer: Any) -> Any:
    """A Transformers callback: ``trainer.add_callback(HFAsyncSave(trainer))`` before ``trainer.train()``."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    class _HFAsyncSave(TrainerCallback):
        saver: AsyncSave | None = None

        def __init__(self) -> None:
            prepare = trainer.accelerator.prepare

            def prepare_then_enable(*args: Any, **kwargs: Any) -> Any:
                prepared = prepare(*args, **kwargs)
                self.enable()  # before the Trainer resumes: a checkpoint of another world size loads too
                return prepared
            trainer.accelerator.prepare = prepare_then_enable

        def enable(self) -> None:
            wrapped = getattr(trainer.accelerator, "deepspeed_engine_wrapped", None)
            if self.saver is None and wrapped is not None:
                self.saver = enable_async_save(wrapped.engine)
                trainer._save_checkpoint = self._staged(trainer._save_checkpoint)
                load_best = trainer._load_best_model

                def load_best_once_published() -> None:  # (load_best_model_at_end runs before on_train_end)
                    import torch.distributed as dist

                    self.saver.wait()  # type: ignore[union-attr]
                    if dist.is_initialized() and dist.get_world_size() > 1:
                        dist.barrier()  # rank 0's writer moves the folder into place: every rank waits for it
                    load_best()
                trainer._load_best_model = load_best_once_published

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.enable()

        def _staged(self, save_checkpoint: Any) -> Any:
            def staged_save(model: Any, trial: Any) -> None:
                args = trainer.args
                run_dir, limit = trainer._get_output_dir(trial=trial), args.save_total_limit
                pending = pending_folder(run_dir, self.saver)  # type: ignore[arg-type]
                args.output_dir, args.save_total_limit = pending, None  # written aside; rotated once published
                try:
                    save_checkpoint(model, trial)
                finally:
                    args.output_dir, args.save_total_limit = run_dir, limit
                import torch.distributed as dist

                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.barrier()  # every rank's own files (rng_state_{rank}.pth) are in the folder before it moves
                name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
                best = trainer.state.best_model_checkpoint  # (every rank's: each loads it at the end)
                pointed = best is not None and os.path.dirname(os.path.normpath(best)) == os.path.normpath(pending)
                if pointed:
                    best = trainer.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
                if not args.should_save:
                    return
                if pointed:
                    _point_best_at(os.path.join(pending, name, "trainer_state.json"), best)

                def publish() -> None:
                    final, staged = os.path.join(run_dir, name), os.path.join(pending, name)
                    if os.path.isdir(final):  # this step saved again: what was written replaces its namesakes only
                        for entry in os.listdir(staged):
                            target = os.path.join(final, entry)
                            if os.path.isdir(target) and not os.path.islink(target):
                                shutil.rmtree(target)
                            os.replace(os.path.join(staged, entry), target)
                        os.rmdir(staged)
                    else:
                        os.replace(staged, final)
                    fsync_path(Path(run_dir), files=False)
                    try:
                        os.rmdir(pending)
                    except OSError:
                        pass
                    rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best,
                                       use_mtime=True)

                self.saver.then(publish)  # type: ignore[union-attr]

            return staged_save

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.saver is not None:
                self.saver.wait()

    return _HFAsyncSave()


def _point_best_at(state_file: str, best: str) -> None:
    """The Trainer wrote ``best_model_checkpoint`` as the pending path: the saved state names where it will be."""
    import json

    if not os.path.isfile(state_file):
        return
    with open(state_file) as fh:
        state = json.load(fh)
    state["best_model_checkpoint"] = best
    temp = f"{state_file}.dsckpt-tmp-{os.getpid()}"
    with open(temp, "w") as fh:
        json.dump(state, fh, indent=2, sort_keys=True)
    os.replace(temp, state_file)
