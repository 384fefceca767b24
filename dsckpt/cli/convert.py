"""`dsckpt convert`: a ZeRO run's training state for another system - torch DCP (FSDP2) or DeepSpeed universal."""
from __future__ import annotations

import sys

import click

from .app import cli, result_document
from .options import NPROC_HELP, SKIP_CRC_HELP, TRUST_HELP, LazyHelp, Registered, parallel_group


def _targets():
    """Every registered convert target by name: read on first use."""
    from ..export.targets import targets

    return targets()


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.argument("out_dir", type=click.Path())
@click.option("--to", "to", type=Registered(lambda: list(_targets())), required=True, cls=LazyHelp,
              help_text=lambda: "; ".join(f"{name}: {t.summary}" for name, t in _targets().items()) + ".")
@click.option("--weights-only", is_flag=True, help="dcp: the model state only, no optimizer state.")
@click.option("--tag", default=None, help="Tag to convert (default: what `latest` names).")
@click.option("--force", is_flag=True, help="Write into an existing OUT_DIR: what convert writes is replaced, "
              "everything else there stays.")
@click.option("--trust-checkpoint", is_flag=True, help=TRUST_HELP)
@click.option("--skip-crc-check", is_flag=True, help=SKIP_CRC_HELP)
@click.option("--no-fsync", is_flag=True, help="Skip flushing OUT_DIR to disk before the rename (scratch work).")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True, help=NPROC_HELP)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def convert(checkpoint: str, out_dir: str, to: str, weights_only: bool, tag, force, trust_checkpoint, skip_crc_check,
            no_fsync, nproc, quiet, as_json) -> None:
    """Write a ZeRO-1/2/3 run's weights and optimizer state as DCP (FSDP2) or a universal checkpoint.

    \b
    --to dcp: the layout get_state_dict(model, optimizer) gives for the same model and its torch
      optimizer - {"model": {fqn: tensor}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}
      (SGD: "momentum_buffer", Adagrad: "sum"...), "param_groups": [...]}}; an FSDP2 job at any world
      size loads it with dcp.load({"model": msd, "optim": osd}, checkpoint_id=OUT_DIR) + set_state_dict.
      fp32 masters, frozen parameters, buffers, tied names, each group's settings; AutoTP runs joined.
      Needs torch.
    --to universal: what DeepSpeed's ds_to_universal writes, tensor for tensor (OUT_DIR/latest_universal
      + OUT_DIR/<tag>/zero/...); engine.load_checkpoint(OUT_DIR) with {"checkpoint": {"load_universal":
      true}} loads it at any world size.  Needs neither torch nor DeepSpeed.
    One tensor in memory at a time; OUT_DIR appears only when complete; no pickle code runs.

    \b
    Examples:
      dsckpt convert runs/demo runs/demo_dcp --to dcp
      dsckpt convert runs/demo runs/demo_weights_dcp --to dcp --weights-only
      dsckpt convert runs/demo runs/demo_universal --to universal --json
    """
    group = parallel_group(nproc, needs=("tqdm", "dsckpt.api.conversion"))
    from tqdm import tqdm  # (after: a launcher that starts fresh interpreters needs none of it)

    from ..api.conversion import convert as run

    bar_off = quiet or as_json or not sys.stderr.isatty() or (group is not None and group.rank != 0)
    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=f"convert to {to}", disable=bar_off, delay=0.5,
              file=sys.stderr, leave=False) as bar:
        def announce(total: int) -> None:
            bar.total = total

        result = run(checkpoint, out_dir, to, tag=tag, weights_only=weights_only, force=force, fsync=not no_fsync,
                     trust=trust_checkpoint, check_crc=not skip_crc_check, group=group, progress=bar.update, progress_total=announce)
    if group is not None and group.rank != 0:
        return
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(result_document(result, input=checkpoint))
    else:
        click.echo(f"wrote {result.out} ({result.to}, from ZeRO-{result.zero_stage} tag {result.tag}, "
                   f"{result.tensors} tensors, {result.bytes:,} bytes)")
