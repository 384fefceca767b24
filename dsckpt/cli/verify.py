"""`dsckpt verify`: is a checkpoint whole, undamaged, finite and resumable (before the originals are deleted)?"""
from __future__ import annotations

import sys

import click

from .app import EXIT_PROBLEMS, cli, json_document
from .options import ByteBar, tags_of


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--tag", default=None, shell_complete=tags_of("checkpoint"),
              help="Tag to verify (default: what `latest` names).")
@click.option("--all-tags", is_flag=True, help="Verify every tag in CHECKPOINT.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document: {ok, tags: [{tag, problems, ...}]}.")
def verify(checkpoint: str, tag: str | None, all_tags: bool, as_json: bool) -> None:
    """Check every rank file's CRCs, structure, cross-rank consistency, finiteness and companions.

    \b
    What is checked, per tag:
      structure    the files the world size needs, one run's files, partition counts, shapes
      crc          every storage of every rank file against its zip CRC-32
      finite       fp32 masters, frozen parameters, buffers and the optimizer's moments
      companions   what a trainer resumes from: HF trainer_state.json and rng_state_{rank}.pth,
                   Accelerate's random_states_0.pkl, Lightning's loop state; `latest`
    Exit 0: all good; 1: problems (listed); 2: CHECKPOINT cannot be read.
    \b
    Examples:
      dsckpt verify runs/demo
      dsckpt verify runs/demo --all-tags --json
      dsckpt verify out/checkpoint-500 && rm -r /backup/checkpoint-500
    """
    from ..analysis.verify import verify as run

    if tag and all_tags:
        raise click.UsageError("--tag names one tag, --all-tags every one: give one of them")
    with ByteBar("verify", as_json or not sys.stderr.isatty()) as bar:
        reports = [vars(r) for r in run(checkpoint, tag, all_tags, bar)]  # (a URL's: named as typed)
    ok = not any(r["problems"] for r in reports)
    notes = list(dict.fromkeys(n for r in reports for n in r["notes"]))
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(json_document(input=checkpoint, ok=ok, tags=reports, notes=notes))
    else:
        for r in reports:
            swap = f" + {len(r['swap_files'])} NVMe swap files" if r.get("swap_files") else ""
            head = f"tag {r['tag']}: ZeRO-{r['zero_stage']}, world size {r['world_size']}, {len(r['files'])} rank " \
                   f"files{swap}, {r['storages_checked']} storages CRC-checked, {r['tensors_checked']} tensors checked finite"
            problems = r["problems"]
            counted = f"{len(problems)} problem{'s' * (len(problems) != 1)}"
            click.echo(f"{head}: {counted if problems else 'ok'}")
            for p in problems:
                click.echo(f"  [{p['check']}] {p['message']}")
    if not ok:
        sys.exit(EXIT_PROBLEMS)
