"""`dsckpt inspect`: a summary of a checkpoint or a consolidated file, from metadata alone."""
from __future__ import annotations

import sys

import click

from .app import EXIT_PROBLEMS, cli


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

    from ..analysis.inspect import render, summarize

    summary = summarize(path, tag, tensors)
    click.echo(json.dumps(summary, indent=2) if as_json else render(summary))
    if summary["problems"]:
        sys.exit(EXIT_PROBLEMS)
