"""`dsckpt verify`: is a checkpoint whole, undamaged, finite and resumable (before the originals are deleted)?"""
from __future__ import annotations

import sys

import click

from .app import EXIT_PROBLEMS, cli, json_document
from .options import ByteBar, shown


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--tag", default=None, help="Tag to verify (default: what `latest` names).")
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
    from ..parallel.readable import readable

    if tag and all_tags:
        raise click.UsageError("--tag names one tag, --all-tags every one: give one of them")
    with ByteBar("verify", as_json or not sys.stderr.isatty()) as bar:
        with readable(checkpoint, tag, whole=True, every_tag=all_tags, check=False,
                      progress=bar) as (local, local_tag, *_):
            _verify(local, local_tag, all_tags, as_json, shown({local: checkpoint}), bar)


def _verify(checkpoint: str, tag: str | None, all_tags: bool, as_json: bool, echo, progress) -> None:
    from ..analysis.verify import verify as run

    reports = run(checkpoint, tag, all_tags, progress)
    ok = not any(r.problems for r in reports)
    notes = list(dict.fromkeys(n for r in reports for n in r.notes))
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        echo(json_document(input=str(checkpoint), ok=ok, tags=[vars(r) for r in reports], notes=notes))
    else:
        for r in reports:
            head = f"tag {r.tag}: ZeRO-{r.zero_stage}, world size {r.world_size}, {len(r.files)} rank files, " \
                   f"{r.storages_checked} storages CRC-checked, {r.tensors_checked} tensors checked finite"
            echo(f"{head}: {'ok' if not r.problems else f'{len(r.problems)} problems'}")
            for p in r.problems:
                echo(f"  [{p['check']}] {p['message']}")
    if not ok:
        sys.exit(EXIT_PROBLEMS)
