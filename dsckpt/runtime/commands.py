"""Bodies of the runtime's CLI commands (train, resume); each runs on every rank."""
from __future__ import annotations

import logging
import os

import click


def quiet_deepspeed() -> None:
    import warnings

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes inside DeepSpeed


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
    eng.shutdown(exit_process=True)


def run_resume(checkpoint, full_weights, client_state, tag, strict, strip_prefix, check, reshard, as_json, **kwargs) -> None:
    import json

    from ..errors import ConfigError
    from . import engine as eng
    from .resume import check_against_file, resume_full_weights, resume_sharded
    from .train import TrainOptions, Trainer

    quiet_deepspeed()
    if bool(checkpoint) == bool(full_weights):
        raise ConfigError("give either CKPT_DIR or --full-weights FILE")
    if full_weights and int(os.environ.get("RANK", "0")) == 0:
        from .weights_file import WeightsFile

        WeightsFile(full_weights, tuple(strip_prefix))  # a broken file fails now, before DeepSpeed starts
    trainer = Trainer(TrainOptions(**kwargs))
    if full_weights:
        client = resume_full_weights(trainer, full_weights, client_state, strict, tuple(strip_prefix))
    else:
        resume_sharded(trainer, checkpoint, tag, reshard, strict)
        client = None
    if check:
        if not full_weights:
            raise ConfigError("--check compares against a --full-weights file")
        report = check_against_file(trainer, full_weights, client, tuple(strip_prefix))
        if eng.rank() == 0:
            click.echo(json.dumps(report) if as_json else
                       f"check passed: {report['tensors_checked']} tensors identical to {full_weights} on every rank "
                       f"(max abs diff 0; {report['fp32_masters_checked']} fp32 masters equal); client state "
                       f"restored: {', '.join(report['client_state_keys_restored']) or 'none'}")
        eng.shutdown(exit_process=True)
        return
    start = trainer.global_step
    losses = trainer.fit(trainer.opts.steps)
    if eng.rank() == 0:
        click.echo(f"resumed training: steps {start} -> {trainer.global_step}, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
                   + (f", saved to {trainer.opts.save_dir}" if trainer.opts.save_dir else ""))
    eng.shutdown(exit_process=True)
