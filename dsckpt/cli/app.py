"""The `dsckpt` command group and ``main()``, the one place errors become one line and an exit code.

``main()`` turns a ``DsckptError`` into ``dsckpt: error: <message>`` plus ``hint: <advice>`` and exit 2
(usage errors the same way); ``DSCKPT_DEBUG=1`` keeps the traceback.  Inside a rank started by
``--nproc`` the error goes to the launcher instead, which prints it once for all ranks.
"""
from __future__ import annotations

import os
import sys

import click

from .._version import __version__
from ..errors import DsckptError

EXIT_PROBLEMS = 1  # inspect found problems
EXIT_ERROR = 2  # a typed dsckpt error (a failed --verify too) or a usage error


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dsckpt")
def cli() -> None:
    """Inspect, consolidate, reshard and resume DeepSpeed ZeRO checkpoints.

    \b
    Examples:
      dsckpt train --stage 3 --nproc 2 --save-dir runs/demo
      dsckpt inspect runs/demo
      dsckpt consolidate runs/demo model.safetensors
      dsckpt reshard runs/demo runs/demo_ws4 --world-size 4
      dsckpt resume --full-weights model.safetensors --nproc 2 --steps 5
    """


def require_runtime(command: str) -> None:
    """train/resume need torch and DeepSpeed, which `pip install dsckpt` does not bring."""
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):
            return True

    missing = [m for m in ("torch", "deepspeed", "safetensors") if absent(m)]
    if missing:
        from ..errors import MissingExtraError

        raise MissingExtraError(f"`dsckpt {command}` needs {', '.join(missing)}, not installed",
                                hint="pip install 'dsckpt[runtime]'  (inspect and consolidate work without it)")


def in_launched_rank() -> bool:
    """A rank started by `--nproc` (its launcher already ran the preflight)."""
    from ..runtime.console import ERROR_DIR_ENV

    return ERROR_DIR_ENV in os.environ and "LOCAL_RANK" in os.environ


def world_size_for(nproc: int) -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if "LOCAL_RANK" in os.environ else nproc


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        hint = f"see `{exc.ctx.command_path} --help`" if exc.ctx else "see `dsckpt --help`"
        click.echo(f"dsckpt: error: {exc.format_message()}\nhint: {hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"dsckpt: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except DsckptError as exc:
        if os.environ.get("DSCKPT_DEBUG") == "1":
            raise
        from ..runtime.console import report_rank_error

        if in_launched_rank() and report_rank_error(str(exc), exc.hint):
            sys.exit(EXIT_ERROR)  # the launcher prints it once for all ranks
        click.echo(f"dsckpt: error: {exc}", err=True)
        if exc.hint:
            click.echo(f"hint: {exc.hint}", err=True)
        sys.exit(EXIT_ERROR)
    except BrokenPipeError:
        sys.exit(1)
