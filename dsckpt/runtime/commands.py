"""Bodies of the runtime's CLI commands (train, resume); each runs on every rank."""
from __future__ import annotations

import logging

import click


def quiet_deepspeed() -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def run_train(**kwargs) -> None:
    from . import engine as eng
    from .train import TrainOptions, Trainer

    quiet_deepspeed()
    trainer = Trainer(TrainOptions(**kwargs))
    losses = trainer.fit(trainer.opts.steps)
    if eng.rank() == 0:
        where = f", saved to {trainer.opts.save_dir}" if trainer.opts.save_dir else ""
        click.echo(f"trained {len(losses)} steps (stage {trainer.runtime.stage}, world size {eng.world_size()}): "
                   f"loss {losses[0]:.4f} -> {losses[-1]:.4f}{where}")
