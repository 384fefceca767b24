"""`dsckpt convert`: a ZeRO run's training state for another system - torch DCP (FSDP2) or DeepSpeed universal."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import ConfigError
from .app import cli, report_result
from .options import LazyHelp, Registered, ByteBar, parallel_group, write_options, writing_options, tags_of


INTO_DEEPSPEED = "deepspeed"  # the other direction: a DCP folder in, a ZeRO checkpoint out (api.ingest)


def _targets():
    """Every registered convert target by name: read on first use."""
    from ..export.targets import targets

    return targets()


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.argument("out_dir", type=click.Path())
@click.option("--to", "to", type=Registered(lambda: [*_targets(), INTO_DEEPSPEED]), required=True, cls=LazyHelp,
              help_text=lambda: "; ".join(f"{name}: {t.summary}" for name, t in _targets().items())
              + f"; {INTO_DEEPSPEED}: a DCP folder (FSDP2, torchtitan) as a ZeRO checkpoint.")
@click.option("--world-size", "-w", type=click.IntRange(min=1), default=None,
              help="deepspeed: the ranks the DeepSpeed job will run on.")
@click.option("--stage", type=click.Choice(["1", "2", "3"]), default=None, help="deepspeed: the ZeRO stage.")
@click.option("--dtype", default="fp32", show_default=True,
              help="deepspeed: the engine's module dtype (fp32, bf16 or fp16; masters and moments stay fp32).")
@click.option("--model", "model_spec", default=None, metavar="MODULE:FACTORY",
              help="deepspeed: the model, built on the meta device for the names DCP cannot tell apart (frozen "
                   "parameters, buffers, tied names).")
@click.option("--group-settings", default=None, metavar="JSON",
              help="deepspeed, weights source (safetensors, .pt, an HF folder): the optimizer's settings, at least "
                   "the learning rate of the first step ('{\"lr\": 3e-4}'; under a warmup schedule '{\"lr\": 0.0, "
                   "\"initial_lr\": 3e-4}'; AdamW's and the HF Trainer's defaults for the rest).")
@click.option("--groups", "group_mode", type=click.Choice(["one", "hf-trainer"]), default="hf-trainer",
              show_default=True, help="deepspeed, weights source: one param group, or the HF Trainer's two (no weight "
              "decay on biases and norms), then OUT_DIR is also a checkpoint-N the Trainer resumes from.")
@click.option("--trainer-state", "trainer_state", default=None, metavar="JSON",
              help="deepspeed, --groups hf-trainer: trainer_state.json's fields, which a resumed Trainer runs with "
                   "('{\"logging_steps\": 10, \"save_steps\": 500, \"train_batch_size\": 4}'; default: "
                   "TrainingArguments' defaults).")
@click.option("--group-order", default=None, metavar="NAME,NAME,...",
              help="deepspeed, torchtitan layout with several settings: one parameter of each param group, in the "
                   "order the DeepSpeed job's optimizer takes the groups (default: model order, said in a note).")
@click.option("--weights-only", is_flag=True, help="dcp: the model state only, no optimizer state.")
@click.option("--tag", default=None, shell_complete=tags_of("checkpoint"),
              help="Tag to convert (default: what `latest` names).")
@click.option("--force", is_flag=True, help="Write into an existing OUT_DIR: what convert writes is replaced, "
              "everything else there stays.")
@writing_options("OUT_DIR")
def convert(checkpoint: str, out_dir: str, to: str, world_size, stage, dtype, model_spec, group_settings, group_mode,
            trainer_state, group_order, weights_only: bool, tag, force, trust_checkpoint, skip_crc_check, no_fsync, nproc, quiet, as_json) -> None:
    """Write a ZeRO-1/2/3 run's weights and optimizer state as DCP (FSDP2) or a universal checkpoint - or,
    with --to deepspeed, an FSDP2 / torchtitan DCP folder as a ZeRO checkpoint.

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
      dsckpt convert fsdp2_ckpt/step-300 ds_ckpt --to deepspeed -w 8 --stage 3 --model mymodel:build

    \b
    --to deepspeed: CHECKPOINT is a DCP folder - FSDP2's dcp.save({"model": msd, "optim": osd}) with
      get_state_dict, or torchtitan's (model keys at the top level, the optimizer flattened) - and
      OUT_DIR a DeepSpeed checkpoint (tag folder + latest) that stock engine.load_checkpoint(OUT_DIR)
      restores at --world-size ranks and --stage: every fp32 master, Adam moment, step and group
      setting as saved.  The job's optimizer lists the same param groups (FSDP2: as saved; torchtitan:
      in model order, or --group-order).  --tag names the tag written (default global_step<step>).  No
      scheduler state is written (load_lr_scheduler_states=False when the engine has one).  Needs torch
      for --model.
    """
    if to == INTO_DEEPSPEED:
        return _into_deepspeed(checkpoint, out_dir, world_size, stage, dtype, model_spec, group_settings, group_mode,
                               trainer_state, group_order, weights_only, tag, force, no_fsync, nproc, quiet, as_json)
    if world_size is not None or stage is not None or model_spec or group_order or group_settings:
        raise ConfigError(f"--world-size, --stage, --model, --group-settings and --group-order are for "
                          f"--to {INTO_DEEPSPEED}")
    group = parallel_group(nproc, needs=("tqdm", "dsckpt.api.conversion"))
    from ..api.conversion import convert as run

    bar_off = quiet or as_json or not sys.stderr.isatty() or (group is not None and group.rank != 0)
    with ByteBar(f"convert to {to}", bar_off) as bar:
        result = run(checkpoint, out_dir, to, tag=tag, weights_only=weights_only,
                     options=write_options(force, no_fsync, trust_checkpoint, skip_crc_check, group, bar))
    report_result(result, checkpoint, as_json, lambda r: f"wrote {r.out} ({r.to}, from ZeRO-{r.zero_stage} tag {r.tag}, "
                  f"{r.tensors} tensors, {r.bytes:,} bytes)", group)


def _into_deepspeed(source: str, out_dir: str, world_size, stage, dtype, model_spec, group_settings, group_mode,
                    trainer_state, group_order, weights_only, tag, force, no_fsync, nproc, quiet, as_json) -> None:
    if world_size is None or stage is None:
        raise ConfigError(f"--to {INTO_DEEPSPEED} needs --world-size and --stage (the DeepSpeed job's)")
    if weights_only:
        raise ConfigError(f"--to {INTO_DEEPSPEED} writes the whole training state (--weights-only is for the other "
                          "targets)")
    group = parallel_group(nproc, needs=("tqdm", "dsckpt.api.ingest"))
    from ..api.ingest import into_deepspeed

    model, param_groups = None, None
    hf_folder = Path(source, "config.json").is_file()
    if model_spec or hf_folder or group_settings:
        from ..runtime.model_names import meta_model, names_of, weight_groups

        module = meta_model(model_spec or source) if (model_spec or hf_folder) else None
        model = names_of(module) if module is not None else None
        if group_settings is not None:
            if module is None:
                raise ConfigError("--group-settings needs the model: --model MODULE:FACTORY (an HF folder's "
                                  "config.json is read by itself)", at=source)
            param_groups = weight_groups(module, _json_object(group_settings, "--group-settings"), group_mode)
    order = tuple(n.strip() for n in group_order.split(",") if n.strip()) if group_order else None
    bar_off = quiet or as_json or not sys.stderr.isatty() or (group is not None and group.rank != 0)
    with ByteBar(f"convert to {INTO_DEEPSPEED}", bar_off) as bar:
        result = into_deepspeed(source, out_dir, world_size, stage=int(stage), dtype=dtype, model=model,
                                group_order=order, param_groups=param_groups,
                                trainer_files=param_groups is not None and group_mode == "hf-trainer",
                                trainer_state=_json_object(trainer_state, "--trainer-state") if trainer_state else None,
                                tag=tag, options=write_options(force, no_fsync, False, False, group, bar))
    what = {"fsdp2": "FSDP2's DCP", "torchtitan": "torchtitan's DCP", "universal": "a universal checkpoint",
            "weights": "weights"}.get(result.source_layout, result.source_layout)
    report_result(result, source, as_json, lambda r: f"wrote {r.out} (DeepSpeed ZeRO-{r.zero_stage} at {r.world_size} "
                  f"rank{'s' * (r.world_size != 1)}, tag {r.tag}, from {what} at step {r.step}, {r.tensors} tensors, "
                  f"{r.bytes:,} bytes)", group)


def _json_object(text: str, option: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{option} {text!r}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{option} {text!r}: expected a JSON object, e.g. '{{\"lr\": 3e-4}}'")
    return value
