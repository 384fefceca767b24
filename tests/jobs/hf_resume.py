"""Run under torchrun: Transformers' own Trainer + DeepSpeed, saving and resuming (issue 23).

    hf_resume.py OUTPUT_DIR STAGE PRECISION MAX_STEPS SAVE_STEPS [RESUME_FROM]

The model, tokenizer and data of tests/jobs/hf_trainer.py, at a global batch of ``GLOBAL_BATCH`` rows
whatever the world size (``per_device_train_batch_size = GLOBAL_BATCH // world size``), so runs at
different world sizes see the same global batches.  With RESUME_FROM the Trainer resumes with
``train(resume_from_checkpoint=RESUME_FROM)``, and before its first step the engine saves its state as
loaded to ``OUTPUT_DIR/as_loaded`` (DeepSpeed's own ``save_checkpoint``: the oracle to compare with the
original through ``ds_to_universal``).  Rank 0 writes ``OUTPUT_DIR/log.json``: the Trainer's
``log_history`` (loss and learning rate per step) and the step it started from.

With ``DSCKPT_ASYNC_LIMIT=K`` in the environment the saves go through dsckpt's background engine
(``HFAsyncSave``) with ``save_total_limit=K``; at every ``on_save`` the log notes each ``checkpoint-N`` of
OUTPUT_DIR that has no ``latest`` yet (one the Trainer's ``resume_from_checkpoint=True`` could pick half-written).
RESUME_FROM ``last`` is ``resume_from_checkpoint=True``.  ``DSCKPT_INIT_FROM=FOLDER`` starts the model from a
``save_pretrained`` folder (``from_pretrained``) instead of the seeded initialization.  ``DSCKPT_STOP_AT=N`` stops the run after step N (a job
ended early: the schedule is still MAX_STEPS long).  ``DSCKPT_BEST=1``: an evaluation at every save and
``load_best_model_at_end`` on ``eval_loss`` (the log notes ``best_model_checkpoint``).
"""
import json
import os
import sys
from pathlib import Path

import torch

from hf_trainer import Tokens, model_config, tokenizer

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks


def main(output_dir: str, stage: str, precision: str, max_steps: str, save_steps: str, resume: str | None) -> None:
    import deepspeed
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    deepspeed.init_distributed("gloo")  # before the model: zero.Init must see the real world size
    world = torch.distributed.get_world_size()
    bf16 = precision == "bf16"
    ds_config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
                 "train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": int(stage)},
                 "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True}
    limit = os.environ.get("DSCKPT_ASYNC_LIMIT")
    best = {"eval_strategy": "steps", "eval_steps": int(save_steps), "load_best_model_at_end": True,
            "metric_for_best_model": "eval_loss"} if os.environ.get("DSCKPT_BEST") else {}
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, deepspeed=ds_config, max_steps=int(max_steps),
                             save_total_limit=int(limit) if limit else None, **best,
                             per_device_train_batch_size=GLOBAL_BATCH // world, learning_rate=3e-3,
                             lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, bf16=bf16,
                             save_steps=int(save_steps), save_strategy="steps", report_to=[], seed=11,
                             dataloader_num_workers=0)
    torch.manual_seed(11)
    init = os.environ.get("DSCKPT_INIT_FROM")
    model = LlamaForCausalLM.from_pretrained(init) if init else LlamaForCausalLM(model_config())
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), processing_class=tokenizer(),
                      eval_dataset=Tokens() if best else None)
    started = {}

    class SaveAsLoaded(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            started["step"] = state.global_step
            if resume:  # after the Trainer's own load_checkpoint, before any step
                trainer.model_wrapped.save_checkpoint(os.path.join(output_dir, "as_loaded"), tag="as_loaded")

    unpublished, stop_at = [], int(os.environ.get("DSCKPT_STOP_AT", "0"))

    class WatchFolders(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

        def on_save(self, args, state, control, **kwargs):
            unpublished.extend(str(p) for p in sorted(Path(output_dir).glob("checkpoint-*"))
                               if not (p / "latest").exists())

    trainer.add_callback(SaveAsLoaded())
    trainer.add_callback(WatchFolders())
    if limit:
        from dsckpt.checkpoint_engine.integrations import HFAsyncSave

        trainer.add_callback(HFAsyncSave(trainer))
    trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    if torch.distributed.get_rank() == 0:
        log = {"start_step": started["step"], "world_size": world, "history": trainer.state.log_history,
               "unpublished_at_save": unpublished, "best_model_checkpoint": trainer.state.best_model_checkpoint}
        with open(os.path.join(output_dir, "log.json"), "w") as fh:
            json.dump(log, fh)
    torch.distributed.barrier()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main(*sys.argv[1:6], sys.argv[6] if len(sys.argv) > 6 else None)
    from job_exit import leave

    leave()
