"""Into DeepSpeed (`dsckpt.into_deepspeed`): write another system's training state as a
DeepSpeed ZeRO checkpoint that stock ``engine.load_checkpoint(out)`` restores at ``world_size`` ranks - the
fp32 masters, Adam's moments and step, each param group's settings - so the job carries on under DeepSpeed.

Sources: a torch.distributed.checkpoint folder written by FSDP2 (``dcp.save({"model": msd, "optim": osd})``
with ``get_state_dict``) or by torchtitan (``formats.dcp`` reads it, ``plan.from_dcp`` makes the training
state).  The files are ``plan.into_deepspeed``'s trees, written as reshard writes its rank files (each storage
streamed from the source's byte ranges, ``io.torch_writer``), re-read with dsckpt's reader, then published
(``io.output``: a temp folder beside OUT, renamed when complete).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..dtypes import BY_LABEL, DTYPES
from ..errors import CheckpointNotFoundError, ConfigError, UnsupportedCheckpointError
from ..formats.dcp import METADATA_FILE, read_contents, read_index
from ..formats.pickle_writer import dumps
from ..io.context import WriteContext
from ..io.read import Reader
from ..io.torch_writer import write_pickled
from ..io.output import check_output, write_errors
from ..parallel.group import ONE_PROCESS
from ..parallel.outputs import GroupStaging, storage_groups
from ..parallel.readable import local_copy
from ..plan.from_dcp import DcpState, ModelNames, build_dcp_state
from ..plan.consolidate import TensorPlan
from ..plan.from_universal import build_universal_state
from ..plan.from_weights import build_weights_state
from ..plan.segments import Segment
from ..plan.moves import ReshardPlan
from ..plan.training_state import ParamGroup, TrainingState
from ..plan.into_deepspeed import DeepSpeedLayout, build_deepspeed_plan, check_layout
from ..zero import layout as L
from ..zero.reader import open_checkpoint
from ..progress import Phase, advancing, begin
from .options import DEFAULTS, WriteOptions
from .frame import destination
from .paths import classify, weights_in
from .resharding import Pickled, carry_only_allowed, check_written, write_files

UNIVERSAL, WEIGHTS = "universal", "weights"  # source layouts beside plan.from_dcp's
TRAINER_STATE, TRAINER_SCHEDULER = "trainer_state.json", "scheduler.pt"  # the HF Trainer's files in a checkpoint-N
# TrainerState at step 0 with the intervals a default TrainingArguments records (a resumed Trainer runs with them)
TRAINER_STATE_AT_START = {"global_step": 0, "epoch": 0.0, "log_history": [], "logging_steps": 500,
                          "eval_steps": 500, "save_steps": 500, "train_batch_size": 8,
                          "stateful_callbacks": {"TrainerControl": {"args": {
                              "should_training_stop": False, "should_epoch_stop": False, "should_save": False,
                              "should_evaluate": False, "should_log": False}, "attributes": {}}}}


@dataclass(frozen=True)
class IntoDeepSpeedResult:
    """What ``into_deepspeed`` wrote; the names of ``dsckpt convert --to deepspeed --json``."""
    out: Path
    source_layout: str  # "fsdp2" | "torchtitan" | "universal"
    tag: str
    zero_stage: int
    world_size: int
    dtype: str
    step: int
    tensors: int
    bytes: int
    files: tuple[str, ...]
    notes: tuple[str, ...] = ()


def into_deepspeed(source: str | os.PathLike[str], out: str | os.PathLike[str], world_size: int, *, stage: int = 3,
                   dtype: str = "fp32", model: ModelNames | None = None,
                   group_order: tuple[str, ...] | None = None, param_groups: tuple[ParamGroup, ...] | None = None,
                   trainer_files: bool = False, trainer_state: dict[str, Any] | None = None,
                   tag: str | None = None, options: WriteOptions = DEFAULTS) -> IntoDeepSpeedResult:
    """Write the DCP folder ``source`` as a DeepSpeed checkpoint for ``world_size`` ranks at ZeRO ``stage``
    (1, 2 or 3), its module in ``dtype`` ("fp32", "bf16" or "fp16"; masters and moments stay fp32).

    ``model``: the names only the model knows (frozen parameters, buffers, tied names: ``ModelNames``), needed
    when the folder holds floating-point entries no optimizer does.  ``tag``: the tag folder's name (default
    ``global_step<step>``).  ``group_order``: torchtitan's layout only, when its parameters have several
    settings: one parameter of each group, in the order the DeepSpeed job's optimizer takes the groups.
    ``param_groups``: a weights source (safetensors, ``.pt``, a Hugging Face folder) only - the optimizer's
    groups, settings and members (the optimizer state starts fresh: moments zero, step 0); with ``trainer_files``
    OUT is also what the HF Trainer's ``resume_from_checkpoint`` reads: ``trainer_state.json`` at step 0 and
    ``scheduler.pt``, the state of its ``LambdaLR`` schedules at their start; ``trainer_state``: fields of that
    ``trainer_state.json`` (the Trainer resumes with the intervals it records: ``logging_steps``, ``eval_steps``,
    ``save_steps``, ``train_batch_size``; default ``TrainingArguments``' defaults).
    ``options`` (``WriteOptions``): ``force`` writes into an existing OUT (``latest`` and the tag replaced);
    ``group``: the processes of a torchrun run sharing the rank files (None: one process), OUT on storage they all
    see; ``progress``: the ``WRITE`` of the tensor bytes; ``trust``/``check_crc`` concern DeepSpeed inputs (the
    sources read here hold no pickled classes or CRCs: their own checks run).
    """
    group, force = options.group or ONE_PROCESS, options.force
    module_dtype = BY_LABEL.get(str(dtype))
    if module_dtype is None:
        raise ConfigError(f"--dtype {dtype!r}: expected fp32, bf16 or fp16")
    check_layout(world_size, stage, module_dtype)
    with destination(group, out, force) as dest, \
            local_copy(source, group, options.progress) as folder:
        out = dest.path
        found, plan, pickled, inputs, root = group.step(lambda: _prepare(
            folder, world_size, stage, module_dtype, model, group_order, param_groups, trainer_files, tag))
        total = sum(s.nbytes for _, storages in pickled.values() for s in storages)
        group.step(lambda: check_output(out, inputs, force, directory=True, tree=root) if group.rank == 0 else None)
        begin(options.progress, Phase.WRITE, total)
        groups = storage_groups(group, out)
        if len(groups.leaders) > 1:
            raise UnsupportedCheckpointError(f"the processes see {len(groups.leaders)} different filesystems "
                                             "there; convert --to deepspeed writes on storage every process shares", at=out)
        staged = GroupStaging(group, groups, out, directory=True, fsync=options.fsync, publishing={groups.of[0]})
        biggest_first = sorted(plan.files, key=lambda f: -sum(s.nbytes for s in pickled[f.name][1]))
        mine = [f for i, f in enumerate(biggest_first) if i % group.size == group.rank]
        try:
            with write_errors(out):
                staged.create()
                with WriteContext(streams=dest.streams, durable=staged.durable,
                                  progress=advancing(options.progress)) as context:
                    group.step(lambda: write_files(plan, staged.tmp, mine, [], pickled, context))
                    group.step(lambda: _finish(staged.tmp, plan, trainer_state, context) if staged.leads else None)
                staged.publish()
        except BaseException:
            staged.abort()
            raise
        names = [f"{plan.tag}/{f.name}" for f in plan.files] + [L.LATEST_FILE]
        scheduler = plan.files[0].tree.get("lr_scheduler")
        names += [TRAINER_STATE, TRAINER_SCHEDULER] if scheduler is not None else []
        tensors = sum(len(storages) for _, storages in pickled.values())
        if module_dtype == "F16" and stage == 3:
            found = replace(found, notes=found.notes + ("the fp16 loss scaler starts at DeepSpeed's defaults (2**16, "
                                                        "window 1000, hysteresis 2): a ZeRO-3 load replaces the "
                                                        "engine's own",))
        notes = found.notes + (() if scheduler else (
            "no learning-rate scheduler state is written: load with load_lr_scheduler_states=False when the engine "
            "has a scheduler",))
        result = IntoDeepSpeedResult(out, found.layout, plan.tag, stage, world_size, DTYPES[module_dtype].label,
                                     found.step, tensors, total, tuple(str(out / n) for n in names), notes)
    return dest.named(result)


def _prepare(folder: Path, world_size: int, stage: int, module_dtype: str, model: ModelNames | None,
             group_order: tuple[str, ...] | None, param_groups: tuple[ParamGroup, ...] | None, trainer_files: bool,
             tag: str | None) -> tuple[DcpState, ReshardPlan, dict[str, Pickled], list[Path], Path]:
    """Everything decided before a byte is written, the same on every process: the source's state, the plan and
    its pickles, the files read and the source's root."""
    found, inputs, root = _source_state(folder, model, group_order, param_groups)
    if trainer_files and found.layout != WEIGHTS:
        raise ConfigError("trainer files (trainer_state.json, the scheduler at step 0) are written for a weights "
                          "source only; an HF Trainer run's own checkpoint-N already has its files")
    scheduler = _lambda_lr_at_start(found.state) if trainer_files else None
    target = DeepSpeedLayout(world_size, stage, module_dtype, tag or f"global_step{found.step}", found.step, scheduler,
                             found.client_state)
    if not target.tag or Path(target.tag).name != target.tag or target.tag.startswith("."):
        raise ConfigError(f"--tag {target.tag!r}: not a folder name (no '/', not hidden)")
    plan, dropped = carry_only_allowed(build_deepspeed_plan(found.state, target, root))
    found = replace(found, notes=found.notes + dropped)
    return found, plan, {f.name: dumps(f.tree) for f in plan.files}, inputs, root


def _finish(tmp: Path, plan: ReshardPlan, trainer_state: dict[str, Any] | None, context: WriteContext) -> None:
    """The leader's last word before publishing: ``latest``, the HF Trainer's files, the result re-read."""
    (tmp / L.LATEST_FILE).write_text(plan.tag)
    scheduler = plan.files[0].tree.get("lr_scheduler")
    if scheduler is not None:
        (tmp / TRAINER_STATE).write_text(json.dumps({**TRAINER_STATE_AT_START, **(trainer_state or {})}))
        with Reader(context) as reader:  # the Trainer loads its own scheduler's state (weights_only)
            write_pickled(tmp / TRAINER_SCHEDULER, dumps(scheduler), reader, replace(context, progress=None))
    check_written(tmp, plan)


def _source_state(folder: Path, model: ModelNames | None, group_order: tuple[str, ...] | None,
                  param_groups: tuple[ParamGroup, ...] | None) -> tuple[DcpState, list[Path], Path]:
    """The source's training state, the files it reads, and its root folder: a DCP folder, a universal one, or
    weights (a file or a Hugging Face folder)."""
    if (folder / METADATA_FILE).is_file():
        index = read_index(folder)
        inputs = [folder / METADATA_FILE, *sorted({c.file for t in index.tensors.values() for c in t.chunks})]
        return _recorded_step(build_dcp_state(index, read_contents(index), model, group_order), folder), inputs, folder
    weights = weights_in(folder) if folder.exists() else None
    if weights is not None:
        return _weights_state(weights, model, param_groups, folder)
    if param_groups is not None:
        raise ConfigError("param groups are given for a weights source only; a checkpoint records its own")
    try:
        ckpt = open_checkpoint(folder)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"neither a torch.distributed.checkpoint folder (no {METADATA_FILE}) "
                                      "nor a DeepSpeed universal checkpoint", at=folder) from None
    if not ckpt.universal:
        raise UnsupportedCheckpointError("already a DeepSpeed ZeRO checkpoint",
                                         hint="dsckpt reshard writes it for another world size or ZeRO stage", at=ckpt.layout.tag_dir)
    if group_order is not None:
        raise ConfigError("--group-order is for torchtitan's layout; a universal checkpoint records its groups")
    ckpt.require_complete()
    state, step = build_universal_state(ckpt)
    return DcpState(UNIVERSAL, state, step, (), ckpt.client_state), [f.path for f in ckpt.layout.all_files], \
        ckpt.layout.root


def _recorded_step(found: DcpState, folder: Path) -> DcpState:
    """The training step as the run recorded it beside the DCP folder (the client state dsckpt's ``convert --to dcp``
    keeps: ``global_step``), not the optimizer's, which restarts at a full-weights resume."""
    from ..export.sidecar import FOLDER_JSON, recorded_step

    step = recorded_step(folder)
    if step is None or step == found.step:
        return found
    return replace(found, step=step, notes=found.notes + (
        f"training step {step}, as {FOLDER_JSON} records it (the optimizer's own step, {found.step}, is kept in the "
        "optimizer state)",))


def _weights_state(path: Path, model: ModelNames | None, param_groups: tuple[ParamGroup, ...] | None,
                   given: Path) -> tuple[DcpState, list[Path], Path]:
    """``path``: the weights file or sharded folder; ``given``: what the user named (a folder holding it, or it)."""
    if model is None or param_groups is None:
        raise ConfigError("a weights file holds no optimizer: the model's names and the optimizer's param "
                          "groups must be given", hint="dsckpt convert ... --to deepspeed --group-settings "
                          "'{\"lr\": 3e-4}' (and --model MODULE:FACTORY for a file without config.json)", at=path)
    listing = classify(path).reader.read(path)
    tensors = []
    for s in listing.tensors:
        if s.stride is not None:
            raise UnsupportedCheckpointError(f"{s.name!r} is stored as a strided view; not supported", at=s.path)
        pieces = (Segment(s.path, s.offset, s.span_bytes),) if s.span_bytes else ()
        tensors.append(TensorPlan(s.name, s.shape, s.dtype, s.dtype, "param", pieces))
    state = build_weights_state(tensors, model, param_groups, path)
    note = "the optimizer state starts fresh (Adam's moments zero, step 0): a weights file holds none"
    return DcpState(WEIGHTS, state, 0, (note,)), sorted({s.path for s in listing.tensors}), given


def _lambda_lr_at_start(state: TrainingState) -> dict[str, Any]:
    """What a ``torch.optim.lr_scheduler.LambdaLR`` (every schedule the HF Trainer makes by name) saves at its start:
    its base rates are the groups' ``initial_lr`` (else ``lr``); the groups' ``lr`` is what the first step uses."""
    base = [float(g.settings.get("initial_lr", g.settings["lr"])) for g in state.groups]
    return {"base_lrs": base, "last_epoch": 0, "_step_count": 1, "_get_lr_called_within_step": False,
            "_last_lr": [float(g.settings["lr"]) for g in state.groups], "lr_lambdas": [None] * len(base)}
