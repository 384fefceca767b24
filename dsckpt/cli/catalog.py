"""`dsckpt list` and `dsckpt prune`: the checkpoints a run saved, and room made by removing old ones."""
from __future__ import annotations

import click

from .app import cli, json_document


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _rows(entries) -> list[str]:
    first = "checkpoint" if entries and entries[0].name != entries[0].tag else "tag"  # an HF output_dir's
    lines = [f"{first:<24}{'step':>8}  {'stage':>5}  {'world':>5}  {'size':>10}  state"]
    for e in entries:
        state = e.leftover or ("complete" if e.complete else "INCOMPLETE") + ("  <- latest" if e.resumes_from else "")
        step, stage = ("-" if v is None else v for v in (e.step, e.zero_stage))
        lines.append(f"{e.name:<24}{step:>8}  {stage:>5}  {e.world_size or '-':>5}  {_human(e.bytes):>10}  {state}")
    return lines


@cli.command("list")
@click.argument("root", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="One JSON document: {input, checkpoints: [...]}.")
def list_command(root: str, as_json: bool) -> None:
    """Every checkpoint a run saved: tag, step, ZeRO stage, world size, size, complete or not.

    ROOT is a DeepSpeed save folder (`latest` + tag folders) or an HF Trainer output_dir (checkpoint-N
    folders).  Complete: every rank file the world size needs is present and readable (CRCs are not
    read: `dsckpt verify` does that).  `latest` marks the one a resume picks.  Hidden folders of saves
    that never completed are rows too: "interrupted save" (its process is gone: `prune` removes it) or
    "save in progress".

    \b
    Examples:
      dsckpt list runs/demo
      dsckpt list out/ --json | jq '.checkpoints[] | select(.complete | not)'
    """
    from ..api.catalog import latest_problem, list_checkpoints

    entries = list_checkpoints(root)
    notes = [f"{problem} (every tag is listed; pass one with --tag to the other commands)"
             for problem in [latest_problem(root)] if problem]
    if as_json:
        click.echo(json_document(input=root, checkpoints=[vars(e) for e in entries], notes=notes))
        return
    click.echo("\n".join(_rows(entries)))
    for note in notes:
        click.echo(f"note: {note}", err=True)
    for e in entries:
        for p in e.problems[:3]:
            click.echo(f"  {e.name}: {p}", err=True)


@cli.command()
@click.argument("root", type=click.Path())
@click.option("--keep", type=click.IntRange(min=1), required=True, help="Complete checkpoints to keep (the newest).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.option("--no-check", is_flag=True, help="Do not read the fp32 masters: keep the newest --keep complete "
              "checkpoints whether or not they are finite.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document: {input, removed, kept, dry_run, notes}.")
def prune(root: str, keep: int, dry_run: bool, no_check: bool, as_json: bool) -> None:
    """Remove the oldest complete checkpoints, keeping the newest --keep.

    Never removed: the one a resume picks (what `latest` names; an HF output_dir's newest
    checkpoint-N), an incomplete checkpoint, anything newer than the one a resume picks, or a save
    in progress.  Always removed: what interrupted saves left (hidden staging folders of processes
    that are gone).  Prints every folder it removes.  The newest checkpoints are read (fp32 masters,
    streamed) until --keep finite ones are found: a run gone to NaN keeps its last good ones.

    \b
    Examples:
      dsckpt prune runs/demo --keep 3 --dry-run
      dsckpt prune out/ --keep 2              (an HF Trainer output_dir: whole checkpoint-N folders)
    """
    from ..analysis.finiteness import prune as run

    removed, kept = run(root, keep, dry_run, check=not no_check)
    notes = [f"{e.name}: its fp32 masters hold NaN or Inf; kept, with the newest finite ones beside it"
             for e in kept if e.finite is False]
    if as_json:
        click.echo(json_document(input=root, dry_run=dry_run, removed=[vars(e) for e in removed],
                                 kept=[vars(e) for e in kept], notes=notes))
        return
    for note in notes:
        click.echo(f"note: {note}", err=True)
    verb = "would remove" if dry_run else "removed"
    for e in removed:
        what = e.leftover if e.leftover else f"step {e.step}"
        click.echo(f"{verb} {e.path} ({what}, {_human(e.bytes)})")
    freed = sum(e.bytes for e in removed)
    click.echo(f"{verb} {len(removed)} checkpoint{'s' * (len(removed) != 1)}, {_human(freed)}; kept {len(kept)}")
