"""`dsckpt consolidate`: gather a ZeRO checkpoint into one file or a sharded folder."""
from __future__ import annotations

import sys

import click

from .app import cli, result_document
from .options import LazyHelp, Registered, Precision, ByteBar, parallel_group, write_options, writing_options, tags_of


def _formats():
    """(every registered output format by name, the names --format offers): read on first use."""
    from ..export.registry import output_formats, selectable

    return output_formats(), selectable()


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--tag", default=None, shell_complete=tags_of("checkpoint"),
              help="Tag to consolidate (default: what `latest` names).")
@click.option("--dtype", type=Precision(), default=None,
              help="Cast floating-point tensors (default: fp32 masters, buffers as stored; 32/bfloat16/16... work too).")
@click.option("--exclude-frozen", is_flag=True, help="Leave frozen parameters out.")
@click.option("--duplicate-tied", is_flag=True, help="safetensors: write a copy of a tied weight under each of its names.")
@click.option("--strip-prefix", multiple=True, metavar="PREFIX", help="Remove a name prefix (repeatable).")
@click.option("--rename", multiple=True, metavar="PATTERN=REPLACEMENT",
              help="Rename tensors: a regular expression matching a whole name, and what it becomes (\\1 for its "
                   "groups); repeatable, the first match wins; @FILE.json: a {pattern: replacement} object.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Shard size when OUT is a folder.")
@click.option("--no-client-state", is_flag=True, help="Do not write the client-state sidecar.")
@click.option("--format", "form", type=Registered(lambda: _formats()[1]), default=None, cls=LazyHelp,
              help_text=lambda: "Output format (default: by OUT's suffix, any case; .ckpt is lightning; no known suffix: "
              "a folder). A suffix that says another format is refused. "
              + "; ".join(f"{name}: {_formats()[0][name].summary}" for name in _formats()[1]) + ".")
@click.option("--hf", is_flag=True, help="OUT is a folder AutoModel*.from_pretrained loads: sharded safetensors + "
              "config.json (dtype set to the weights'), generation config and tokenizer files found beside CHECKPOINT.")
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="With --hf: the model's config.json, when CHECKPOINT has none beside it.")
@click.option("--base", "base", type=click.Path(exists=False), default=None,
              help="With --hf, for a PEFT (LoRA) run: the base model's folder (save_pretrained's) or weights file; "
              "OUT is the base with the adapter merged in, as PEFT's merge_and_unload makes it.")
@click.option("--force", is_flag=True, help="Replace an existing OUT; into an existing folder only the files dsckpt "
              "writes are replaced, everything else there stays.")
@click.option("--verify", is_flag=True, help="CRC-check the sources, then re-read OUT and compare it with the shards.")
@writing_options("OUT")
def consolidate(checkpoint: str, out: str, tag, dtype, exclude_frozen, duplicate_tied, strip_prefix, rename,
                max_shard_size, no_client_state, form, hf, config, base, force, trust_checkpoint, verify, skip_crc_check,
                no_fsync, nproc, quiet, as_json) -> None:
    """Gather a ZeRO 0-3 checkpoint's shards into one file (or a sharded folder).

    \b
    OUT decides the format:
      model.safetensors           safetensors (tied weights once, aliases in __metadata__)
      model.pt | .pth | .bin      torch state dict (loads with weights_only=True)
      model_dir/  Qwen2.5-0.5B    sharded safetensors + model.safetensors.index.json (no known suffix: a folder)
      model_dir/ --hf             the same + config.json, generation config, tokenizer: from_pretrained loads it
      model.ckpt                  Lightning checkpoint: the client state + state_dict (--format lightning)
    \b
    Examples:
      dsckpt consolidate runs/demo model.safetensors
      dsckpt consolidate runs/demo model.pt --tag step30 --dtype bf16
      dsckpt consolidate runs/demo hf_model/ --max-shard-size 2GB --strip-prefix module.
      dsckpt consolidate out/checkpoint-500 llama_hf --hf                  (an HF Trainer checkpoint)
      dsckpt consolidate "epoch=0-step=100.ckpt" model.ckpt --format lightning  (Lightning's DeepSpeed folder)
      dsckpt consolidate runs/gpt2 gpt2_hf --hf --config gpt2/config.json --strip-prefix lm.
      dsckpt consolidate out/checkpoint-500 merged_hf --hf --base Llama-3.2-1B   (a LoRA run, merged)
      dsckpt consolidate runs/pipe model.safetensors --rename '(\\d+)\\.(.*)=layers.\\1.\\2'
                  (a PipelineModule run's layer names; repeat --rename for more rules)
      torchrun --nnodes 4 --nproc-per-node 2 ... -m dsckpt consolidate /local/ckpt /data/model.safetensors
                  (each host reads its own rank files; OUT is written on rank 0's host)
      dsckpt consolidate s3://bucket/runs/demo s3://bucket/model.safetensors   (gs://, az://: docs/cli.md)
    The client state goes to OUT.client_state.json (+ .safetensors for its tensors).
    """
    if hf and form:
        raise click.UsageError("--hf is a format of its own; give --hf or --format, not both")
    if config and not hf:
        raise click.UsageError("--config is the model config of a Hugging Face export; it needs --hf")
    if base and not hf:
        raise click.UsageError("--base merges a PEFT run into its base model, a Hugging Face export; it needs --hf")
    if base and config:
        raise click.UsageError("--base brings the base model's config.json; give --base or --config, not both")
    group = parallel_group(nproc, needs=("tqdm", "dsckpt.api.consolidation"))
    from ..api.consolidation import consolidate as run

    bar_off = quiet or as_json or not sys.stderr.isatty() or (group is not None and group.rank != 0)
    with ByteBar("consolidate", bar_off) as bar:
        result = run(checkpoint, out, tag=tag, dtype=dtype, exclude_frozen=exclude_frozen,
                     duplicate_tied=duplicate_tied, strip_prefixes=tuple(strip_prefix), rename=_rules(rename),
                     max_shard_size=max_shard_size, client_state=not no_client_state, verify=verify,
                     form="hf" if hf else form, config=config, base=base,
                     options=write_options(force, no_fsync, trust_checkpoint, skip_crc_check, group, bar))
    if group is not None and group.rank != 0:
        return
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(result_document(result, input=checkpoint))
    else:
        click.echo(f"wrote {result.out} ({result.format}, {result.tensors} tensors, {result.bytes:,} bytes)"
                   + (f"; client state: {result.client_state}" if result.client_state else "")
                   + ("; verified: identical to the shards" if result.verified else ""))


def _rules(values: tuple[str, ...]) -> list:
    """--rename values: PATTERN=REPLACEMENT, or @FILE.json holding a {pattern: replacement} object."""
    rules: list = []
    for value in values:
        if value.startswith("@"):
            from pathlib import Path

            from ..formats.json_file import read_json_object

            rules += list(read_json_object(Path(value[1:]), "--rename file").items())
        else:
            rules.append(value)
    return rules
