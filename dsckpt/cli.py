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

EXIT_PROBLEMS = 1  # inspect found problems
EXIT_ERROR = 2  # a typed dsckpt error (a failed --verify too) or a usage error


def _training_options(fn):
    opts = [
        click.option("--model", default=None, metavar="PKG.MODULE:FACTORY", help="Model factory (default: built-in tiny causal LM)."),
        click.option("--preset", default=None, help="deepspeed, deepspeed_stage_1, ..._2, ..._2_offload, ..._3, ..._3_offload, ..._3_offload_nvme (default: deepspeed_stage_3 unless --stage or --config is given)."),
        click.option("--stage", type=click.IntRange(0, 3), default=None, help="ZeRO stage (overrides the preset's; default: the preset's)."),
        click.option("--config", "config", default=None, type=click.Path(dir_okay=False), help="DeepSpeed JSON config (else $DSCKPT_DEEPSPEED_CONFIG)."),
        click.option("--precision", type=click.Choice(["32", "bf16", "16"]), default="32", show_default=True),
        click.option("--steps", type=int, default=20, show_default=True),
        click.option("--save-dir", type=click.Path(file_okay=False), default=None, help="Where to save checkpoints (default: nowhere; nothing is saved)."),
        click.option("--save-every", type=int, default=0, help="Save every N steps (0: once at the end)."),
        click.option("--nproc", type=int, default=1, show_default=True, help="Local ranks, started through torch.distributed.run."),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--freeze", is_flag=True, help="Built-in model: freeze its first block."),
        click.option("--offload-optimizer/--no-offload-optimizer", default=None, help="ZeRO-Offload of optimizer state (default: the preset's)."),
        click.option("--offload-parameters/--no-offload-parameters", default=None, help="ZeRO-3 parameter offload (default: the preset's)."),
        click.option("--gradient-accumulation-steps", type=int, default=None),
        click.option("--gradient-clip-val", type=float, default=None, help="Clip by global norm (DeepSpeed's only mode)."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON document (logs go to stderr)."),
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
def train(nproc: int, as_json: bool, **kwargs) -> None:
    """Train a model with DeepSpeed and save sharded checkpoints with client state.

    \b
    Examples:
      dsckpt train --stage 3 --nproc 2 --steps 20 --save-dir runs/demo
      dsckpt train --preset deepspeed_stage_2 --precision bf16 --save-dir runs/z2
      torchrun --nproc_per_node 2 -m dsckpt train --config ds.json --save-dir runs/x
    """
    _require_runtime("train")
    from .runtime import commands, launch

    if not _in_launched_rank():
        commands.preflight_train(_world_size(nproc), **kwargs)
    if launch.should_launch(nproc):
        sys.exit(launch.launch(nproc))
    commands.run_train(as_json=as_json, **kwargs)


@cli.command()
@click.argument("path", type=click.Path())
@click.option("--tag", default=None, help="Tag to inspect (default: what `latest` names).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document (schema: docs/cli.md).")
@click.option("--tensors", is_flag=True, help="List every tensor and the rank files that hold it.")
def inspect(path: str, tag: str | None, as_json: bool, tensors: bool) -> None:
    """Summarize a checkpoint, or a consolidated file, from metadata alone.

    \b
    Examples:
      dsckpt inspect runs/demo
      dsckpt inspect runs/demo --tag step20 --tensors
      dsckpt inspect runs/demo --json | jq .zero_stage
      dsckpt inspect model.safetensors
    Exit code 1 when problems (missing ranks, truncated files...) are found.
    """
    import json

    from .inspect import render, summarize

    summary = summarize(path, tag, tensors)
    click.echo(json.dumps(summary, indent=2) if as_json else render(summary))
    if summary["problems"]:
        sys.exit(EXIT_PROBLEMS)


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--tag", default=None, help="Tag to consolidate (default: what `latest` names).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Cast floating-point tensors (default: fp32 masters, buffers as stored).")
@click.option("--exclude-frozen", is_flag=True, help="Leave frozen parameters out.")
@click.option("--duplicate-tied", is_flag=True, help="safetensors: write a copy of a tied weight under each of its names.")
@click.option("--strip-prefix", multiple=True, metavar="PREFIX", help="Remove a name prefix (repeatable).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Shard size when OUT is a folder.")
@click.option("--no-client-state", is_flag=True, help="Do not write the client-state sidecar.")
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
@click.option("--verify", is_flag=True, help="CRC-check the sources, then re-read OUT and compare it with the shards.")
@click.option("--no-fsync", is_flag=True, help="Skip flushing OUT to disk before and after the rename (scratch work).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def consolidate(checkpoint: str, out: str, tag, dtype, exclude_frozen, duplicate_tied, strip_prefix,
                max_shard_size, no_client_state, force, verify, no_fsync, quiet, as_json) -> None:
    """Gather a ZeRO 0-3 checkpoint's shards into one file (or a sharded folder).

    \b
    OUT decides the format:
      model.safetensors           safetensors (tied weights once, aliases in __metadata__)
      model.pt | .pth | .bin      torch state dict (loads with weights_only=True)
      model_dir/                  sharded safetensors + model.safetensors.index.json
    \b
    Examples:
      dsckpt consolidate runs/demo model.safetensors
      dsckpt consolidate runs/demo model.pt --tag step10 --dtype bf16
      dsckpt consolidate runs/demo hf_model/ --max-shard-size 2GB --strip-prefix module.
    The client state goes to OUT.client_state.json (+ .safetensors for its tensors).
    """
    import json

    from tqdm import tqdm

    from .convert import consolidate as run

    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="consolidate", disable=quiet or as_json,
              file=sys.stderr, leave=False) as bar:
        def announce(total: int) -> None:  # the plan knows the output's size before any byte moves
            bar.total = total
            bar.refresh()

        result = run(checkpoint, out, tag=tag, dtype=dtype, exclude_frozen=exclude_frozen,
                     duplicate_tied=duplicate_tied, strip_prefixes=tuple(strip_prefix), max_shard_size=max_shard_size,
                     client_state=not no_client_state, force=force, verify=verify, fsync=not no_fsync,
                     progress=bar.update, progress_total=announce)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(json.dumps({"out": str(result.out), "form": result.form, "tensors": result.tensors,
                               "bytes": result.nbytes, "files": list(result.files),
                               "client_state": str(result.sidecar) if result.sidecar else None,
                               "verified": result.verified, "notes": list(result.notes)}))
    else:
        click.echo(f"wrote {result.out} ({result.form}, {result.tensors} tensors, {result.nbytes:,} bytes)"
                   + (f"; client state: {result.sidecar}" if result.sidecar else "")
                   + ("; verified: identical to the shards" if result.verified else ""))


@cli.command()
@click.argument("checkpoint", required=False, type=click.Path())
@click.option("--full-weights", type=click.Path(), default=None, help="One weights file (.safetensors/.pt/.bin or sharded folder).")
@click.option("--client-state", type=click.Path(dir_okay=False), default=None,
              help="Client-state sidecar JSON, or 'none' to restore nothing (default: FILE.client_state.json, "
                   "else what a .pt holds beside its state_dict; for CKPT_DIR: the checkpoint's own).")
@click.option("--tag", default=None, help="Tag of CHECKPOINT to resume.")
@click.option("--strict/--no-strict", default=True, show_default=True, help="Refuse missing/unexpected keys.")
@click.option("--strip-prefix", multiple=True, metavar="PREFIX", help="Remove a name prefix of the file (repeatable).")
@click.option("--check", is_flag=True, help="Load, compare with the file on every rank, report; no training.")
@click.option("--reshard", is_flag=True, help="CHECKPOINT at another world size: load its consolidated weights.")
@click.option("--trust-checkpoint", is_flag=True,
              help="Let DeepSpeed unpickle CHECKPOINT its own way, without weights_only (its pickles may run code). "
                   "Default: refuse classes beyond DeepSpeed's own.")
@_training_options
def resume(nproc: int, **kwargs) -> None:
    """Carry on training from a sharded checkpoint or a full-weights file.

    \b
    Examples:
      dsckpt resume runs/demo --nproc 2 --steps 10 --save-dir runs/demo
      dsckpt resume --full-weights model.safetensors --nproc 3 --stage 3 --steps 10 --save-dir runs/ws3
      dsckpt resume --full-weights model.safetensors --nproc 2 --check
      dsckpt resume runs/demo --nproc 3 --reshard --steps 5
    Full weights load into ZeRO-3 module by module through GatheredParameters (rank 0 reads);
    optimizer moments start fresh; the client state comes from the sidecar.
    """
    _require_runtime("resume")
    from .runtime import commands, launch

    if not _in_launched_rank():
        commands.preflight_resume(_world_size(nproc), **kwargs)
    if launch.should_launch(nproc):
        sys.exit(launch.launch(nproc))
    commands.run_resume(**kwargs)


def _require_runtime(command: str) -> None:
    """train/resume need torch and DeepSpeed, which `pip install dsckpt` does not bring."""
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):
            return True

    missing = [m for m in ("torch", "deepspeed", "safetensors") if absent(m)]
    if missing:
        from .errors import MissingExtraError

        raise MissingExtraError(f"`dsckpt {command}` needs {', '.join(missing)}, not installed",
                                hint="pip install 'dsckpt[runtime]'  (inspect and consolidate work without it)")


def _in_launched_rank() -> bool:
    """A rank started by `--nproc` (its launcher already ran the preflight)."""
    from .runtime.console import ERROR_DIR_ENV

    return ERROR_DIR_ENV in os.environ and "LOCAL_RANK" in os.environ


def _world_size(nproc: int) -> int:
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
        from .runtime.console import report_rank_error

        if _in_launched_rank() and report_rank_error(str(exc), exc.hint):
            sys.exit(EXIT_ERROR)  # the launcher prints it once for all ranks
        click.echo(f"dsckpt: error: {exc}", err=True)
        if exc.hint:
            click.echo(f"hint: {exc.hint}", err=True)
        sys.exit(EXIT_ERROR)
    except BrokenPipeError:
        sys.exit(1)
