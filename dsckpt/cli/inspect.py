"""`dsckpt inspect`: a summary of a checkpoint or a consolidated file, from metadata alone."""
from __future__ import annotations

import json
import sys

import click

from .app import EXIT_PROBLEMS, cli, json_document
from ..formats.storage import Alias
from .options import SKIP_CRC_HELP, crc_skipped_note, tags_of


@cli.command()
@click.argument("path", type=click.Path())
@click.option("--tag", default=None, shell_complete=tags_of("path"),
              help="Tag to inspect (default: what `latest` names).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document (schema: docs/cli.md).")
@click.option("--tensors", is_flag=True, help="List every tensor and the rank files that hold it.")
@click.option("--stats", is_flag=True, help="Read the values: per tensor min, max, mean, std, L2 norm, NaN/Inf, zeros.")
@click.option("--optimizer", is_flag=True, help="With --stats: the optimizer's state too (Adam's exp_avg / exp_avg_sq, SGD's momentum; ZeRO 1-3).")
@click.option("--top", type=click.IntRange(min=1), default=None, help="With --stats: tensors listed by norm [default: 20].")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="With --stats: a PNG of the norm per tensor, by layer (needs dsckpt[plot]).")
@click.option("--skip-crc-check", is_flag=True, help="With --stats: " + SKIP_CRC_HELP)
@click.option("--du", is_flag=True, help="Bytes per component: weights, fp32 masters, each optimizer state, client "
              "state, companions, overhead; with totals.")
def inspect(path: str, tag: str | None, as_json: bool, tensors: bool, stats: bool, optimizer: bool, top: int,
            plot: str | None, skip_crc_check: bool, du: bool) -> None:
    """Summarize a checkpoint, or a consolidated file, from metadata alone.

    \b
    Examples:
      dsckpt inspect runs/demo
      dsckpt inspect runs/demo --tag step30 --tensors
      dsckpt inspect runs/demo --json | jq .zero_stage
      dsckpt inspect model.safetensors
      dsckpt inspect runs/demo --stats --optimizer --top 10
      dsckpt inspect model.safetensors --stats --json | jq '.stats[] | select(.nan > 0)'
      dsckpt inspect s3://bucket/runs/demo          (gs://, az:// too: pip install 'dsckpt[s3]')
      dsckpt inspect runs/demo_dcp                  (a DCP folder: what convert --to deepspeed reads)
    Exit code 1 when problems (missing ranks, truncated files...) are found.
    """
    from pathlib import Path

    from ..parallel.readable import readable

    if Path(path).is_dir() and (Path(path) / ".metadata").is_file():  # a DCP folder: what convert --to deepspeed reads
        if tag or tensors or stats or du:
            raise click.UsageError("a torch.distributed.checkpoint folder is summarized as a whole: no --tag, "
                                   "--tensors, --stats or --du")
        from ..analysis.inspect_dcp import render_dcp, summarize_dcp

        summary = summarize_dcp(Path(path))
        click.echo(json.dumps(summary, indent=2) if as_json else render_dcp(summary))
        return
    with readable(path, tag) as opened:
        _inspect(opened.path, opened.tag, as_json, tensors, stats, optimizer, top, plot, skip_crc_check, du,
                 opened.alias, opened.fetch)


def _inspect(path: str, tag: str | None, as_json: bool, tensors: bool, stats: bool, optimizer: bool, top: int | None,
             plot: str | None, skip_crc_check: bool, du: bool, alias: Alias, fetch=None) -> None:
    import json
    import math

    from ..analysis.inspect import render, summarize

    needs_stats = [flag for flag, given in (("--optimizer", optimizer), ("--top", top is not None), ("--plot", plot),
                                                    ("--skip-crc-check", skip_crc_check))
                   if given]
    if needs_stats and not stats:
        raise click.UsageError(f"{', '.join(needs_stats)} work on the values: add --stats")
    if du and (stats or tensors):
        raise click.UsageError("--du sums bytes per component; --stats and --tensors list tensors: give one")
    if stats and tensors:
        raise click.UsageError("--tensors lists names and files; --stats lists values: give one of them")
    if stats:
        from ..analysis.report import render_stats
        from ..analysis.sources import resolved_tag, sources
        from ..analysis.stats import compute_stats

        records = compute_stats(sources(path, tag, optimizer, check_crc=not skip_crc_check, fetch=fetch))
        notes = crc_skipped_note(skip_crc_check)
        if plot:
            from pathlib import Path

            from ..analysis.plot import bar_plot

            bar_plot([r.name for r in records], [math.inf if not r.finite else r.norm for r in records], Path(plot),
                     title=f"L2 norm per tensor: {alias(path)}", ylabel="L2 norm (log)")
        click.echo(json_document(input=alias(path), tag=resolved_tag(path, tag), tensors=len(records),
                                 stats=[s.record() for s in records], notes=notes) if as_json
                   else render_stats(records, top or 20))
        return

    if du:
        from ..analysis.du import disk_usage
        from ..zero.reader import open_checkpoint

        ckpt = open_checkpoint(path, tag)
        usage = alias.renamed(disk_usage(ckpt))
        if as_json:
            click.echo(json_document(input=alias(path), tag=ckpt.layout.tag, **usage, notes=list(ckpt.layout.notes)))
            return
        width = max(len(k) for k in usage["components"]) + 2
        for name, n in usage["components"].items():
            click.echo(f"{name:<{width}}{n:>16,} B  {100 * n / max(usage['bytes'], 1):5.1f} %")
        click.echo(f"{'total':<{width}}{usage['bytes']:>16,} B  ({len(usage['files'])} files, tag {ckpt.layout.tag})")
        return
    summary = alias.renamed(summarize(path, tag, tensors))
    click.echo(json.dumps(summary, indent=2) if as_json else render(summary))
    if summary["problems"]:
        sys.exit(EXIT_PROBLEMS)
