"""The `dsckpt` command line: thin click commands over the library.

Heavy imports (torch, DeepSpeed) happen inside the commands that need them, so `inspect` and
`consolidate` start fast.  ``main()`` is the one place that turns a ``DsckptError`` into a
one-line message (plus hint) and exit code 2; ``DSCKPT_DEBUG=1`` keeps the traceback.
"""
from __future__ import annotations

import os
import sys

import click

from ._version import __version__
from .errors import DsckptError

EXIT_PROBLEMS = 1  # inspect found problems / verify failed
EXIT_ERROR = 2  # a typed dsckpt error


def _training_options(fn):
    opts = [
        click.option("--model", default=None, metavar="PKG.MODULE:FACTORY", help="Model factory (default: built-in tiny causal LM)."),
        click.option("--preset", default=None, help="deepspeed, deepspeed_stage_1, ..._2, ..._2_offload, ..._3, ..._3_offload, ..._3_offload_nvme."),
        click.option("--stage", type=click.IntRange(0, 3), default=None, help="ZeRO stage (overrides the preset's)."),
        click.option("--config", "config", default=None, type=click.Path(dir_okay=False), help="DeepSpeed JSON config (else $DSCKPT_DEEPSPEED_CONFIG)."),
        click.option("--precision", type=click.Choice(["32", "bf16", "16"]), default="32", show_default=True),
        click.option("--steps", type=int, default=20, show_default=True),
        click.option("--save-dir", type=click.Path(file_okay=False), default=None),
        click.option("--save-every", type=int, default=0, help="Save every N steps (0: once at the end)."),
        click.option("--nproc", type=int, default=1, show_default=True, help="Local ranks, started through torch.distributed.run."),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--freeze", is_flag=True, help="Built-in model: freeze its first block."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dsckpt")
def cli() -> None:
    """Inspect, consolidate and resume DeepSpeed ZeRO checkpoints.

    \b
    Examples:
      dsckpt train --stage 3 --nproc 2 --save-dir runs/demo
      dsckpt inspect runs/demo
      dsckpt consolidate runs/demo model.safetensors
      dsckpt resume --full-weights model.safetensors --nproc 2 --steps 5
    """


@cli.command()
@_training_options
def train(nproc: int, **kwargs) -> None:
    """Train a model with DeepSpeed and save sharded checkpoints with client state.

    \b
    Examples:
      dsckpt train --stage 3 --nproc 2 --steps 20 --save-dir runs/demo
      dsckpt train --preset deepspeed_stage_2 --precision bf16 --save-dir runs/z2
      torchrun --nproc_per_node 2 -m dsckpt train --config ds.json --save-dir runs/x
    """
    from .runtime import launch

    if launch.should_launch(nproc):
        sys.exit(launch.launch(nproc))
    from .runtime.commands import run_train

    run_train(**kwargs)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except DsckptError as exc:
        if os.environ.get("DSCKPT_DEBUG") == "1":
            raise
        click.echo(f"dsckpt: error: {exc}", err=True)
        if exc.hint:
            click.echo(f"hint: {exc.hint}", err=True)
        sys.exit(EXIT_ERROR)
    except BrokenPipeError:
        sys.exit(1)
