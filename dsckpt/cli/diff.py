"""`dsckpt diff`: compare two checkpoints, two tags, or a checkpoint and a consolidated file."""
from __future__ import annotations

import sys

import click

from .app import EXIT_PROBLEMS, cli, json_document
from ..formats.storage import SAME_NAMES, Alias
from .options import SKIP_CRC_HELP, crc_skipped_note, tags_of


@cli.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--tag-a", default=None, shell_complete=tags_of("a"), help="Tag of A (default: what `latest` names).")
@click.option("--tag-b", default=None, shell_complete=tags_of("b"), help="Tag of B (default: what `latest` names).")
@click.option("--atol", default=0.0, show_default=True, help="Absolute tolerance (0 with --rtol 0: bitwise).")
@click.option("--rtol", default=0.0, show_default=True, help="Relative tolerance, as torch.allclose.")
@click.option("--optimizer", is_flag=True, help="Compare Adam's moments too (two ZeRO-1/2/3 checkpoints).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="A PNG of the relative change per tensor, by layer (needs dsckpt[plot]).")
@click.option("--skip-crc-check", is_flag=True, help=SKIP_CRC_HELP)
def diff(a: str, b: str, tag_a, tag_b, atol: float, rtol: float, optimizer: bool, as_json: bool,
         plot: str | None, skip_crc_check: bool) -> None:
    """Per tensor: max |a-b|, relative L2 change, equal or not; names on one side only.

    \b
    Examples:
      dsckpt diff runs/demo model.safetensors              # does a consolidated file equal its checkpoint?
      dsckpt diff runs/demo runs/demo --tag-a step30 --tag-b step40
      dsckpt diff runs/demo runs/demo_ws3 --atol 1e-6 --json    # a resharded copy holds the same weights
    Exit 0 when identical (bitwise, or within --atol/--rtol), 1 when not, 2 on errors.
    """
    from ..parallel.readable import readable

    with readable(a, tag_a) as opened_a, readable(b, tag_b) as opened_b:
        _diff(opened_a.path, opened_b.path, opened_a.tag, opened_b.tag, atol, rtol, optimizer, as_json, plot,
              skip_crc_check, (opened_a.alias, opened_b.alias), (opened_a.fetch, opened_b.fetch))


def _diff(a: str, b: str, tag_a, tag_b, atol: float, rtol: float, optimizer: bool, as_json: bool,
          plot: str | None, skip_crc_check: bool, aliases: tuple[Alias, Alias] = (SAME_NAMES, SAME_NAMES),
          fetch=(None, None)) -> None:
    from ..analysis.diff import diff as compare
    from ..analysis.report import render_diff
    from ..analysis.sources import resolved_tag, sources

    check = not skip_crc_check
    report = compare(sources(a, tag_a, optimizer, check, fetch[0]), sources(b, tag_b, optimizer, check, fetch[1]),
                     atol, rtol)
    notes = crc_skipped_note(skip_crc_check)
    if plot:
        from pathlib import Path

        from ..analysis.plot import bar_plot

        bar_plot([t.name for t in report.tensors], [t.rel_l2 for t in report.tensors], Path(plot),
                 title=f"relative L2 change per tensor: {aliases[0](a)} ({tag_a or 'latest'}) -> {aliases[1](b)} ({tag_b or 'latest'})", ylabel="||a - b|| / ||a|| (log)")
    click.echo(json_document(a=aliases[0](a), b=aliases[1](b), tag_a=resolved_tag(a, tag_a), tag_b=resolved_tag(b, tag_b), **report.record(), notes=notes) if as_json else render_diff(report))
    if not report.identical:
        sys.exit(EXIT_PROBLEMS)
