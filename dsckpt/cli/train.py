"""`dsckpt train`: the runtime's training job, on one or `--nproc` local ranks."""
from __future__ import annotations

import sys

from .options import training_options
from .app import in_launched_rank, require_runtime, cli


@cli.command()
@training_options
def train(nproc: int, as_json: bool, **kwargs) -> None:
    """Train a model with DeepSpeed and save sharded checkpoints with client state.

    \b
    Examples:
      dsckpt train --stage 3 --nproc 2 --steps 30 --save-dir runs/demo
      dsckpt train --preset deepspeed_stage_2 --precision bf16 --save-dir runs/z2
      torchrun --nproc_per_node 2 -m dsckpt train --config ds.json --save-dir runs/x
    Ctrl-C stops every rank (exit 130); the last complete checkpoint stays, no partial one is left.
    """
    require_runtime("train")
    from ..runtime import commands, launch

    if not in_launched_rank():
        commands.preflight_train(**kwargs)
    with commands.interruptible(kwargs.get("save_dir")):
        if launch.should_launch(nproc):
            sys.exit(launch.launch(nproc))
        commands.run_train(as_json=as_json, **kwargs)
