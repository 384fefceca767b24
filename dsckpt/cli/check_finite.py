"""`dsckpt check-finite`: a NaN/Inf gate for CI and job scripts."""
from __future__ import annotations

import sys

import click

from .app import cli, json_document
from ..formats.storage import Alias
from .options import SKIP_CRC_HELP, crc_skipped_note, tags_of

EXIT_NON_FINITE = 3


@cli.command("check-finite")
@click.argument("path", type=click.Path())
@click.option("--tag", default=None, shell_complete=tags_of("path"),
              help="Tag of a checkpoint (default: what `latest` names).")
@click.option("--optimizer", is_flag=True, help="Check the optimizer's state too (Adam's exp_avg / exp_avg_sq, SGD's momentum; ZeRO 1-3).")
@click.option("--skip-crc-check", is_flag=True, help=SKIP_CRC_HELP)
@click.option("--json", "as_json", is_flag=True, help="One JSON document: {finite, tensors, offending}.")
def check_finite(path: str, tag: str | None, optimizer: bool, skip_crc_check: bool, as_json: bool) -> None:
    """Exit 0 when every value is finite; exit 3 listing the tensors with NaN or Inf.

    \b
    Examples:
      dsckpt check-finite runs/demo && echo healthy
      dsckpt check-finite model.safetensors --json
      dsckpt check-finite runs/demo --optimizer --tag step30
    Works on checkpoint folders and consolidated files; exit 2 on unreadable input.
    """
    from ..parallel.readable import readable

    with readable(path, tag) as opened:
        _check_finite(opened.path, opened.tag, optimizer, skip_crc_check, as_json, opened.alias, opened.fetch)


def _check_finite(path: str, tag: str | None, optimizer: bool, skip_crc_check: bool, as_json: bool, alias: Alias,
                  fetch=None) -> None:
    from ..analysis.sources import resolved_tag, sources
    from ..analysis.stats import compute_stats

    stats = compute_stats(sources(path, tag, optimizer, check_crc=not skip_crc_check, fetch=fetch))
    notes = crc_skipped_note(skip_crc_check)
    bad = [{"name": s.name, "kind": s.kind, "nan": s.nan, "inf": s.inf, "count": s.count} for s in stats if not s.finite]
    if as_json:
        click.echo(json_document(input=alias(path), tag=resolved_tag(path, tag), finite=not bad, tensors=len(stats),
                                 offending=bad, notes=notes))
    elif bad:
        click.echo(f"{len(bad)} of {len(stats)} tensors hold non-finite values:")
        for b in bad:
            click.echo(f"  {b['name']}: {b['nan']:,} NaN, {b['inf']:,} Inf of {b['count']:,}")
    else:
        click.echo(f"all {len(stats)} tensors finite")
    if bad:
        sys.exit(EXIT_NON_FINITE)
