"""Run under torchrun: Accelerate's own ``save_state`` / ``load_state`` with a DeepSpeed plugin (issue 23).

    accelerate_resume.py OUTPUT_DIR STAGE STEPS SAVE_AT [RESUME_FROM]

A small odd-sized MLP, AdamW and a linear LR schedule, fed the same global batch of ``GLOBAL_BATCH`` rows
per step whatever the world size (each rank takes its slice).  Without RESUME_FROM: train ``STEPS``
steps and ``accelerator.save_state(OUTPUT_DIR/state)`` after step SAVE_AT (the uninterrupted run goes
on).  With it: ``accelerator.load_state(RESUME_FROM)``, the engine saves its state as loaded to
``OUTPUT_DIR/as_loaded`` (the oracle), and training goes on from SAVE_AT.  Rank 0 writes
``OUTPUT_DIR/log.json``: per step the global mean loss and the learning rate.  With ``DSCKPT_ASYNC=1`` in the
environment ``save_state`` goes through dsckpt's background engine (``dsckpt.enable_async_save(model)``): training
goes on while the files are written, and the job waits for them before it ends.
"""
import json
import os
import sys

import torch

GLOBAL_BATCH, DIM = 6, 13


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=gen)
    y = x.sum(dim=1, keepdim=True).tanh()
    part = GLOBAL_BATCH // world
    return x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]


def main(output_dir: str, stage: str, steps: str, save_at: str, resume: str | None) -> None:
    from accelerate import Accelerator, DeepSpeedPlugin

    world = int(os.environ["WORLD_SIZE"])
    plugin = DeepSpeedPlugin(hf_ds_config={  # explicit batch sizes: "auto" would compute world size 1 on CPU
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 1, "zero_optimization": {"stage": int(stage)},
        "zero_allow_untested_optimizer": True})
    accelerator = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 29), torch.nn.GELU(), torch.nn.Linear(29, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / 10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    saver = None
    if os.environ.get("DSCKPT_ASYNC"):
        import dsckpt

        saver = dsckpt.enable_async_save(model)  # the engine accelerator.prepare returned
    start = 0
    if resume:
        accelerator.load_state(resume)
        model.save_checkpoint(os.path.join(output_dir, "as_loaded"), tag="as_loaded")  # before any step
        start = int(save_at)
    log = []
    # (on CPU ranks Accelerate's own state says 1 process - every rank is process_index 0, so each writes
    # random_states_0.pkl - while DeepSpeed partitions over all of them: ranks come from torch.distributed)
    rank = torch.distributed.get_rank()
    for step in range(start, int(steps)):
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        log.append({"step": step + 1, "loss": float(mean) / world, "lr": scheduler.get_last_lr()[0]})
        if not resume and step + 1 == int(save_at):
            accelerator.save_state(os.path.join(output_dir, "state"))
    if saver is not None:
        saver.wait()
    if rank == 0:
        with open(os.path.join(output_dir, "log.json"), "w") as fh:
            json.dump({"world_size": world, "log": log}, fh)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:5], sys.argv[5] if len(sys.argv) > 5 else None)
    from job_exit import leave

    leave()
