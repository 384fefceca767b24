"""`dsckpt reshard`: a ZeRO checkpoint rewritten for another data-parallel world size, optimizer state kept."""
from __future__ import annotations

import sys

import click

from .app import cli, report_result
from .options import ByteBar, parallel_group, write_options, writing_options, tags_of


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.argument("out_dir", type=click.Path())
@click.option("--world-size", "-w", "world_size", type=click.IntRange(min=1), required=True,
              help="Data-parallel ranks the resumed job will run on (a tensor- or pipeline-parallel run's processes: "
                   "tp x pp x this).")
@click.option("--stage", type=click.IntRange(1, 3), default=None,
              help="ZeRO stage of OUT_DIR (default: the checkpoint's); any of 1, 2, 3 from any of them.")
@click.option("--ep-size", type=click.IntRange(min=1), default=None,
              help="A mixture-of-experts run's expert-parallel size in OUT_DIR (default: its own); experts move ranks.")
@click.option("--tag", default=None, shell_complete=tags_of("checkpoint"),
              help="Tag to reshard (default: what `latest` names); OUT_DIR keeps its name.")
@click.option("--force", is_flag=True, help="Write into an existing OUT_DIR: its `latest` and this tag's folder are "
              "replaced, everything else there stays.")
@click.option("--offload", type=click.Choice(["cpu", "nvme"]), default="cpu", show_default=True,
              help="Where the engine that loads OUT_DIR keeps its optimizer. cpu (also an engine without offload): "
                   "every partition in the rank files, which dsckpt's load also puts into an NVMe engine. nvme: the "
                   "sub-groups DeepSpeed swaps as offloaded_tensors/rankNN/ swap files, for DeepSpeed's own NVMe "
                   "load (named as the checkpoint's own swap files: a sub-group cut anew is refused).")
@click.option("--gather", is_flag=True, help="Under torchrun on several hosts: write every target rank's files on rank "
              "0's host (default: each target rank's files on the host that will run it).")
@writing_options("OUT_DIR")
def reshard(checkpoint: str, out_dir: str, world_size: int, stage, ep_size, tag, force, trust_checkpoint, skip_crc_check,
            no_fsync, nproc, offload, gather, quiet, as_json) -> None:
    """Rewrite a ZeRO-1/2/3 checkpoint for --world-size data-parallel ranks (and --stage).

    OUT_DIR is a native DeepSpeed checkpoint (`latest` + one tag): a plain
    `engine.load_checkpoint(OUT_DIR)` at the new world size restores weights, fp32 masters, Adam
    moments and steps, loss scaler, LR scheduler and client state.  Only the partitions move;
    every other entry is copied as it was (ranks beyond the old world size take the last old
    rank's client state).  No pickle code runs, and none is carried: a client-state entry holding
    objects of classes beyond DeepSpeed's own is left out with a note (--trust-checkpoint keeps it).
    OUT_DIR appears only when complete.

    \b
    Examples:
      dsckpt reshard runs/demo runs/demo_ws4 --world-size 4
      dsckpt reshard s3://bucket/runs/demo s3://bucket/runs/demo_ws8 -w 8 --nproc 4
      dsckpt reshard runs/demo runs/demo_ws1 -w 1 --tag step30 --json
      dsckpt reshard out/checkpoint-500 resharded/checkpoint-500-z3 -w 8 --stage 3   (ZeRO-2 -> ZeRO-3)
      dsckpt reshard runs/moe runs/moe_ws8 -w 8 --ep-size 4     (DeepSpeed-MoE: experts over 4 ranks)
      dsckpt resume runs/demo --nproc 3 --reshard --steps 5     (the same, then training on)
      dsckpt reshard runs/demo runs/demo_ws8 -w 8 --nproc 4     (4 processes share the work)
      dsckpt reshard runs/inf runs/inf_ws4 -w 4 --offload nvme  (ZeRO-Infinity: swap files for DeepSpeed's own load)
      torchrun --nnodes 2 --nproc-per-node 4 ... -m dsckpt reshard /local/ckpt /local/ws16 -w 16
                                       (every host: its own rank files in, its target ranks' files out)
    """
    group = parallel_group(nproc, needs=("tqdm", "dsckpt.api.resharding"))
    from ..api.resharding import reshard as run
    from ..plan.offload import TargetOffload

    if group is None and gather:
        raise click.UsageError("--gather places files across hosts: it needs --nproc or torchrun")
    bar_off = quiet or as_json or not sys.stderr.isatty() or (group is not None and group.rank != 0)
    with ByteBar("reshard", bar_off) as bar:
        result = run(checkpoint, out_dir, world_size, tag=tag, stage=stage, ep_size=ep_size, gather=gather,
                     offload=TargetOffload(offload),
                     options=write_options(force, no_fsync, trust_checkpoint, skip_crc_check, group, bar))
    def line(r) -> str:
        moved = f"ZeRO-{r.source_zero_stage} -> ZeRO-{r.zero_stage}" \
            if r.source_zero_stage != r.zero_stage else f"ZeRO-{r.zero_stage}"
        ranks = f"; the job runs on {r.processes} processes" if r.processes != r.world_size else ""
        return (f"wrote {r.out} ({moved}, tag {r.tag}, data-parallel world size {r.source_world_size} -> "
                f"{r.world_size}{ranks}, {len(r.files)} files, {r.bytes:,} bytes)")
    report_result(result, checkpoint, as_json, line, group)
