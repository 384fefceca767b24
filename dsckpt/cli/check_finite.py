"""`dsckpt check-finite`: a NaN/Inf gate for CI and job scripts."""
from __future__ import annotations

import sys

import click

from .app import cli, json_document
from .options import SKIP_CRC_HELP, crc_skipped_note, shown

EXIT_NON_FINITE = 3


@cli.command("check-finite")
@click.argument("path", type=click.Path())
@click.option("--tag", default=None, help="Tag of a checkpoint (default: what `latest` names).")
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

    with readable(path, tag) as (local, local_tag, fetch, _):
        _check_finite(local, local_tag, optimizer, skip_crc_check, as_json, shown({local: path}), fetch)


def _check_finite(path: str, tag: str | None, optimizer: bool, skip_crc_check: bool, as_json: bool, echo,
                  fetch=None) -> None:
    from ..analysis.sources import resolved_tag, sources
    from ..analysis.stats import compute_stats

    stats = compute_stats(sources(path, tag, optimizer, check_crc=not skip_crc_check, fetch=fetch))
    notes = crc_skipped_note(skip_crc_check)
    bad = [{"name": s.name, "kind": s.kind, "nan": s.nan, "inf": s.inf, "count": s.count} for s in stats if not s.finite]
    if as_json:
        echo(json_document(input=str(path), tag=resolved_tag(path, tag), finite=not bad, tensors=len(stats),
                                 offending=bad, notes=notes))
    elif bad:
        echo(f"{len(bad)} of {len(stats)} tensors hold non-finite values:")
        for b in bad:
            echo(f"  {b['name']}: {b['nan']:,} NaN, {b['inf']:,} Inf of {b['count']:,}")
    else:
        echo(f"all {len(stats)} tensors finite")
    if bad:
        sys.exit(EXIT_NON_FINITE)
