"""`dsckpt resume`: carry on training from a sharded checkpoint or from one full-weights file.

* ``resume CKPT_DIR``: the engine's ``load_checkpoint`` (weights, optimizer moments, client state),
  same world size; ``--reshard`` at another one rewrites it for this world size first (``dsckpt reshard``,
  optimizer state kept), or - across ZeRO stages - loads its consolidated weights.
* ``resume --full-weights FILE``: ``full_weights.load_full_weights`` at any world size, then the
  client state: ``--client-state PATH``, else the sidecar beside FILE (``FILE.client_state.json``),
  else what a ``.pt`` holds beside its ``state_dict`` (Lightning's converted checkpoints).  Rank 0
  reads it and broadcasts it, so every rank resumes at the same step and saves under the same tag.
* ``--check``: load, then gather every parameter and compare with the file bit-exactly, and compare
  the restored client state with its source; no training.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import WorldSizeMismatchError, VerificationError
from . import console
from . import engine as eng
from .client_state import Position, describe, hf_trainer_state, read_client_state
from .tensor_parallel import tp_model
from .full_weights import broadcast_object, get_fp32_master, load_full_weights
from .moe import ep_rank_of, ep_size_of, global_name, is_moe_model, local_experts
from .train import Trainer, states_equal
from ..api.weights import WeightsFile


def resume_full_weights(trainer: Trainer, weights: str, client_state: str | None, strict: bool,
                        strip_prefixes: tuple[str, ...], skip_client: bool = False) -> Position | None:
    stats = load_full_weights(trainer.engine, weights, strict=strict, strip_prefixes=strip_prefixes)
    if eng.rank() == 0:
        console.note("a full-weights file holds no optimizer moments: Adam state starts fresh")
    found = None if skip_client or eng.rank() != 0 else read_client_state(Path(weights), client_state)
    client, source = broadcast_object(found) or (None, None)
    pos = trainer.restore(client) if client is not None else None
    if pos is not None:
        trainer.client_source = client
    console.info(f"loaded {stats['loaded']} tensors from {console.shown(weights)}; "
                 + (f"client state from {console.shown(source)}: {describe(pos)} (step {trainer.global_step})" if pos else
                    "client state skipped (--client-state none)" if skip_client else
                    "no client state found, counters start at 0"))
    return pos


def resume_sharded(trainer: Trainer, ckpt_dir: str, tag: str | None, reshard: bool, strict: bool,
                   skip_client: bool = False, trust: bool = False) -> Position | None:
    from ..zero.reader import open_checkpoint

    ckpt = open_checkpoint(ckpt_dir, tag=tag)  # read once: metadata for every step below
    if ckpt.world_size != trainer.data_ranks or (reshard and ckpt.zero_stage != trainer.runtime.stage):
        if not reshard:  # the preflight refuses this before ranks start; a direct torchrun run gets here
            raise WorldSizeMismatchError(f"saved at data-parallel world size {ckpt.world_size}, "
                                         f"but this run has {trainer.data_ranks}", hint="add --reshard", at=ckpt.layout.tag_dir)
        return _resume_resharded(trainer, ckpt, ckpt_dir, tag, strict, skip_client, trust)
    return _load_sharded(trainer, ckpt_dir, tag, ckpt, skip_client, trust, shown_as=ckpt_dir)


def _load_sharded(trainer: Trainer, path: str, tag: str | None, ckpt, skip_client: bool, trust: bool,
                  shown_as: str) -> Position | None:
    """DeepSpeed's own load (weights-only unpickling) of a checkpoint at this world size."""
    client = trainer.runtime.load_checkpoint(path, tag=tag, trust=trust, ckpt=ckpt)
    if not skip_client and not any(k in client for k in ("global_step", "epoch")):
        client = {**(hf_trainer_state(Path(shown_as)) or {}), **client}  # an HF Trainer's checkpoint-N
    pos = None if skip_client else trainer.restore(client)
    if pos is not None and pos.global_step is None:  # a foreign job: DeepSpeed's own count
        trainer.global_step = trainer.data_position = trainer.engine.global_steps
    console.info(f"resumed {console.shown(shown_as)} at step {trainer.global_step}"
                 + (f"; client state: {describe(pos)}" if pos else "; client state skipped"))
    return pos


def _resume_resharded(trainer: Trainer, ckpt, ckpt_dir: str, tag: str | None, strict: bool,
                      skip_client: bool, trust: bool) -> Position | None:
    """Another world size (or ZeRO stage).

    ZeRO 1-3 to ZeRO 1-3: DeepSpeed's own load, each file answered from the reshard plan (``planned_load``: no
    copy) - weights, fp32 masters, optimizer moments, scheduler and client state carry over.  Tensor- or pipeline-
    parallel runs, or ``--trust-checkpoint`` (foreign classes kept): ``dsckpt reshard`` into one temp folder beside
    the checkpoint that rank 0 writes, then the same load.  From (or to) ZeRO-0: consolidated weights, the
    optimizer fresh.
    """
    import tempfile

    from ..api.consolidation import consolidate
    from ..api.resharding import reshard
    from ..api.options import WriteOptions
    from ..zero.reader import open_checkpoint

    keep_optimizer = ckpt.zero_stage in (1, 2, 3) and trainer.runtime.stage in (1, 2, 3)  # reshard --stage: any
    moved = f"ZeRO-{ckpt.zero_stage}" + (f" -> ZeRO-{trainer.runtime.stage}"
                                         if trainer.runtime.stage != ckpt.zero_stage else "")
    if keep_optimizer and trainer.runtime.loads_resharded(ckpt, trust):
        console.note(f"resharded {moved} from {ckpt.world_size} to {trainer.data_ranks} ranks: weights, optimizer "
                     "state and client state carried over (read from the original files, no copy written)")
        return _load_sharded(trainer, ckpt_dir, tag, ckpt, skip_client, trust, shown_as=ckpt_dir)
    beside = ckpt.layout.root.resolve().parent  # not inside the checkpoint
    made = tempfile.mkdtemp(prefix=".dsckpt-reshard-", dir=beside) if eng.rank() == 0 else None
    tmp = Path(broadcast_object(made))
    try:
        if eng.rank() == 0:
            scratch = WriteOptions(fsync=False, trust=trust)
            if keep_optimizer:
                reshard(ckpt_dir, tmp / "ckpt", trainer.data_ranks, tag=tag, stage=trainer.runtime.stage,
                        options=scratch)
            else:
                consolidate(ckpt_dir, tmp / "weights.safetensors", tag=tag, options=scratch)
        if eng.world_size() > 1:
            dist.barrier()
        if keep_optimizer:
            console.note(f"resharded {moved} from {ckpt.world_size} to {trainer.data_ranks} ranks"
                         f"{f' (data parallel, x tp {ckpt.grid.tp})' if ckpt.grid.tp > 1 else ''}: weights, optimizer "
                         "state and client state carried over")
            resharded = str(tmp / "ckpt")
            return _load_sharded(trainer, resharded, None, open_checkpoint(resharded), skip_client, trust,
                                 shown_as=ckpt_dir)
        why = "ZeRO-0" if ckpt.zero_stage == 0 else f"ZeRO-{ckpt.zero_stage} checkpoint, ZeRO-{trainer.runtime.stage} run"
        console.note(f"resharding ({why}): weights loaded from a consolidated copy; optimizer moments start fresh")
        return resume_full_weights(trainer, str(tmp / "weights.safetensors"), None, strict, (), skip_client)
    finally:
        if eng.world_size() > 1:
            dist.barrier()
        if eng.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference; both sides on the CPU (a GPU model is compared with a file)."""
    if not want.numel():
        return 0.0
    return (got.detach().to("cpu", torch.float32).reshape(want.shape) - want.float()).abs().max().item()


def check_against_file(trainer: Trainer, weights: str, restored: Position | None,
                       strip_prefixes: tuple[str, ...]) -> dict[str, Any]:
    """Gather every parameter on every rank and compare with the file; compare the client state."""
    import deepspeed
    src = WeightsFile(weights, strip_prefixes)  # every rank reads, lazily: this is a check, not a load
    module = trainer.engine.module
    tp = tp_model(trainer.engine)
    per_rank = local_experts(module) if is_moe_model(module) else {}
    in_file = lambda name, p: global_name(name, ep_rank_of(p), per_rank) if ep_size_of(p) > 1 else name  # noqa: E731
    checked, masters, max_diff, master_diff = 0, 0, 0.0, 0.0
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        params = [(prefix + n, p) for n, p in mod.named_parameters(recurse=False) if in_file(prefix + n, p) in src.source]
        wanted = {name: src.get(in_file(name, p)) for name, p in params}  # each tensor read once
        if tp:  # AutoTP: this rank's slice of each
            wanted = {name: tp.local(name, wanted[name]).reshape(tuple(getattr(p, "ds_shape", p.shape)))
                      for name, p in params}
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            for name, p in params:
                max_diff = max(max_diff, _max_diff(p, wanted[name].to(p.dtype)))
                checked += 1
        for name, p in params:
            master = get_fp32_master(trainer.engine, p) if p.requires_grad and trainer.engine.optimizer else None
            if master is not None:
                masters += 1
                want = wanted[name] if wanted[name].dtype == torch.float32 else wanted[name].to(p.dtype)
                master_diff = max(master_diff, _max_diff(master, want))
        for n, b in mod.named_buffers(recurse=False):
            if b is not None and prefix + n in src.source:
                max_diff = max(max_diff, _max_diff(b, src.get(prefix + n).to(b.dtype)))
                checked += 1
    source = getattr(trainer, "client_source", None)
    if restored is not None and source is not None:
        now = trainer.client_state()  # read before anything draws random numbers
        for key in restored.restored:
            got, want = (now["args"]["seed"], source["args"]["seed"]) if key == "args.seed" else \
                (now[key], _as_restored(key, source[key]))
            if not states_equal(got, want):
                raise VerificationError(f"client state {key!r}: the restored value differs from its source")
    report = {"rank": eng.rank(), "tensors_checked": checked, "max_abs_diff": max_diff,
              "fp32_masters_checked": masters, "fp32_master_max_abs_diff": master_diff,
              "client_state_keys_restored": restored.restored if restored else [],
              "client_state_keys_left_alone": restored.left_alone if restored else []}
    if max_diff or master_diff:
        raise VerificationError(f"rank {eng.rank()}: loaded weights differ from {weights} "
                                f"(max abs diff {max_diff}, fp32 masters {master_diff})")
    return report


def _as_restored(key: str, value: Any) -> Any:
    """The source's value as the trainer holds it (HF's float epoch is the epoch index)."""
    return int(value) if key == "epoch" and isinstance(value, float) else value
