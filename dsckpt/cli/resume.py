"""`dsckpt resume`: carry on training from a sharded checkpoint or a full-weights file."""
from __future__ import annotations

import contextlib
import sys

import click

from .options import SKIP_CRC_HELP, training_options, tags_of
from .app import in_launched_rank, require_runtime, world_size_for, cli


@cli.command()
@click.argument("checkpoint", required=False, type=click.Path())
@click.option("--full-weights", type=click.Path(), default=None, help="One weights file (.safetensors/.pt/.bin or sharded folder).")
@click.option("--client-state", type=click.Path(dir_okay=False), default=None,
              help="Client-state sidecar JSON, or 'none' to restore nothing (default: FILE.client_state.json, "
                   "else what a .pt holds beside its state_dict; for CKPT_DIR: the checkpoint's own).")
@click.option("--tag", default=None, shell_complete=tags_of("checkpoint"), help="Tag of CHECKPOINT to resume.")
@click.option("--strict/--no-strict", default=True, show_default=True, help="Refuse missing/unexpected keys.")
@click.option("--strip-prefix", multiple=True, metavar="PREFIX", help="Remove a name prefix of the file (repeatable).")
@click.option("--check", is_flag=True, help="Load, compare with the file on every rank, report; no training.")
@click.option("--reshard", is_flag=True, help="CHECKPOINT at another world size or (with --stage) ZeRO stage: rewrite "
              "it for this run first (optimizer state kept between ZeRO stages 1-3; from ZeRO-0 its consolidated weights, "
              "optimizer fresh).")
@click.option("--skip-crc-check", is_flag=True, help=SKIP_CRC_HELP)
@click.option("--trust-checkpoint", is_flag=True,
              help="Let DeepSpeed unpickle CHECKPOINT its own way, without weights_only (its pickles may run code). "
                   "Default: refuse classes beyond DeepSpeed's own.")
@training_options(steps_help="Steps to train after the restored position (additional, not a target step).")
def resume(nproc: int, **kwargs) -> None:
    """Carry on training from a sharded checkpoint or a full-weights file.

    \b
    Examples:
      dsckpt resume runs/demo --nproc 2 --steps 10 --save-dir runs/demo
      dsckpt resume --full-weights model.safetensors --nproc 3 --stage 3 --steps 10 --save-dir runs/ws3
      dsckpt resume --full-weights model.safetensors --nproc 2 --check
      dsckpt resume runs/demo --nproc 3 --reshard --steps 5
      dsckpt resume runs/z2 --nproc 3 --reshard --stage 3 --steps 5      (ZeRO-2 -> ZeRO-3, optimizer kept)
      dsckpt resume s3://bucket/runs/demo --nproc 2 --steps 10      (fetched to a scratch folder first)
    Full weights load into ZeRO-3 module by module through GatheredParameters (rank 0 reads);
    optimizer moments start fresh; the client state comes from the sidecar.  A sharded CHECKPOINT
    resumes at its own ZeRO stage unless --stage, --preset or --config say otherwise.
    """
    require_runtime("resume")
    from ..parallel.readable import readable
    from ..runtime import commands, console, launch

    rank_argv = sys.argv[1:]  # what --nproc's ranks run: the command as typed, a fetched URL as its local copy
    with contextlib.ExitStack() as local_copies:
        for key in ("checkpoint", "full_weights"):  # a URL: every byte fetched (DeepSpeed's loader reads them all)
            given = kwargs.get(key)
            opened = local_copies.enter_context(readable(given, kwargs.get("tag"), whole=True)) if given else None
            if opened is not None and opened.path != str(given):
                kwargs[key] = opened.path
                console.name_as(opened.path, str(given))
                rank_argv = [opened.path if arg == given else arg for arg in rank_argv]
        if not in_launched_rank():
            commands.preflight_resume(world_size_for(nproc), **kwargs)
        with commands.interruptible(kwargs.get("save_dir")):
            if launch.should_launch(nproc):
                sys.exit(launch.launch(nproc, argv=rank_argv))
            commands.run_resume(**kwargs, before_exit=local_copies.close)  # (it ends the process itself)
