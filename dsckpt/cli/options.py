"""Options shared by the runtime commands (train, resume): the Lightning strategy's knobs."""
from __future__ import annotations

import click


def training_options(fn):
    opts = [
        click.option("--model", default=None, metavar="PKG.MODULE:FACTORY", help="Model factory (default: built-in tiny causal LM)."),
        click.option("--preset", default=None, help="deepspeed, deepspeed_stage_1, ..._2, ..._2_offload, ..._3, ..._3_offload, ..._3_offload_nvme (default: deepspeed_stage_3 unless --stage or --config is given)."),
        click.option("--stage", type=click.IntRange(0, 3), default=None, help="ZeRO stage (overrides the preset's; default: the preset's)."),
        click.option("--config", "config", default=None, type=click.Path(dir_okay=False), help="DeepSpeed JSON config (else $DSCKPT_DEEPSPEED_CONFIG)."),
        click.option("--precision", type=click.Choice(["32", "bf16", "16"]), default="32", show_default=True),
        click.option("--steps", type=int, default=20, show_default=True),
        click.option("--save-dir", type=click.Path(file_okay=False), default=None, help="Where to save checkpoints (default: nowhere; nothing is saved)."),
        click.option("--save-every", type=int, default=0, help="Save every N steps (0: once at the end)."),
        click.option("--nproc", type=int, default=1, show_default=True, help="Local ranks, started through torch.distributed.run."),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--freeze", is_flag=True, help="Built-in model: freeze its first block."),
        click.option("--offload-optimizer/--no-offload-optimizer", default=None, help="ZeRO-Offload of optimizer state (default: the preset's)."),
        click.option("--offload-parameters/--no-offload-parameters", default=None, help="ZeRO-3 parameter offload (default: the preset's)."),
        click.option("--gradient-accumulation-steps", type=int, default=None),
        click.option("--gradient-clip-val", type=float, default=None, help="Clip by global norm (DeepSpeed's only mode)."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON document (logs go to stderr)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


